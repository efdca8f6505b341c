"""The policies' column paths (policies.types.JobColumns) answer exactly as their per-view paths.

FIFO, greedy and SJF allocate on the snapshot's columns when a backend hands them in (the
simulator does, and builds no JobView unless a stage reads one: policies.types.LazySnapshot).
On random snapshots, with ties in arrival time, measured and unmeasured hit ratios, known and
unknown cached bytes, idle datasets and both estimators, the allocation from the columns must
equal the one from the views, down to each mapping's order (the order later sums run in).
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import ClusterCapacity, DatasetView, JobView, Snapshot, get_policy
from policies.estimators import SiloDEstimator, VanillaEstimator
from policies.gavel import _filled
from policies.types import JobColumns, LazyJobColumns, LazyJobs, LazySnapshot, values_for

GB, MB, TB = 1e9, 1e6, 1e12


@st.composite
def snapshots(draw):
    n = draw(st.integers(1, 14))
    m = draw(st.integers(1, 4))
    total_gpus = draw(st.integers(1, 24))
    gangs = [g for g in (1, 2, 4, 8) if g <= total_gpus]
    jobs = tuple(
        JobView(f"j{draw(st.integers(0, 99)):02d}-{i}", draw(st.sampled_from(gangs)), f"ds{draw(st.integers(0, m - 1))}",
                draw(st.floats(2 * MB, 900 * MB)), draw(st.floats(0.0, 1e14)), float(draw(st.integers(0, 3))), draw(st.booleans()),
                hit_ratio_now=draw(st.one_of(st.none(), st.floats(0.0, 1.0))))
        for i in range(n)
    )
    sizes = {f"ds{k}": draw(st.floats(1 * GB, 20 * TB)) for k in range(m + 1)}  # one idle dataset
    datasets = {n: DatasetView(n, s, draw(st.one_of(st.none(), st.floats(0.0, 2 * s)))) for n, s in sizes.items()}
    cap = ClusterCapacity(gpus=total_gpus, cache=draw(st.one_of(st.just(0.0), st.floats(0.0, 40 * TB))),
                          remote_io=draw(st.floats(1.0, 5 * GB)), gpus_per_node=8)
    return Snapshot(0.0, jobs, datasets, cap)


def _in_order(mapping):
    return None if mapping is None else list(mapping.items())


@pytest.mark.parametrize("estimator", [SiloDEstimator(), VanillaEstimator()], ids=lambda e: e.name)
@pytest.mark.parametrize("policy_name", ["fifo", "greedy", "sjf"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bare=snapshots())
def test_the_column_path_allocates_as_the_views_do(policy_name, estimator, bare):
    with_columns = replace(bare, columns=JobColumns.of(bare.jobs))
    assert with_columns.job_columns() is not None and bare.job_columns() is None
    policy = get_policy(policy_name)
    got, want = policy.allocate(with_columns, estimator), policy.allocate(bare, estimator)
    for field in ("gpu_share", "cache", "remote_io", "cpu"):
        assert _in_order(getattr(got, field)) == _in_order(getattr(want, field)), field


def _lazy(bare: Snapshot) -> tuple[LazySnapshot, list[int]]:
    builds = []

    def build():
        builds.append(1)
        return bare.jobs

    lazy = LazyJobs(build)
    ref = JobColumns.of(bare.jobs)
    cols = LazyJobColumns(lazy, *(getattr(ref, f) for f in ("gpus", "ideal", "remaining", "running", "hit_now", "all_regular", "ids",
                                                            "datasets", "submit", "id_rank", "autocaches")))
    return LazySnapshot(bare.time, lazy, bare.datasets, bare.capacity, cols), builds


@settings(max_examples=30, deadline=None)
@given(bare=snapshots())
def test_a_lazy_snapshot_builds_its_views_once_and_only_when_read(bare):
    snap, builds = _lazy(bare)
    assert snap.job_columns() is snap.columns and not builds  # matching columns need no views
    for name in ("fifo", "sjf", "gavel"):
        get_policy(name).allocate(snap, SiloDEstimator())
    assert not builds  # the column paths read no view
    assert snap.jobs is snap.columns.jobs and snap.jobs == bare.jobs and builds == [1]
    # Replaced jobs (priority_order does this): the columns describe the old ones, so none are valid.
    assert replace(snap, jobs=bare.jobs[::-1]).job_columns() is None
    assert replace(snap, columns=None).job_columns() is None
    again = replace(snap, time=1.0)  # same jobs, columns kept: still valid, by the tuple's identity
    assert again.jobs is snap.jobs and again.job_columns() is snap.columns and builds == [1]


@given(keys=st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), unique=True),
       present=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "x"]), st.floats(allow_nan=False)), unique_by=lambda t: t[0]))
def test_values_for_reads_each_key_or_the_default(keys, present):
    mapping = MappingProxyType(dict(present))
    want = [mapping.get(k, -1.0) for k in keys]
    assert values_for(mapping, tuple(keys), -1.0).tolist() == want
    in_order = MappingProxyType({k: float(i) for i, k in enumerate(keys)})  # the one-pass case
    assert values_for(in_order, tuple(keys)).tolist() == [float(i) for i in range(len(keys))]


@given(rows=st.lists(st.tuples(st.floats(0.0, 1e15), st.one_of(st.none(), st.floats(allow_infinity=True)))))
def test_gavel_reads_cached_bytes_as_the_rule_per_dataset(rows):
    # DatasetView.filled(size) per dataset, None when no dataset reports cached bytes.
    sizes = np.array([s for s, _ in rows], dtype=float)
    cached = [c for _, c in rows]
    got = _filled(sizes, cached)
    if all(c is None for c in cached):
        assert got is None
        return
    want = [s if c is None else (c if c < s or c != c else s) for s, c in rows]  # np.minimum: NaN wins
    np.testing.assert_array_equal(got, np.array(want, dtype=float))
