"""Cache allocations record the dataset's autocaching choice (issue 22): `expansion` is the bytes
cached per source byte when the cache holds its readers' preprocessed data; NULL = source bytes
(what every existing allocation holds).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 17:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('cache_allocations') as batch:
        batch.add_column(sa.Column('expansion', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('cache_allocations') as batch:
        batch.drop_column('expansion')
