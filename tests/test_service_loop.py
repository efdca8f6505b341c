"""The scheduling loop: rounds start and stop jobs through the backend, events update the
database, every allocation change is audited, and cache/IO go to the data manager."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import sqlalchemy as sa

from scheduler.backends.base import JobEvent
from scheduler.service.db.models import AllocationChange, Job, Round
from scheduler.service.scheduler_process import ConflictError, ForbiddenError, NewDataset, NewJob, NotFoundError, Principal, ServiceError
from scheduler.service.cli import build_service

try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
except ImportError:
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

ALICE, BOB, ADMIN = Principal("alice"), Principal("bob"), Principal("admin", is_admin=True)


class RecordingPusher:
    """Stands in for datamanager.client: records what the service pushes (the StoragePusher protocol)."""

    def __init__(self, fail: bool = False):
        self.cache: dict[str, float] = {}
        self.io: dict[str, float] = {}
        self.calls = 0
        self.fail = fail

    def allocate_cache_size(self, dataset: str, bytes: float) -> None:  # noqa: A002
        self.calls += 1
        if self.fail:
            raise ConnectionError("data manager down")
        self.cache[dataset] = bytes

    def allocate_remote_io(self, job_id: str, bytes_per_s: float, workers: int = 1) -> None:
        self.calls += 1
        if self.fail:
            raise ConnectionError("data manager down")
        self.io[job_id] = bytes_per_s

    def status(self) -> dict:
        return {}


def make(url: str, tmp_path, policy: str = "fifo", pusher=None, **kw):  # type: ignore[no-untyped-def]
    svc = build_service(db=url, backend="null", policy=policy, round_s=kw.pop("round_s", 360), gpus="8",
                        gpus_per_node="4", cache=kw.pop("cache", "200GB"), remote_io="1GB/s",
                        state_dir=tmp_path / "state")
    svc.pusher = pusher
    svc.register_dataset(ALICE, NewDataset("imagenet", "s3://b/imagenet", 143e9))
    svc.register_dataset(ALICE, NewDataset("openimages", "s3://b/oi", 660e9))
    svc.catalogue.grant(ALICE, "openimages", "bob")  # bob's jobs read alice's openimages (one cache)
    return svc


def key(svc, name: str, owner: str = "alice") -> str:  # type: ignore[no-untyped-def]
    """A dataset's storage key: its name in the data manager, the snapshot and the audit trail."""
    return svc.get_dataset(ADMIN, name, owner).key


def test_round_starts_fifo_jobs_and_finish_frees_gpus(db_url, tmp_path) -> None:
    pusher = RecordingPusher()
    svc = make(db_url, tmp_path, pusher=pusher)
    try:
        a = svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=1, ideal_throughput=400e6)).id
        b = svc.submit_job(BOB, NewJob("b", 4, "openimages", epochs=1, ideal_throughput=400e6, dataset_owner="alice")).id
        c = svc.submit_job(ALICE, NewJob("c", 8, "imagenet", epochs=1, ideal_throughput=800e6)).id
        r = svc.run_round("test")
        assert set(r.running) == {a, b} and set(r.started) == {a, b}
        started = {spec.job_id: (spec, alloc) for spec, alloc in svc.backend.started}
        spec_a, alloc_a = started[a]
        assert spec_a.dataset.uri == "s3://b/imagenet" and spec_a.total_bytes == 143e9 and alloc_a.gpus == 4
        assert svc.get_job(ALICE, a).state == "running" and svc.get_job(ALICE, c).state == "queued"
        # Storage went to the data manager and matches the persisted allocation.
        alloc = svc.allocations(ADMIN)
        assert pusher.cache == {x.key: x.bytes for x in alloc.cache}
        assert sum(pusher.cache.values()) <= 200e9 * (1 + 1e-9)
        assert set(pusher.io) == {a, b}
        used = svc.cluster()
        assert used.gpus_used == 8 and used.cache_used == pytest.approx(sum(pusher.cache.values()))

        # Progress is cumulative and monotone; a finished job frees its GPUs for the next one.
        # (The job has run for 1000 s: at 400 MB/s it may have read 50 GB; see the forgery test.)
        with svc.sessions.begin() as s:
            s.execute(sa.update(Job).where(Job.id == int(a)).values(start_time=time.time() - 1000))
        svc.backend.emit(JobEvent(a, "progress", consumed_bytes=50e9))
        svc.backend.emit(JobEvent(a, "progress", consumed_bytes=20e9))  # late, out of order
        assert svc.apply_events(svc.backend.poll()) is False
        assert svc.get_job(ALICE, a).consumed_bytes == 50e9
        svc.backend.emit(JobEvent(a, "finished", consumed_bytes=143e9))
        svc.backend.emit(JobEvent(b, "finished"))
        assert svc.apply_events(svc.backend.poll()) is True
        r2 = svc.run_round("test")
        assert r2.running == (c,) and r2.started == (c,)
        assert set(svc.backend.stopped) >= {a, b}  # released in the backend too (idempotent stop)
        assert svc.get_job(ALICE, a).state == "finished" and svc.get_job(ALICE, a).remaining_bytes == 0
        assert pusher.io[a] == 0.0 and pusher.io[b] == 0.0  # their remote IO was given back
        assert pusher.cache[key(svc, "openimages")] == 0.0
    finally:
        svc.close()


