"""A job's data loader (issue 49): `jobs.loader_workers` (its loader's worker processes) and
`jobs.loader_item_bytes` (the size of one item it reads, optional), declared at submission; and
what the data plane measured of its misses: `job_measurements.miss_service_s` (the mean time a
missed item held its reader, open request to last byte), `miss_item_bytes` (the mean size of those
items) and `miss_service_n` (how many misses that mean stands for, capped). Together they give the
estimator's loader term m = W s / L (estimator.loader_miss_rate). NULL: not declared / not
measured, and the job is planned and diagnosed with the paper's model, as before.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 13:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('loader_workers', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('loader_item_bytes', sa.Float(), nullable=True))
    with op.batch_alter_table('job_measurements') as batch:
        batch.add_column(sa.Column('miss_service_s', sa.Float(), nullable=True))
        batch.add_column(sa.Column('miss_item_bytes', sa.Float(), nullable=True))
        batch.add_column(sa.Column('miss_service_n', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job_measurements') as batch:
        batch.drop_column('miss_service_n')
        batch.drop_column('miss_item_bytes')
        batch.drop_column('miss_service_s')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('loader_item_bytes')
        batch.drop_column('loader_workers')
