"""Initial schema: datasets, jobs, current allocations (per job, per dataset cache), rounds,
the allocation audit trail and settings.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-22 02:47:36.680158
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('datasets',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('uri', sa.String(length=2048), nullable=False),
    sa.Column('size', sa.Float(), nullable=False),
    sa.Column('item_count', sa.Integer(), nullable=True),
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_datasets')),
    sa.UniqueConstraint('name', name=op.f('uq_datasets_name'))
    )
    op.create_table('rounds',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('time', sa.Float(), nullable=False),
    sa.Column('policy', sa.String(length=64), nullable=False),
    sa.Column('reason', sa.String(length=64), nullable=False),
    sa.Column('active_jobs', sa.Integer(), nullable=False),
    sa.Column('running_jobs', sa.Integer(), nullable=False),
    sa.Column('changes', sa.Integer(), nullable=False),
    sa.Column('duration_s', sa.Float(), nullable=False),
    sa.Column('objective', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rounds'))
    )
    op.create_table('settings',
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_settings'))
    )
    op.create_table('allocation_changes',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('round_id', sa.Integer(), nullable=True),
    sa.Column('time', sa.Float(), nullable=False),
    sa.Column('subject_kind', sa.String(length=16), nullable=False),
    sa.Column('subject', sa.String(length=128), nullable=False),
    sa.Column('resource', sa.String(length=16), nullable=False),
    sa.Column('old_value', sa.Float(), nullable=True),
    sa.Column('new_value', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['round_id'], ['rounds.id'], name=op.f('fk_allocation_changes_round_id_rounds')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_allocation_changes'))
    )
    with op.batch_alter_table('allocation_changes', schema=None) as batch_op:
        batch_op.create_index('ix_allocation_changes_subject', ['subject_kind', 'subject'], unique=False)

    op.create_table('cache_allocations',
    sa.Column('dataset_id', sa.Integer(), nullable=False),
    sa.Column('bytes', sa.Float(), nullable=False),
    sa.Column('round_id', sa.Integer(), nullable=True),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_cache_allocations_dataset_id_datasets')),
    sa.PrimaryKeyConstraint('dataset_id', name=op.f('pk_cache_allocations'))
    )
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('dataset_id', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=64), nullable=True),
    sa.Column('ideal_throughput', sa.Float(), nullable=False),
    sa.Column('epochs', sa.Float(), nullable=True),
    sa.Column('steps', sa.Integer(), nullable=True),
    sa.Column('step_bytes', sa.Float(), nullable=True),
    sa.Column('total_bytes', sa.Float(), nullable=False),
    sa.Column('consumed_bytes', sa.Float(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('state', sa.Enum('queued', 'running', 'finished', 'failed', 'cancelled', name='job_state', native_enum=False, length=16), nullable=False),
    sa.Column('submit_time', sa.Float(), nullable=False),
    sa.Column('start_time', sa.Float(), nullable=True),
    sa.Column('finish_time', sa.Float(), nullable=True),
    sa.Column('message', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_jobs_dataset_id_datasets')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_owner', ['owner'], unique=False)
        batch_op.create_index('ix_jobs_state_submit', ['state', 'submit_time'], unique=False)

    op.create_table('job_allocations',
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('gpu_share', sa.Float(), nullable=False),
    sa.Column('remote_io', sa.Float(), nullable=True),
    sa.Column('running', sa.Boolean(), nullable=False),
    sa.Column('round_id', sa.Integer(), nullable=True),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_allocations_job_id_jobs')),
    sa.PrimaryKeyConstraint('job_id', name=op.f('pk_job_allocations'))
    )


def downgrade() -> None:
    op.drop_table('job_allocations')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_state_submit')
        batch_op.drop_index('ix_jobs_owner')

    op.drop_table('jobs')
    op.drop_table('cache_allocations')
    with op.batch_alter_table('allocation_changes', schema=None) as batch_op:
        batch_op.drop_index('ix_allocation_changes_subject')

    op.drop_table('allocation_changes')
    op.drop_table('settings')
    op.drop_table('rounds')
    op.drop_table('datasets')