def test_every_allocation_change_is_audited(db_url, tmp_path) -> None:
    svc = make(db_url, tmp_path)
    try:
        j = svc.submit_job(ALICE, NewJob("a", 2, "imagenet", epochs=1, ideal_throughput=200e6)).id
        r1 = svc.run_round("test")
        r2 = svc.run_round("test")  # nothing changed: no audit rows
        assert r1.changes > 0 and r2.changes == 0
        svc.cancel_job(ALICE, j)
        r3 = svc.run_round("test")
        assert r3.stopped == (j,)
        hist = svc.allocation_history(ADMIN, subject=j, limit=100)
        by_round = {}
        for ch in hist:
            by_round.setdefault(ch.round_id, {})[ch.resource] = (ch.old_value, ch.new_value)
        assert by_round[r1.round_id]["gpus"] == (None, 2.0)
        assert by_round[r1.round_id]["running"] == (None, 1.0)
        assert by_round[r3.round_id]["gpus"] == (2.0, 0.0)
        assert by_round[r3.round_id]["running"] == (1.0, 0.0)
        cache_hist = svc.allocation_history(ADMIN, subject=key(svc, "imagenet"))
        assert [c.new_value for c in reversed(cache_hist)] == [143e9, 0.0]
        with svc.sessions() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(Round)) == 3
            assert s.scalar(sa.select(sa.func.sum(Round.changes))) == s.scalar(
                sa.select(sa.func.count()).select_from(AllocationChange)
            )
        assert svc.allocations(ADMIN).jobs == ()
        with pytest.raises(ForbiddenError):
            svc.allocation_history(ALICE)
    finally:
        svc.close()


def test_users_see_only_their_jobs(tmp_path) -> None:
    svc = make(f"sqlite:///{tmp_path / 'u.db'}", tmp_path)
    try:
        a = svc.submit_job(ALICE, NewJob("a", 1, "imagenet", epochs=1, model="resnet50")).id
        assert [j.id for j in svc.list_jobs(BOB)] == []
        with pytest.raises(NotFoundError):
            svc.get_job(BOB, a)
        with pytest.raises(NotFoundError):
            svc.cancel_job(BOB, a)
        assert [j.id for j in svc.list_jobs(ADMIN, owner="alice")] == [a]
        svc.cancel_job(ADMIN, a)
        with pytest.raises(ConflictError):
            svc.cancel_job(ALICE, a)
        for bad in ("x", "-1", "1e3", "٣", "99999999999999999999999"):
            with pytest.raises(NotFoundError):
                svc.get_job(ADMIN, bad)
    finally:
        svc.close()


