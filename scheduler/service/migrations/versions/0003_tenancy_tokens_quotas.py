"""Trust boundaries: hashed API tokens, datasets per tenant (unique per owner, grants,
credentials), quotas, idempotency keys and the scheduling leader's lease.

Revision ID: 0003
Revises: 0002 (0002_job_access_pattern; both were written as 0002 on parallel branches, this one
was re-chained after it when they were merged so that the history is linear)
Create Date: 2026-11-23 14:50:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('is_admin', sa.Boolean(), nullable=False),
    sa.Column('label', sa.String(length=128), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('digest', name=op.f('uq_api_tokens_digest'))
    )
    op.create_table('credentials',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('access_key_id', sa.String(length=256), nullable=False),
    sa.Column('secret_access_key', sa.Text(), nullable=False),
    sa.Column('endpoint_url', sa.String(length=2048), nullable=True),
    sa.Column('region', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_credentials')),
    sa.UniqueConstraint('owner', 'name', name='uq_credentials_owner_name')
    )
    op.create_table('quotas',
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=True),
    sa.Column('cache_bytes', sa.Float(), nullable=True),
    sa.Column('running_jobs', sa.Integer(), nullable=True),
    sa.Column('queued_jobs', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('tenant', name=op.f('pk_quotas'))
    )
    op.create_table('leases',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_leases'))
    )
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('credential_id', sa.Integer(), nullable=True))
        batch_op.drop_constraint('uq_datasets_name', type_='unique')
        batch_op.create_unique_constraint('uq_datasets_owner_name', ['owner', 'name'])
        batch_op.create_foreign_key(
            batch_op.f('fk_datasets_credential_id_credentials'), 'credentials', ['credential_id'], ['id'])
    op.create_table('dataset_grants',
    sa.Column('dataset_id', sa.Integer(), nullable=False),
    sa.Column('grantee', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_dataset_grants_dataset_id_datasets')),
    sa.PrimaryKeyConstraint('dataset_id', 'grantee', name=op.f('pk_dataset_grants'))
    )
    op.create_table('idempotency_keys',
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=128), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_idempotency_keys_job_id_jobs')),
    sa.PrimaryKeyConstraint('owner', 'key', name=op.f('pk_idempotency_keys'))
    )


def downgrade() -> None:
    op.drop_table('idempotency_keys')
    op.drop_table('dataset_grants')
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_datasets_credential_id_credentials'), type_='foreignkey')
        batch_op.drop_constraint('uq_datasets_owner_name', type_='unique')
        batch_op.create_unique_constraint('uq_datasets_name', ['name'])
        batch_op.drop_column('credential_id')
    op.drop_table('leases')
    op.drop_table('quotas')
    op.drop_table('credentials')
    op.drop_table('api_tokens')
