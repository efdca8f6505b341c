"""A tenant's declared-f* ceiling (issue 47): `quotas.ideal_per_gpu` is the most f* per GPU a
tenant's job may declare (bytes/s per GPU); NULL = the service's default (`--default-quota
fstar=RATE`, else 1 GB/s per GPU x --gpu-speed).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 05:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('quotas') as batch:
        batch.add_column(sa.Column('ideal_per_gpu', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('quotas') as batch:
        batch.drop_column('ideal_per_gpu')
