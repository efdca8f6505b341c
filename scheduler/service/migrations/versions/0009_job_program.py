"""The program a local-backend job runs (issue 49): its command and environment as JSON, NULL
for the built-in stand-in worker (every job before this revision).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 05:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('program', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('program')
