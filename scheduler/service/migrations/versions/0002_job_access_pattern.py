"""Jobs declare their access pattern (epoch | curriculum | irregular) and the curriculum pacing.

Existing jobs become `epoch`, the behaviour they had before.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 15:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('access', sa.String(length=16), server_default='epoch', nullable=False))
        batch.add_column(sa.Column('curriculum_starting_percent', sa.Float(), nullable=True))
        batch.add_column(sa.Column('curriculum_alpha', sa.Float(), nullable=True))
        batch.add_column(sa.Column('curriculum_step', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('curriculum_batch', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('curriculum_batch')
        batch.drop_column('curriculum_step')
        batch.drop_column('curriculum_alpha')
        batch.drop_column('curriculum_starting_percent')
        batch.drop_column('access')
