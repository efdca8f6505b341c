"""What bound an ended job (issue 48): each round stores its running jobs' diagnosis (the one
every view reads, scheduler/service/diagnosis.py) on their rows, so the history shows the model's
bound and predicted throughput of the last round a job ran in, on a real SQLite file and a real
PostgreSQL server (migration 0011)."""

from __future__ import annotations

import sqlalchemy as sa

from scheduler.service.cli import build_service
from scheduler.service.db.models import Job
from scheduler.service.scheduler_process import NewDataset, NewJob, Principal

try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

ALICE = Principal("alice")


def test_an_ended_job_keeps_the_models_last_bound(db_url: str, tmp_path) -> None:
    # 100 MB/s of remote IO shared by a job wanting 4 x 114 MB/s: the model says remote IO (or
    # cache) binds it, not its GPUs; the other job never runs (2 GPUs in the cluster).
    svc = build_service(db=db_url, backend="null", round_s=360, gpus="4", gpus_per_node="4", cache="1GB",
                        remote_io="100MB/s", state_dir=tmp_path / "state", policy="fifo")
    try:
        svc.register_dataset(ALICE, NewDataset("imagenet", "s3://b/imagenet", 143e9))
        ran = svc.submit_job(ALICE, NewJob("ran", 4, "imagenet", epochs=1, model="resnet50")).id
        never = svc.submit_job(ALICE, NewJob("never", 4, "imagenet", epochs=1, model="resnet50")).id
        svc.run_round("test")
        live = svc.get_job(ALICE, ran)
        assert live.state == "running" and live.bottleneck is not None
        assert live.bottleneck.bound in ("remote_io", "cache")
        # Stored by the round, equal to what the live view diagnoses.
        assert live.last_bound == live.bottleneck.bound
        assert abs(live.last_predicted_throughput - live.bottleneck.throughput) <= 0.01 * live.bottleneck.throughput
        first_at = live.last_bound_at
        assert first_at is not None

        # A steady round rewrites nothing: the stored diagnosis and its time stay.
        svc.run_round("steady")
        assert svc.get_job(ALICE, ran).last_bound_at == first_at

        svc.cancel_job(ALICE, ran)
        svc.cancel_job(ALICE, never)
        svc.run_round("after")
        ended = {j.id: j for j in svc.list_jobs(ALICE, state="ended")}
        assert ended[ran].bottleneck is None  # no live diagnosis of an ended job...
        assert ended[ran].last_bound == live.bottleneck.bound  # ...but the last one the model made
        assert ended[ran].last_predicted_throughput == live.last_predicted_throughput
        assert ended[never].last_bound is None and ended[never].last_predicted_throughput is None  # never ran
        with svc.sessions() as s:  # the row itself holds it (a restart keeps it)
            assert s.scalar(sa.select(Job.last_bound).where(Job.id == int(ran))) == live.bottleneck.bound
    finally:
        svc.close()
