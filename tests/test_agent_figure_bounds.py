"""Node agents' figures are believed only up to what their node can carry (issue 20, Build 1):
a mount's remote rate in the data manager's /v1/status is at most its remote-IO allocation; the
scheduler's overview bounds each node's remote reads by the link (the cluster's remote IO) and
each job's throughput by its f* (the bound its believed progress has too)."""

from __future__ import annotations

import pytest

from datamanager.state import ClientState, StateStore
from scheduler.service.overview import measurements_from_datamanager


def test_the_data_manager_caps_a_mounts_remote_rate_at_its_allocation(tmp_path):
    store = StateStore(tmp_path)
    store.declare_dataset("1-files")
    store.declare_job("j1", "1-files")
    store.allocate_remote_io("j1", 100e6)
    store.register_client(ClientState(client_id="c1", node="n1", dataset="1-files", job="j1"))
    store.heartbeat("c1", {"remote_rate_bytes_per_s": 1e15, "throughput_bytes_per_s": 5e7})
    j = store.status()["nodes"]["n1"]["datasets"]["1-files"]["jobs"]["j1"]
    assert j["remote_rate_bytes_per_s"] == pytest.approx(100e6)
    store.heartbeat("c1", {"remote_rate_bytes_per_s": "nan"})
    assert store.status()["nodes"]["n1"]["datasets"]["1-files"]["jobs"]["j1"]["remote_rate_bytes_per_s"] is None
    store.heartbeat("c1", {"remote_rate_bytes_per_s": 4e7})  # an honest figure is kept as is
    assert store.status()["nodes"]["n1"]["datasets"]["1-files"]["jobs"]["j1"]["remote_rate_bytes_per_s"] == 4e7


def test_a_nodes_remote_reads_are_bounded_by_the_link():
    status = {"nodes": {
        # n1's agent claims its two mounts read 1e15 bytes/s from remote storage (all misses)
        "n1": {"datasets": {"d": {"jobs": {"1": {"hit_bytes": 0, "miss_bytes": 10, "throughput_bytes_per_s": 6e14},
                                           "2": {"remote_rate_bytes_per_s": 4e14, "throughput_bytes_per_s": 4e14}}}}},
        # n2 reports within the link: untouched
        "n2": {"datasets": {"d": {"jobs": {"1": {"hit_bytes": 10, "miss_bytes": 10, "throughput_bytes_per_s": 2e8}}}}},
    }}
    link = 1e9
    m = measurements_from_datamanager(status, link)
    # n1 scaled down to the link (its remote sum 1e15 -> 1e9), in proportion; n2 added as reported
    assert m["2"]["throughput"] == pytest.approx(0.4e9)
    assert m["1"]["throughput"] == pytest.approx(0.6e9 + 2e8)
    assert measurements_from_datamanager(status)["1"]["throughput"] == pytest.approx(6e14 + 2e8)  # no link: as before


def test_the_overview_shows_no_job_faster_than_its_f_star(tmp_path):
    from sqlalchemy.orm import sessionmaker

    from policies.types import ClusterCapacity
    from scheduler.service.db import open_database
    from scheduler.service.db.models import Dataset, Job, JobState
    from scheduler.service.overview import build_overview
    from scheduler.service.types import Principal

    sessions = sessionmaker(open_database(f"sqlite:///{tmp_path / 'o.db'}"), expire_on_commit=False)
    with sessions.begin() as s:
        d = Dataset(name="d", uri="s3://b/d", size=100e9, owner="alice", created_at=0.0)
        s.add(d)
        s.flush()
        s.add(Job(id=1, name="j1", owner="alice", gpus=1, dataset_id=d.id, ideal_throughput=1e8, epochs=1.0,
                  total_bytes=100e9, consumed_bytes=0.0, state=JobState.RUNNING, submit_time=1.0, message=""))
    # A hit-only report (no remote reads, so the link does not bound it) of 1e15 bytes/s.
    dm = {"nodes": {"n1": {"datasets": {"d": {"jobs": {"1": {"hit_bytes": 10, "miss_bytes": 0,
                                                             "throughput_bytes_per_s": 1e15}}}}}}}
    status = {"measured": {"time": 1.0, "jobs": measurements_from_datamanager(dm, 1e9), "cached": {}}}
    o = build_overview(sessions, Principal("alice"), capacity=ClusterCapacity(gpus=8, cache=1e12, remote_io=1e9),
                       policy="fifo", status=status)
    assert o.running[0].throughput == pytest.approx(1e8)
    # A job measured faster than it declared (its measured f*, issue 22) is shown up to that.
    from scheduler.service.db.models import JobMeasurementRow

    with sessions.begin() as s:
        s.add(JobMeasurementRow(job_id=1, ideal_throughput=3e8))
    o = build_overview(sessions, Principal("alice"), capacity=ClusterCapacity(gpus=8, cache=1e12, remote_io=1e9),
                       policy="fifo", status=status)
    assert o.running[0].throughput == pytest.approx(3e8)