@pytest.mark.parametrize(
    ("job", "field"),
    [
        (NewJob("a", 9, "imagenet", epochs=1, ideal_throughput=1e8), "gpus"),
        (NewJob("a", 1, "nope", epochs=1, ideal_throughput=1e8), "dataset"),
        (NewJob("a/b", 1, "imagenet", epochs=1, ideal_throughput=1e8), "name"),
        (NewJob("..", 1, "imagenet", epochs=1, ideal_throughput=1e8), "name"),
        (NewJob("a", 1, "imagenet", epochs=1, model="gpt-17"), "model"),
        (NewJob("a", 1, "imagenet", epochs=1), "ideal_throughput"),
        (NewJob("a", 1, "imagenet", epochs=1e7, ideal_throughput=1e8), "epochs"),
        (NewJob("a", 1, "imagenet", ideal_throughput=1e8), "epochs"),
    ],
)
def test_bad_jobs_name_the_field(tmp_path, job: NewJob, field: str) -> None:
    svc = make(f"sqlite:///{tmp_path / 'b.db'}", tmp_path)
    try:
        with pytest.raises(ServiceError) as err:
            svc.submit_job(ALICE, job)
        assert err.value.field == field
        assert svc.list_jobs(ADMIN) == []
    finally:
        svc.close()


def test_start_failure_marks_job_failed_and_push_failure_is_reported(tmp_path) -> None:
    svc = make(f"sqlite:///{tmp_path / 'f.db'}", tmp_path, pusher=RecordingPusher(fail=True))
    try:
        j = svc.submit_job(ALICE, NewJob("a", 2, "imagenet", epochs=1, ideal_throughput=2e8)).id
        svc.backend.fail_start.add(j)
        svc.run_round("test")
        job = svc.get_job(ALICE, j)
        assert job.state == "failed" and "injected failure" in job.message
        assert "data manager down" in (svc.cluster().last_push_error or "")
        svc.pusher = RecordingPusher()
        svc.run_round("test")  # unpushed values are retried; the failed job's resources are released
        assert svc.cluster().last_push_error is None
        assert svc.pusher.cache.get(key(svc, "imagenet")) == 0.0 and svc.allocations(ADMIN).jobs == ()
    finally:
        svc.close()


def test_policy_switch_is_persisted_and_validated(tmp_path) -> None:
    svc = make(f"sqlite:///{tmp_path / 'p.db'}", tmp_path)
    try:
        with pytest.raises(ForbiddenError):
            svc.set_policy(ALICE, "sjf")
        with pytest.raises(ServiceError, match="choose one of: .*fifo.*gavel"):
            svc.set_policy(ADMIN, "lottery")
        svc.set_policy(ADMIN, "gavel")
        for i in range(4):
            svc.submit_job(ALICE, NewJob(f"j{i}", 4, "openimages", epochs=1, ideal_throughput=4e8))
        r = svc.run_round("test")
        assert r.plan is not None and r.plan.allocation.objective is not None  # Gavel's fairness ratio
        with svc.sessions() as s:
            assert s.scalar(sa.select(Round.policy).where(Round.id == r.round_id)) == "gavel"
    finally:
        svc.close()


def test_loop_reacts_to_submit_and_to_finish_events(tmp_path) -> None:
    svc = make(f"sqlite:///{tmp_path / 'l.db'}", tmp_path, round_s=3600)  # the timer alone would wait an hour
    svc.config = dataclasses.replace(svc.config, poll_seconds=0.05, min_event_gap_s=0.05)
    svc.start()
    try:
        a = svc.submit_job(ALICE, NewJob("a", 8, "imagenet", epochs=1, ideal_throughput=8e8)).id
        b = svc.submit_job(ALICE, NewJob("b", 8, "imagenet", epochs=1, ideal_throughput=8e8)).id
        _wait(lambda: svc.get_job(ALICE, a).state == "running")
        assert svc.get_job(ALICE, b).state == "queued"
        svc.backend.emit(JobEvent(a, "finished"))  # the loop polls the backend between rounds
        _wait(lambda: svc.get_job(ALICE, b).state == "running")
        assert svc.get_job(ALICE, a).state == "finished"
    finally:
        svc.close()


