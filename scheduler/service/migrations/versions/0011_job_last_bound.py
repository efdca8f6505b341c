"""What bound a job as last diagnosed (issue 48): `jobs.last_bound` (gpu | cpu | cache | remote_io
..., estimator.pipeline.diagnose's label), `jobs.last_predicted_throughput` (bytes/s) and
`jobs.last_bound_at` (the round's time) are written by each round for its running jobs whose
diagnosis changed, so an ended job keeps the model's diagnosis of the last round it ran in.
NULL: never diagnosed (e.g. a job that never ran, or one that ended before this migration).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 09:20:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('last_bound', sa.String(length=16), nullable=True))
        batch.add_column(sa.Column('last_predicted_throughput', sa.Float(), nullable=True))
        batch.add_column(sa.Column('last_bound_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('last_bound_at')
        batch.drop_column('last_predicted_throughput')
        batch.drop_column('last_bound')
