"""Compile the policies' kernels before the scheduling process takes the leader lease.

Gavel's loops are numba kernels (policies/gavel_kernel.py) compiled on their first call: about
20 CPU s on a fresh install, and the scheduling process runs at nice +10, so on a busy node the
first Gavel round took over a minute and no job was admitted meanwhile. `warm_policies` runs
each built-in policy once, through the same `SchedulingCore.plan` a round calls, on a small
snapshot of this cluster (jobs with and without cached data and measured hit ratios, and an
irregular one, so the partitions and every argument type a round passes are exercised). The
kernels are then compiled, or loaded from numba's cache (policies/compiled.py: shared by every
checkout and venv with the same sources), before the lease is taken: the first real round
runs at full speed. Pure: builds values, calls the policies, touches no database.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from estimator.access import AccessPattern
from policies.estimators import SiloDEstimator
from policies.registry import BUILTIN_POLICIES, get_policy
from policies.types import ClusterCapacity, DatasetView, JobView, Snapshot
from scheduler.core.planner import SchedulingCore


def sample_snapshot(capacity: ClusterCapacity) -> Snapshot:
    """A few jobs on `capacity` that exercise a round's paths: one running with a measured hit
    ratio on a partly cached dataset, queued gangs of 1 and all GPUs, a job that reads no
    cached data yet, and an irregular (curriculum) reader."""
    gb = 1e9
    gpus = capacity.gpus
    jobs = (
        JobView("warm-a", 1, "warm-d1", 100e6, 500 * gb, 0.0, running=True, hit_ratio_now=0.4),
        JobView("warm-b", min(2, gpus), "warm-d1", 200e6, 800 * gb, 1.0),
        JobView("warm-c", gpus, "warm-d2", 50e6, 300 * gb, 2.0),
        JobView("warm-d", 1, "warm-d3", 80e6, 200 * gb, 3.0,
                access=AccessPattern.curriculum_learning(starting_percent=0.1, alpha=2.0, step=100, batch=32)),
    )
    datasets = {"warm-d1": DatasetView("warm-d1", 400 * gb, cached=100 * gb),
                "warm-d2": DatasetView("warm-d2", 300 * gb),
                "warm-d3": DatasetView("warm-d3", 150 * gb, cached=0.0)}
    return Snapshot(time=10.0, jobs=jobs, datasets=datasets, capacity=capacity)


def warm_policies(capacity: ClusterCapacity, names: Iterable[str] = BUILTIN_POLICIES,
                  progress: Callable[[str], None] = lambda _: None) -> dict[str, float]:
    """Plan one round with each policy on `sample_snapshot(capacity)`; seconds per policy.
    A policy that fails here is reported through `progress` and skipped (the real rounds report
    it again, with the real jobs)."""
    seconds: dict[str, float] = {}
    snapshot = sample_snapshot(capacity)
    for name in names:
        start = time.monotonic()
        try:
            SchedulingCore(get_policy(name), SiloDEstimator()).plan(snapshot)
        except Exception as exc:  # a plug-in's bug must not keep the service from starting
            progress(f"policy {name} failed on the warm-up snapshot: {exc}")
            continue
        seconds[name] = time.monotonic() - start
    return seconds