def test_concurrent_submissions_are_all_recorded(db_url, tmp_path) -> None:
    svc = make(db_url, tmp_path)
    for w in range(8):
        svc.catalogue.grant(ALICE, "imagenet", f"u{w}")
    svc.start()  # rounds run concurrently with the submissions
    errors: list[BaseException] = []
    ids: list[str] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        try:
            for i in range(25):
                jid = svc.submit_job(Principal(f"u{w}"), NewJob(f"w{w}-{i}", 1, "imagenet", epochs=1, ideal_throughput=1e8, dataset_owner="alice")).id
                with lock:
                    ids.append(jid)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == []
        assert len(ids) == len(set(ids)) == 200
        jobs = svc.list_jobs(ADMIN, limit=10_000)
        assert sorted(int(j.id) for j in jobs) == sorted(int(i) for i in ids)
        assert all(len(svc.list_jobs(Principal(f"u{w}"))) == 25 for w in range(8))
    finally:
        svc.close()


def _wait(cond, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


# --------------------------------------------------------------------------- restart, measured cache, wiring


def test_recover_keeps_jobs_the_backend_still_runs(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    svc = make(url, tmp_path)
    a = svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=1, ideal_throughput=4e8)).id
    b = svc.submit_job(ALICE, NewJob("b", 4, "openimages", epochs=1, ideal_throughput=4e8)).id
    c = svc.submit_job(ALICE, NewJob("c", 8, "imagenet", epochs=1, ideal_throughput=8e8)).id
    assert set(svc.run_round("test").running) == {a, b}
    svc.close()

    # A restarted service whose new backend re-adopted a's worker (b's is gone) and, left over
    # from a round whose stop never happened, also runs the queued c.
    svc2 = make(url, tmp_path)
    svc2.backend.running_jobs = lambda: {a, c, "not-ours"}  # type: ignore[method-assign]
    try:
        svc2.recover()
        assert svc2.get_job(ALICE, a).state == "running"
        assert svc2.get_job(ALICE, b).state == "queued"
        assert svc2.get_job(ALICE, b).message == "requeued after a scheduler restart"
        assert a not in svc2.backend.stopped and sorted(svc2.backend.stopped) == sorted([b, c])
        assert {j.job_id: j.running for j in svc2.allocations(ADMIN).jobs}[a] is True
        r = svc2.run_round("test")
        assert set(r.running) == {a, b} and r.started == (b,) and r.stopped == ()  # a is neither stopped nor restarted
        with svc2.sessions.begin() as s:  # it has been running for 1000 s
            s.execute(sa.update(Job).where(Job.id == int(a)).values(start_time=time.time() - 1000))
        svc2.backend.emit(JobEvent(a, "progress", consumed_bytes=70e9))  # its progress continues
        svc2.apply_events(svc2.backend.poll())
        assert svc2.get_job(ALICE, a).consumed_bytes == 70e9
    finally:
        svc2.close()


def test_recover_without_the_hook_requeues_everything(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    svc = make(url, tmp_path)
    a = svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=1, ideal_throughput=4e8)).id
    svc.run_round("test")
    svc.close()
    svc2 = make(url, tmp_path)  # NullBackend keeps the base class default: running_jobs() == set()
    try:
        svc2.recover()
        assert svc2.get_job(ALICE, a).state == "queued" and svc2.backend.stopped == [a]
        assert svc2.run_round("test").started == (a,)
    finally:
        svc2.close()


class StatusPusher(RecordingPusher):
    """A data manager whose GET /v1/status reports cached bytes (the shape of datamanager/state.py)."""

    def __init__(self, nodes: dict | None = None, datasets: dict | None = None):
        super().__init__()
        self.nodes = nodes or {}
        self.datasets = datasets or {}
        self.status_calls = 0

    def status(self) -> dict:
        self.status_calls += 1
        return {"nodes": self.nodes, "datasets": self.datasets, "jobs": {}, "clients": []}


