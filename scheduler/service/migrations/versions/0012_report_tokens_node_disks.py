"""Issue 44, round 3.

Job-scoped report tokens: `api_tokens.job_id` binds a token to one job. Such a token may only
post that job's step reports (POST /v1/jobs/{id}/report); it is minted when the job starts (a
local program's SILOD_TOKEN, a Kubernetes pod's Secret) and revoked when the job ends. NULL: an
ordinary token of its owner.

Agent-reported cache disks: `node_cache_disks` holds, per node, the bytes its node agent says
its cache directory can hold (statvfs, capped by the agent's --cache-size) and when it said so;
the Kubernetes backend plans with it while it is fresh.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 12:40:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('api_tokens') as batch:
        batch.add_column(sa.Column('job_id', sa.Integer(), nullable=True))
        batch.create_index('ix_api_tokens_job_id', ['job_id'])
    op.create_table(
        'node_cache_disks',
        sa.Column('node', sa.String(length=253), primary_key=True),
        sa.Column('capacity_bytes', sa.Float(), nullable=False),
        sa.Column('agent', sa.String(length=128), nullable=False),
        sa.Column('reported_at', sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('node_cache_disks')
    with op.batch_alter_table('api_tokens') as batch:
        batch.drop_index('ix_api_tokens_job_id')
        batch.drop_column('job_id')
