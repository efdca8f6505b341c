"""A tenant's declared-f* ceiling (issue 47): `quotas.ideal_per_gpu` is the most f* per GPU a
tenant's job may declare (bytes/s per GPU); NULL = the service's default (`--default-quota
fstar=RATE`, else 1 GB/s per GPU x --gpu-speed). And an index of the waiting queue's order
(state, priority, submit_time): the overview counts the jobs ahead of a caller's job over it
instead of loading every tenant's jobs. And `tenant_job_counts`,
each tenant's jobs per state, kept by triggers on `jobs`: a submission reads its tenant's counts
instead of counting rows (counting a tenant's 10,000 jobs cost more than the rest of it).

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


# Kept by triggers, so every write path (submissions, rounds, events, cancels, recovery, tools
# writing the file) counts, in the writing transaction.
_SQLITE_TRIGGERS = (
    """CREATE TRIGGER tenant_job_counts_insert AFTER INSERT ON jobs BEGIN
        INSERT INTO tenant_job_counts (owner, state, n) VALUES (NEW.owner, NEW.state, 1)
        ON CONFLICT (owner, state) DO UPDATE SET n = n + 1;
    END""",
    """CREATE TRIGGER tenant_job_counts_update AFTER UPDATE OF state, owner ON jobs
    WHEN OLD.state IS NOT NEW.state OR OLD.owner IS NOT NEW.owner BEGIN
        UPDATE tenant_job_counts SET n = n - 1 WHERE owner = OLD.owner AND state = OLD.state;
        INSERT INTO tenant_job_counts (owner, state, n) VALUES (NEW.owner, NEW.state, 1)
        ON CONFLICT (owner, state) DO UPDATE SET n = n + 1;
    END""",
    """CREATE TRIGGER tenant_job_counts_delete AFTER DELETE ON jobs BEGIN
        UPDATE tenant_job_counts SET n = n - 1 WHERE owner = OLD.owner AND state = OLD.state;
    END""",
)
_PG_FUNCTION = """CREATE FUNCTION tenant_job_counts_keep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        UPDATE tenant_job_counts SET n = n - 1 WHERE owner = OLD.owner AND state = OLD.state;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO tenant_job_counts (owner, state, n) VALUES (NEW.owner, NEW.state, 1)
        ON CONFLICT (owner, state) DO UPDATE SET n = tenant_job_counts.n + 1;
    END IF;
    RETURN NULL;
END $$"""
_PG_TRIGGERS = (
    "CREATE TRIGGER tenant_job_counts_insert AFTER INSERT ON jobs FOR EACH ROW EXECUTE FUNCTION tenant_job_counts_keep()",
    "CREATE TRIGGER tenant_job_counts_update AFTER UPDATE OF state, owner ON jobs FOR EACH ROW"
    " WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.owner IS DISTINCT FROM NEW.owner)"
    " EXECUTE FUNCTION tenant_job_counts_keep()",
    "CREATE TRIGGER tenant_job_counts_delete AFTER DELETE ON jobs FOR EACH ROW EXECUTE FUNCTION tenant_job_counts_keep()",
)


def upgrade() -> None:
    op.create_table('tenant_job_counts',
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('owner', 'state', name=op.f('pk_tenant_job_counts'))
    )
    op.execute("INSERT INTO tenant_job_counts (owner, state, n) SELECT owner, state, count(*) FROM jobs GROUP BY owner, state")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION)
        for t in _PG_TRIGGERS:
            op.execute(t)
    else:
        for t in _SQLITE_TRIGGERS:
            op.execute(t)
    with op.batch_alter_table('quotas') as batch:
        batch.add_column(sa.Column('ideal_per_gpu', sa.Float(), nullable=True))
    op.create_index('ix_jobs_state_priority_submit', 'jobs', ['state', 'priority', 'submit_time'], unique=False)


def downgrade() -> None:
    for name in ("insert", "update", "delete"):
        if op.get_bind().dialect.name == "postgresql":
            op.execute(f"DROP TRIGGER tenant_job_counts_{name} ON jobs")
        else:
            op.execute(f"DROP TRIGGER tenant_job_counts_{name}")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION tenant_job_counts_keep()")
    op.drop_table('tenant_job_counts')
    op.drop_index('ix_jobs_state_priority_submit', table_name='jobs')
    with op.batch_alter_table('quotas') as batch:
        batch.drop_column('ideal_per_gpu')