def test_snapshot_carries_cached_bytes_measured_by_the_data_manager(tmp_path) -> None:
    pusher = StatusPusher(
        nodes={"n1": {"datasets": {"d1-imagenet": {"allocated_bytes": 100e9, "cached_bytes": 40e9}}},
               "n2": {"datasets": {"d1-imagenet": {"allocated_bytes": 100e9, "cached_bytes": 25e9}}}},
        datasets={"d1-imagenet": {"cached_bytes_all_nodes": 65e9}, "d2-openimages": {"cached_bytes_all_nodes": 0}},
    )
    svc = make(f"sqlite:///{tmp_path / 'c.db'}", tmp_path, pusher=pusher)
    try:
        svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=1, ideal_throughput=4e8))
        svc.submit_job(ALICE, NewJob("b", 4, "openimages", epochs=1, ideal_throughput=4e8))
        # The allocation applies to each node's cache: its filled part is the fullest node's.
        assert svc.measured_cache() == {"d1-imagenet": 40e9, "d2-openimages": 0.0}
        pusher.status_calls = 0
        r = svc.run_round("test")
        assert pusher.status_calls == 1, "one status call per round"
        snap, _plan, _t = svc._last_round
        assert snap.datasets["d1-imagenet"].cached == 40e9 and snap.datasets["d2-openimages"].cached == 0.0
        assert r.plan is not None
    finally:
        svc.close()


def test_cached_bytes_fall_back_to_the_backend_then_to_unknown(tmp_path) -> None:
    svc = make(f"sqlite:///{tmp_path / 'f.db'}", tmp_path, pusher=RecordingPusher())  # status() == {}: no figures
    try:
        svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=1, ideal_throughput=4e8))
        assert svc.measured_cache() is None
        assert svc.build_snapshot().datasets["d1-imagenet"].cached is None
        svc.backend.dataset_cached_bytes = lambda: {"d1-imagenet": 12e9}  # type: ignore[attr-defined]
        assert svc.build_snapshot().datasets["d1-imagenet"].cached == 12e9
        svc.pusher = StatusPusher(datasets={"d1-imagenet": {"cached_bytes_all_nodes": 3e9}})  # the manager wins
        assert svc.build_snapshot().datasets["d1-imagenet"].cached == 0.0  # known, mounted on no node
        svc.pusher = RecordingPusher()
        svc.pusher.status = lambda: (_ for _ in ()).throw(ConnectionError("down"))  # type: ignore[method-assign]
        assert svc.build_snapshot().datasets["d1-imagenet"].cached == 12e9
    finally:
        svc.close()


def test_cold_cache_of_a_fully_allocated_dataset_still_gets_remote_io(tmp_path) -> None:
    """The reproduction: fifo, a cache larger than the dataset, nothing cached yet. The policy
    gives the dataset its whole size in cache; remote IO must still feed the job while it fills."""
    pusher = StatusPusher(datasets={})  # a fresh data manager: nothing declared, nothing cached
    svc = make(f"sqlite:///{tmp_path / 'cold.db'}", tmp_path, pusher=pusher)
    try:
        a = svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=2, ideal_throughput=4e8)).id
        r = svc.run_round("test")
        assert r.plan is not None and r.plan.cache["d1-imagenet"] == pytest.approx(143e9)
        assert pusher.io[a] > 0, "a cold cache must not starve the job"
        # Once the manager reports the dataset fully cached, the job needs no remote IO.
        pusher.nodes = {"n1": {"datasets": {"d1-imagenet": {"cached_bytes": 143e9}}}}
        pusher.datasets = {"d1-imagenet": {"cached_bytes_all_nodes": 143e9}}
        svc.run_round("test")
        assert pusher.io[a] == pytest.approx(0.0, abs=1.0)
    finally:
        svc.close()


