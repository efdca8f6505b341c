"""A pod's misses' service time, as its node agent reports it (issue 49):
`pod_consumption.miss_service_count` (its misses delivered whole), `miss_service_us` (their summed
service time, microseconds) and `miss_service_bytes` (their bytes), cumulative and max-merged like
the other counters. A Kubernetes pod's job gets the loader term's L (estimator.loader_miss_rate)
from them. Rows of older agents: 0, no miss measured (the paper's model, as before).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 16:20:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pod_consumption') as batch:
        for name in ('miss_service_count', 'miss_service_us', 'miss_service_bytes'):
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('pod_consumption') as batch:
        for name in ('miss_service_bytes', 'miss_service_us', 'miss_service_count'):
            batch.drop_column(name)
