"""One validator for every allocation, used by the scheduling core and by the tests."""

from __future__ import annotations

import math
from operator import attrgetter

import numpy as np

from policies.types import Allocation, Snapshot, values_for

# Relative slack for floating-point sums (a knapsack filled to capacity may overshoot by ulps).
_REL_TOL = 1e-9
_SIZE = attrgetter("size")


class AllocationError(ValueError):
    """An allocation that breaks a capacity; the message lists every violation."""


def allocation_violations(snapshot: Snapshot, allocation: Allocation) -> list[str]:
    """Every way `allocation` breaks the capacities of `snapshot` (empty list when valid)."""
    cap = snapshot.capacity
    jobs = {j.job_id: j for j in snapshot.jobs}
    problems: list[str] = []

    unknown = set(allocation.gpu_share) - set(jobs)
    if unknown:
        problems.append(f"GPU share for unknown jobs {sorted(unknown)}")
    gpu_time = 0.0
    for job_id, share in allocation.gpu_share.items():
        if not (0.0 <= share <= 1.0 + _REL_TOL):
            problems.append(f"job {job_id}: GPU share {share} outside [0, 1]")
        if job_id in jobs:
            gpu_time += share * jobs[job_id].gpus
            if share > 0 and jobs[job_id].gpus > cap.gpus:
                problems.append(f"job {job_id}: GPU share for a {jobs[job_id].gpus}-GPU gang in a {cap.gpus}-GPU cluster")
    if gpu_time > cap.gpus * (1 + _REL_TOL):
        problems.append(f"GPUs: {gpu_time:.6g} allocated (time-averaged) > {cap.gpus} in the cluster")

    if allocation.cache is not None:
        total = 0.0
        for name, nbytes in allocation.cache.items():
            if name not in snapshot.datasets:
                problems.append(f"cache for unknown dataset {name!r}")
                continue
            if not math.isfinite(nbytes) or nbytes < 0:
                problems.append(f"dataset {name}: cache {nbytes} is not a non-negative number of bytes")
                continue
            size = snapshot.datasets[name].size
            if nbytes > size * (1 + _REL_TOL) + 1e-6:
                problems.append(f"dataset {name}: cache {nbytes:.6g} B > dataset size {size:.6g} B")
            total += nbytes
        if total > cap.cache * (1 + _REL_TOL) + 1e-6:
            problems.append(f"cache: {total:.6g} B allocated > {cap.cache:.6g} B in the cluster")

    if allocation.remote_io is not None:
        avg_io = 0.0
        for job_id, rate in allocation.remote_io.items():
            if job_id not in jobs:
                problems.append(f"remote IO for unknown job {job_id!r}")
                continue
            if not math.isfinite(rate) or rate < 0:
                problems.append(f"job {job_id}: remote IO {rate} is not a non-negative rate")
                continue
            avg_io += rate * allocation.gpu_share.get(job_id, 0.0)
        if avg_io > cap.remote_io * (1 + 1e-6) + 1e-6:
            problems.append(f"remote IO: {avg_io:.6g} B/s allocated (time-averaged) > {cap.remote_io:.6g} B/s")
    problems += _cpu_violations(snapshot, allocation, jobs)
    return problems


def _cpu_violations(snapshot: Snapshot, allocation: Allocation, jobs: dict) -> list[str]:
    """Cores per job while running: each within the cores of its nodes, and the time-averaged
    total within the cluster's (like remote IO, time sharing may over-commit a round; the round
    planner scales that round's cores to fit)."""
    cap = snapshot.capacity
    if allocation.cpu is None:
        return []
    if not cap.manages_cpu:
        return ["CPU cores allocated on a cluster without cpus_per_node (CPU is not modelled there)"]
    problems: list[str] = []
    avg = 0.0
    for job_id, cores in allocation.cpu.items():
        if job_id not in jobs:
            problems.append(f"CPU cores for unknown job {job_id!r}")
            continue
        if not math.isfinite(cores) or cores < 0:
            problems.append(f"job {job_id}: {cores} CPU cores is not a non-negative number")
            continue
        limit = cap.cpu_cap(jobs[job_id].gpus)
        if cores > limit * (1 + _REL_TOL) + 1e-9:
            problems.append(f"job {job_id}: {cores:.6g} cores > {limit:.6g} on the nodes of its {jobs[job_id].gpus} GPU(s)")
        avg += cores * allocation.gpu_share.get(job_id, 0.0)
    if avg > cap.cpus * (1 + 1e-6) + 1e-9:
        problems.append(f"CPU: {avg:.6g} cores allocated (time-averaged) > {cap.cpus:.6g} in the cluster")
    return problems


def _clearly_valid(snapshot: Snapshot, allocation: Allocation) -> bool:
    """A vectorised check that passes only allocations allocation_violations would pass (the
    simulator validates one per decision); anything else goes to the full check, which names
    every violation."""
    cols = snapshot.job_columns()
    if cols is None or allocation.cpu is not None:
        return False
    cap = snapshot.capacity
    ids = cols.ids
    gs = allocation.gpu_share
    if len(gs) != len(ids) or not (tuple(gs) == ids or gs.keys() == set(ids)):
        return False
    share = values_for(gs, ids)  # (every id is a key: the default is never taken)
    # (ndarray methods: numpy's all/any add a Python wrapper per call, at every decision)
    if not ((share >= 0.0).all() and (share <= 1.0 + _REL_TOL).all()):  # NaN fails both
        return False
    if ((share > 0) & (cols.gpus > cap.gpus)).any() or float(share @ cols.gpus) > cap.gpus * (1 + _REL_TOL):
        return False
    if allocation.cache is not None:
        names = list(allocation.cache)
        if not allocation.cache.keys() <= snapshot.datasets.keys():
            return False
        c = np.fromiter(allocation.cache.values(), dtype=float, count=len(names))
        sizes = np.fromiter(map(_SIZE, map(snapshot.datasets.__getitem__, names)), dtype=float, count=len(names))
        if not (np.isfinite(c).all() and (c >= 0).all() and (c <= sizes * (1 + _REL_TOL) + 1e-6).all()):
            return False
        if float(c.sum()) > cap.cache * (1 + _REL_TOL) + 1e-6:
            return False
    if allocation.remote_io is not None:
        io = allocation.remote_io
        if not io.keys() <= gs.keys():
            return False
        r = values_for(io, ids)
        if not (np.isfinite(r).all() and (r >= 0).all()):
            return False
        if float(r @ share) > cap.remote_io * (1 + 1e-6) + 1e-6:
            return False
    return True


def validate_allocation(snapshot: Snapshot, allocation: Allocation) -> Allocation:
    if _clearly_valid(snapshot, allocation):
        return allocation
    problems = allocation_violations(snapshot, allocation)
    if problems:
        raise AllocationError("invalid allocation: " + "; ".join(problems))
    return allocation
