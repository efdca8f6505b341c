"""A tenant's range of declared work (issue 47): `quotas.min_work` and `quotas.max_work` are the
least and the most bytes of work (epochs x dataset size, or steps x step_bytes) a tenant's job
may declare; NULL = the service's default (`--default-quota min_work=SIZE,max_work=SIZE`), else
no bound.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 08:30:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('quotas') as batch:
        batch.add_column(sa.Column('min_work', sa.Float(), nullable=True))
        batch.add_column(sa.Column('max_work', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('quotas') as batch:
        batch.drop_column('max_work')
        batch.drop_column('min_work')
