"""A round reuses the previous round's JobView of an unchanged row (scheduler/service/round_jobs.py):
every change to what a view or the admission is built from shows in the next round's snapshot,
exactly as a round that built every view afresh would see it."""

from __future__ import annotations

import sqlalchemy as sa

from estimator.access import AccessPattern
from estimator.pipeline import InputPipeline
from scheduler.service.cli import build_service
from scheduler.service.db.models import Dataset, Job, JobMeasurementRow
from scheduler.service.measured_params import CLIENT_REPORT_TTL_S
from scheduler.service.round_jobs import RoundJobs
from scheduler.service.scheduler_process import NewDataset, NewJob, Principal, TenantQuota

try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
except ImportError:
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

ALICE, BOB, ADMIN = Principal("alice"), Principal("bob"), Principal("admin", is_admin=True)


def _service(url: str, tmp_path):  # type: ignore[no-untyped-def]
    svc = build_service(db=url, backend="null", policy="fifo", round_s=360, gpus="16", gpus_per_node="4",
                        cache="200GB", remote_io="1GB/s", state_dir=tmp_path / "state")
    svc.register_dataset(ALICE, NewDataset("imagenet", "s3://b/imagenet", 143e9))
    svc.register_dataset(BOB, NewDataset("oi", "s3://b/oi", 660e9))
    return svc


def _read(svc, now: float):  # type: ignore[no-untyped-def]
    """(reusing views, every view built afresh): the two must always agree."""
    inp = svc._round_input(now)
    cached, svc._round_jobs = svc._round_jobs, RoundJobs()
    try:
        ref = svc._round_input(now)
    finally:
        svc._round_jobs = cached
    assert inp.snapshot.jobs == ref.snapshot.jobs
    assert list(inp.snapshot.datasets.items()) == list(ref.snapshot.datasets.items())
    assert inp.held_back == ref.held_back
    return inp


def _views(inp) -> dict:  # type: ignore[no-untyped-def]
    return {v.job_id: v for v in (*inp.snapshot.jobs, *inp.held_back)}


def _update(svc, job_id: str, **values) -> None:  # type: ignore[no-untyped-def]
    with svc.sessions.begin() as s:
        s.execute(sa.update(Job).where(Job.id == int(job_id)).values(**values))


def test_every_changed_row_shows_in_the_next_round(db_url, tmp_path) -> None:
    svc = _service(db_url, tmp_path)
    try:
        cl = AccessPattern.curriculum_learning(0.2, 2.0, 100, 256)
        a = svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=1, ideal_throughput=400e6)).id
        b = svc.submit_job(ALICE, NewJob("b", 4, "imagenet", epochs=2, ideal_throughput=300e6, access=cl,
                                         pipeline=InputPipeline(50e6))).id
        c = svc.submit_job(BOB, NewJob("c", 8, "oi", epochs=1, ideal_throughput=800e6)).id
        d = svc.submit_job(BOB, NewJob("d", 2, "oi", epochs=1, ideal_throughput=200e6, access=cl)).id
        now = 1.9e9
        first = _views(_read(svc, now))
        assert set(first) == {a, b, c, d}
        assert _views(_read(svc, now)) == first  # nothing changed: the same views

        _update(svc, a, consumed_bytes=40e9)  # progress
        assert _views(_read(svc, now))[a].remaining_bytes == first[a].remaining_bytes - 40e9

        _update(svc, c, state="running", start_time=now)  # state
        assert _views(_read(svc, now))[c].running

        _update(svc, d, priority=5)  # priority
        assert _views(_read(svc, now))[d].priority == 5

        _update(svc, b, cpu_rate=70e6, access="irregular", curriculum_starting_percent=None, curriculum_alpha=None,
                curriculum_step=None, curriculum_batch=None)  # pipeline and access pattern
        v = _views(_read(svc, now))[b]
        assert v.pipeline == InputPipeline(70e6) and not v.access.regular and v.access != cl

        with svc.sessions.begin() as s:  # a new measurement of f* (within its caps)
            s.add(JobMeasurementRow(job_id=int(a), ideal_throughput=500e6, ideal_evidence_s=30.0, cpu_evidence_s=0.0,
                                    max_observed=500e6, best_per_core=0.0, bound="gpu", updated_at=now))
        assert _views(_read(svc, now))[a].ideal_throughput == 500e6

        # A client report lowers f* while fresh, and no longer once it is stale: the row is the
        # same, only the time moved.
        svc.measurements.record_client_report(int(c), 0.5, 100e6, "bob", now)  # 200 MB/s
        assert _views(_read(svc, now))[c].ideal_throughput == 200e6
        assert _views(_read(svc, now + CLIENT_REPORT_TTL_S + 1))[c].ideal_throughput == 800e6

        # A quota: bob may hold 8 GPUs; c runs, so d is held back; lifting it admits d again.
        svc.catalogue.set_quota(ADMIN, "bob", TenantQuota(gpus=8))
        inp = _read(svc, now)
        assert [v.job_id for v in inp.held_back] == [d]
        svc.catalogue.set_quota(ADMIN, "bob", TenantQuota())
        inp = _read(svc, now)
        assert not inp.held_back and d in {v.job_id for v in inp.snapshot.jobs}

        with svc.sessions.begin() as s:  # a dataset's size (the bound on its measured cache)
            s.execute(sa.update(Dataset).where(Dataset.name == "oi").values(size=700e9))
        inp = _read(svc, now)
        assert inp.snapshot.datasets[inp.snapshot.jobs[-1].dataset].size == 700e9

        _update(svc, a, state="cancelled", finish_time=now)  # a job that ends leaves the snapshot
        inp = _read(svc, now)
        assert a not in _views(inp) and set(_views(inp)) == {b, c, d}
    finally:
        svc.close()
