"""The schema comes from the Alembic migrations, matches the ORM models, and state survives a
restart of the service, on a real SQLite file and a real PostgreSQL server."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from scheduler.service.db import open_database
from scheduler.service.db.models import AllocationChange, Base, CacheAllocationRow, JobAllocationRow
from scheduler.service.scheduler_process import NewDataset, NewJob, Principal
from scheduler.service.cli import build_service

try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

ALICE = Principal("alice")
ADMIN = Principal("admin", is_admin=True)


def _service(url: str, tmp_path, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("policy", "fifo")
    return build_service(db=url, backend="null", round_s=360, gpus="8", gpus_per_node="4", cache="200GB",
                         remote_io="1GB/s", state_dir=tmp_path / "state", **kw)


def test_migrations_create_the_model_schema(db_url: str) -> None:
    engine = open_database(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
            version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
        assert diff == [], f"models and migrations disagree: {diff}"
        assert version == "0014"
        # Idempotent: opening again (a restart) runs no migration and keeps the version.
        open_database(db_url).dispose()
    finally:
        engine.dispose()


def test_database_at_0002_upgrades_and_keeps_access_patterns(db_url: str) -> None:
    """A database created before the tenancy migration (0002: jobs with access patterns) upgrades
    to head with one linear history, and a curriculum job keeps its pacing."""
    from alembic import command
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from scheduler.service.db.engine import MIGRATIONS_DIR, make_engine

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    assert len(ScriptDirectory.from_config(cfg).get_heads()) == 1, "migrations must form one linear history"
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0002")
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO datasets (id, name, uri, size, item_count, owner, created_at) "
                                 "VALUES (1, 'ds', 's3://b/ds', 1e9, NULL, 'alice', 0)"))
            conn.execute(sa.text(
                "INSERT INTO jobs (id, name, owner, gpus, dataset_id, model, ideal_throughput, epochs, steps, step_bytes,"
                " total_bytes, consumed_bytes, priority, state, submit_time, message, access,"
                " curriculum_starting_percent, curriculum_alpha, curriculum_step, curriculum_batch)"
                " VALUES (1, 'cl', 'alice', 1, 1, NULL, 1e8, 1, NULL, NULL, 1e9, 0, 0, 'queued', 0, '', 'curriculum',"
                " 0.1, 2.0, 100, 32)"))
    finally:
        engine.dispose()
    engine = open_database(db_url)  # upgrades to head
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0014"
            row = conn.execute(sa.text("SELECT access, curriculum_alpha, curriculum_batch FROM jobs WHERE id = 1")).one()
            pipeline = conn.execute(sa.text("SELECT cpu_rate, autocache_expansion, post_cpu_rate FROM jobs WHERE id = 1")).one()
            # 0009: an existing job runs the stand-in worker, as before
            assert conn.execute(sa.text("SELECT program FROM jobs WHERE id = 1")).scalar() is None
            # 0010: no tenant had a work range: the default quota's applies
            assert conn.execute(sa.text("SELECT count(*) FROM quotas WHERE min_work IS NOT NULL")).scalar() == 0
            # 0011: an existing job was never diagnosed: it has no stored bound
            assert conn.execute(sa.text("SELECT last_bound, last_predicted_throughput FROM jobs WHERE id = 1")).one() == (None, None)
            # 0013: an existing job declared no loader: the paper's model, as before
            assert conn.execute(sa.text("SELECT loader_workers, loader_item_bytes FROM jobs WHERE id = 1")).one() == (None, None)
        with engine.begin() as conn:
            # 0014: a pod row written as an agent from before the miss-service counters writes it
            # reads as no miss served (the paper's model for its job), not NULL
            conn.execute(sa.text("INSERT INTO pod_consumption (node, pod_uid, job_id, agent, read_bytes, hit_bytes, miss_bytes,"
                                 " hits, misses, first_at, updated_at) VALUES ('n1', 'u1', 1, 'a', 10, 4, 6, 1, 1, 0, 0)"))
            assert conn.execute(sa.text("SELECT miss_service_count, miss_service_us, miss_service_bytes FROM pod_consumption")).one() == (0, 0, 0)
        assert tuple(row) == ("curriculum", 2.0, 32)
        assert tuple(pipeline) == (None, None, None)  # 0005: an existing job is not CPU-bound, as before
    finally:
        engine.dispose()


def test_sqlite_uses_wal(tmp_path) -> None:
    engine = open_database(f"sqlite:///{tmp_path / 'w.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()


def test_state_survives_restart(db_url: str, tmp_path) -> None:
    svc = _service(db_url, tmp_path, policy="gavel")
    svc.register_dataset(ALICE, NewDataset("imagenet", "s3://b/imagenet", 143e9, item_count=1_281_167))
    ids = [svc.submit_job(ALICE, NewJob(f"j{i}", 4, "imagenet", epochs=1.5, model="resnet50")).id for i in range(3)]
    r = svc.run_round("test")
    assert len(r.running) == 2 and r.changes > 0
    before_alloc = svc.allocations(ADMIN)
    with svc.sessions() as s:
        audit_before = s.scalar(sa.select(sa.func.count()).select_from(AllocationChange))
    svc.close()

    svc2 = _service(db_url, tmp_path, policy=None)  # no --policy: the persisted one is used
    try:
        assert svc2.policy_name == "gavel"
        jobs = svc2.list_jobs(ADMIN)
        assert [j.id for j in jobs] == ids
        assert all(j.total_bytes == 1.5 * 143e9 and j.ideal_throughput == 4 * 114e6 for j in jobs)
        assert svc2.get_dataset(ALICE, "imagenet").item_count == 1_281_167
        # Allocations are still in the database before the restarted service recovers.
        assert svc2.allocations(ADMIN).cache == before_alloc.cache
        with svc2.sessions() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(AllocationChange)) == audit_before
            assert s.scalar(sa.select(sa.func.count()).select_from(JobAllocationRow)) == 3
            assert s.scalar(sa.select(sa.func.count()).select_from(CacheAllocationRow)) == 1
        # Recovery: the new backend runs nothing, so previously running jobs are requeued and
        # restarted by the next round from where they were.
        svc2.recover()
        assert {j.state for j in svc2.list_jobs(ADMIN)} == {"queued"}
        r2 = svc2.run_round("test")
        assert len(r2.started) == 2
        assert {spec.job_id for spec, _ in svc2.backend.started} == set(r2.started)
    finally:
        svc2.close()
