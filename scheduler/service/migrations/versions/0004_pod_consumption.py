"""Trusted consumption: the pods of admitted workloads (written by the scheduling leader from the
API server) and the node agents' per-pod read counters (POST /v1/agents/{node}/consumption).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 18:20:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('workload_pods',
    sa.Column('pod_uid', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('node', sa.String(length=253), nullable=False),
    sa.Column('namespace', sa.String(length=63), nullable=False),
    sa.Column('name', sa.String(length=253), nullable=False),
    sa.Column('seen_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_workload_pods_job_id_jobs')),
    sa.PrimaryKeyConstraint('pod_uid', name=op.f('pk_workload_pods'))
    )
    op.create_index(op.f('ix_workload_pods_job_id'), 'workload_pods', ['job_id'], unique=False)
    op.create_table('pod_consumption',
    sa.Column('node', sa.String(length=253), nullable=False),
    sa.Column('pod_uid', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('agent', sa.String(length=64), nullable=False),
    sa.Column('read_bytes', sa.BigInteger(), nullable=False),
    sa.Column('hit_bytes', sa.BigInteger(), nullable=False),
    sa.Column('miss_bytes', sa.BigInteger(), nullable=False),
    sa.Column('hits', sa.BigInteger(), nullable=False),
    sa.Column('misses', sa.BigInteger(), nullable=False),
    sa.Column('first_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_pod_consumption_job_id_jobs')),
    sa.PrimaryKeyConstraint('node', 'pod_uid', name=op.f('pk_pod_consumption'))
    )
    op.create_index(op.f('ix_pod_consumption_job_id'), 'pod_consumption', ['job_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_pod_consumption_job_id'), table_name='pod_consumption')
    op.drop_table('pod_consumption')
    op.drop_index(op.f('ix_workload_pods_job_id'), table_name='workload_pods')
    op.drop_table('workload_pods')
