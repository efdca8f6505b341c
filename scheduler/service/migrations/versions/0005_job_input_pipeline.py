"""Jobs declare their CPU preprocessing stage (cpu_rate, autocache_expansion, post_cpu_rate) and
allocations record the CPU cores a job holds (issue 22: the input pipeline as a resource).

Existing jobs get NULL: not CPU-bound, the behaviour they had before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 13:45:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('cpu_rate', sa.Float(), nullable=True))
        batch.add_column(sa.Column('autocache_expansion', sa.Float(), nullable=True))
        batch.add_column(sa.Column('post_cpu_rate', sa.Float(), nullable=True))
    with op.batch_alter_table('job_allocations') as batch:
        batch.add_column(sa.Column('cpu', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job_allocations') as batch:
        batch.drop_column('cpu')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('post_cpu_rate')
        batch.drop_column('autocache_expansion')
        batch.drop_column('cpu_rate')
