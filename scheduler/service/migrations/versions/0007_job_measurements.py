"""Measured, self-correcting job parameters (issue 22): per job, the f* and per-core
preprocessing rate the scheduler estimates from the data plane's measurements, and the job's
latest client report (step time, batch size).

A new table: existing jobs have no row, i.e. nothing measured yet (planning uses the declared
values, as before).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 17:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('job_measurements',
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('ideal_throughput', sa.Float(), nullable=True),
    sa.Column('ideal_evidence_s', sa.Float(), nullable=False),
    sa.Column('cpu_rate', sa.Float(), nullable=True),
    sa.Column('cpu_evidence_s', sa.Float(), nullable=False),
    sa.Column('max_observed', sa.Float(), nullable=False),
    sa.Column('best_per_core', sa.Float(), nullable=False),
    sa.Column('observed', sa.Float(), nullable=True),
    sa.Column('bound', sa.String(length=16), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=True),
    sa.Column('client_step_s', sa.Float(), nullable=True),
    sa.Column('client_batch_bytes', sa.Float(), nullable=True),
    sa.Column('client_reporter', sa.String(length=128), nullable=True),
    sa.Column('client_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_measurements_job_id_jobs')),
    sa.PrimaryKeyConstraint('job_id', name=op.f('pk_job_measurements'))
    )


def downgrade() -> None:
    op.drop_table('job_measurements')