def test_serve_with_local_backend_and_data_manager_uses_the_work_conserving_pusher(tmp_path) -> None:
    from datamanager.client import DataManagerClient
    from scheduler.backends.local import WorkConservingPusher

    common = dict(policy="fifo", round_s=360, gpus="2", gpus_per_node="2", cache="2MB", remote_io="8MB/s",
                  datamanager="http://127.0.0.1:9")
    svc = build_service(db=f"sqlite:///{tmp_path / 'w.db'}", backend="local", state_dir=tmp_path / "state", **common)
    try:
        assert isinstance(svc.pusher, WorkConservingPusher)
        assert isinstance(svc.pusher.inner, DataManagerClient) and svc.pusher.backend is svc.backend
        assert svc.pusher.total_io == 8e6
    finally:
        svc.close()
    assert not svc.pusher._thread.is_alive()  # closed with the service
    svc = build_service(db=f"sqlite:///{tmp_path / 'n.db'}", backend="null", state_dir=tmp_path / "state2", **common)
    try:
        assert isinstance(svc.pusher, DataManagerClient)  # other backends: the plain client
    finally:
        svc.close()


def test_forged_progress_cannot_jump_the_sjf_queue(tmp_path) -> None:
    """A workload writes its own progress (status file, annotations). Claiming to be nearly done
    must not move a job ahead: progress is believed only up to what its f* allows in the time
    it has run, by the service's clock; a job that never ran cannot have progressed at all."""
    svc = make(f"sqlite:///{tmp_path / 'forge.db'}", tmp_path, policy="sjf")
    try:
        honest = svc.submit_job(BOB, NewJob("honest", 8, "openimages", epochs=0.2, ideal_throughput=1e9, dataset_owner="alice")).id
        cheat = svc.submit_job(ALICE, NewJob("cheat", 8, "imagenet", epochs=5, ideal_throughput=1e9)).id
        # Before it ever ran, the cheat claims it is 99.99% done.
        svc.backend.emit(JobEvent(cheat, "progress", consumed_bytes=5 * 143e9 - 1e6, time=0.0))
        svc.apply_events(svc.backend.poll())
        assert svc.get_job(ALICE, cheat).consumed_bytes == 0.0
        r = svc.run_round("test")
        assert r.running == (honest,)  # SJF: 132 GB left beats 715 GB left
        # Once running, a report beyond f* x elapsed is capped.
        svc.backend.emit(JobEvent(honest, "progress", consumed_bytes=132e9 - 1, time=0.0))
        svc.apply_events(svc.backend.poll())
        got = svc.get_job(BOB, honest).consumed_bytes
        assert 0 < got <= 1e9 * (3 * 1.25 + 2.0), got  # seconds since the start at 1 GB/s, not 132 GB
    finally:
        svc.close()


def test_a_nodes_cached_figures_are_bounded_by_its_cache_disk(tmp_path) -> None:
    """Issue 20, finding 1: an agent may report each dataset up to its size (and allocation) and
    still claim more than its node's disk holds: here 143 GB + 660 GB on a node of a cluster of
    200 GB (the null backend knows no node's own disk: the cluster's cache bounds each node). The
    node's figures are scaled down to what it can hold."""
    pusher = StatusPusher(nodes={"n1": {"datasets": {"d1-imagenet": {"cached_bytes": 143e9},
                                                     "d2-openimages": {"cached_bytes": 660e9}}},
                                 "n2": {"datasets": {"d1-imagenet": {"cached_bytes": 10e9}}}},
                          datasets={"d1-imagenet": {}, "d2-openimages": {}})
    svc = make(f"sqlite:///{tmp_path / 'n.db'}", tmp_path, pusher=pusher)
    try:
        assert svc.node_cache_bound("n1") == 200e9
        got = svc.measured_cache()
        assert got is not None
        assert got["d1-imagenet"] + got["d2-openimages"] == pytest.approx(200e9)
        assert got["d2-openimages"] == pytest.approx(200e9 * 660 / 803)  # in proportion to what it said
        assert got["d1-imagenet"] == pytest.approx(200e9 * 143 / 803)  # n1's, scaled, still above n2's 10 GB
        # An honest node within its disk is believed as is.
        pusher.nodes = {"n2": {"datasets": {"d1-imagenet": {"cached_bytes": 60e9}, "d2-openimages": {"cached_bytes": 40e9}}}}
        assert svc.measured_cache() == {"d1-imagenet": 60e9, "d2-openimages": 40e9}
    finally:
        svc.close()


