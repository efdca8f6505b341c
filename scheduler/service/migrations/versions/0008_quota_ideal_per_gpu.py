"""A tenant's declared-f* ceiling (issue 47): `quotas.ideal_per_gpu` is the most f* per GPU a
tenant's job may declare (bytes/s per GPU); NULL = the service's default (`--default-quota
fstar=RATE`, else 1 GB/s per GPU x --gpu-speed). And an index of the waiting queue's order
(state, priority, submit_time): the overview counts the jobs ahead of a caller's job over it
instead of loading every tenant's jobs; and (owner, state): a tenant's active jobs are counted
at each submission (the object limit `jobs`, the quota `queued_jobs`).

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
    op.create_index('ix_jobs_state_priority_submit', 'jobs', ['state', 'priority', 'submit_time'], unique=False)
    op.create_index('ix_jobs_owner_state', 'jobs', ['owner', 'state'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_jobs_owner_state', table_name='jobs')
    op.drop_index('ix_jobs_state_priority_submit', table_name='jobs')
    with op.batch_alter_table('quotas') as batch:
        batch.drop_column('ideal_per_gpu')