def test_a_cached_figure_beyond_the_datasets_size_is_not_believed(tmp_path) -> None:
    """Issue 20: an agent reported cached_bytes = 1e15 for another tenant's dataset and the
    scheduler's parser passed it to the policy."""
    pusher = StatusPusher(nodes={"n1": {"datasets": {"d1-imagenet": {"cached_bytes": 1e15}}}},
                          datasets={"d1-imagenet": {}})
    svc = make(f"sqlite:///{tmp_path / 'b.db'}", tmp_path, pusher=pusher)
    try:
        svc.submit_job(ALICE, NewJob("a", 4, "imagenet", epochs=1, ideal_throughput=4e8))
        snap = svc.build_snapshot()
        # Believed up to the dataset's size (and the node's cache disk, 200 GB here).
        assert snap.datasets["d1-imagenet"].cached == min(snap.datasets["d1-imagenet"].size, svc.node_cache_bound("n1"))
    finally:
        svc.close()


def test_event_rounds_take_at_most_a_tenth_of_a_core() -> None:
    """A burst of submissions over 20k jobs had a 0.4-0.7 s round every 2 s (a quarter of one of
    the machine's two cores, away from the API workers serving the burst)."""
    from scheduler.service.loop import event_round_gap

    assert event_round_gap(2.0, 0.05) == 2.0  # short rounds: the configured gap
    assert event_round_gap(2.0, 0.6) == pytest.approx(5.4)  # 0.6 s of every 6 s
    assert event_round_gap(0.0, 0.0) == 0.0


def test_an_unschedulable_job_goes_back_to_the_queue_with_its_reason_and_no_gpus(tmp_path) -> None:
    """The backend says a started job fits no node (the Kubernetes backend's fit check on the
    cluster as if empty: tests/test_kubernetes_real.py shows it on a real API server; here the null
    backend carries the same `unschedulable_jobs` answer). The service holds it back from the
    policy: queued, no GPUs, the reason in GET /v1/jobs/{id}'s message, and its GPUs go to the
    next job in the same round it is held back."""
    svc = make(f"sqlite:///{tmp_path / 'u.db'}", tmp_path)
    try:
        a = svc.submit_job(ALICE, NewJob("a", 8, "imagenet", epochs=1, ideal_throughput=400e6)).id
        b = svc.submit_job(ALICE, NewJob("b", 8, "imagenet", epochs=1, ideal_throughput=400e6)).id
        assert set(svc.run_round("test").running) == {a}
        stuck: set[str] = {a}
        svc.backend.unschedulable_jobs = lambda: set(stuck)
        reason = "unschedulable: no node matches its pods' nodeSelector and tolerations; back in the queue"
        svc.backend.emit(JobEvent(a, "unschedulable", message=reason))
        assert svc.apply_events(svc.backend.poll())  # it still holds GPUs: a round follows
        r = svc.run_round("test")
        assert set(r.running) == {b}
        # The preemption writes "preempted"; the backend repeats the reason on every poll.
        svc.backend.emit(JobEvent(a, "unschedulable", message=reason))
        assert not svc.apply_events(svc.backend.poll())  # queued already: no round for it
        job = svc.get_job(ALICE, a)
        assert job.state == "queued" and job.allocated_gpus == 0 and job.message == reason
        assert svc.cluster().gpus_used == 8  # b's
        stuck.clear()  # a node that fits appeared: the policy may choose it again (FIFO: after b)
        assert set(svc.run_round("test").running) == {b}
    finally:
        svc.close()
