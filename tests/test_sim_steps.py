"""The engine's step count: the LRU's leftover after an eviction is not room before eviction,
and runs stay within the documented step budget (scheduler.sim.engine.step_budget)."""

from __future__ import annotations

import pytest

from policies.registry import estimator_for, get_policy
from policies.types import ClusterCapacity
from scheduler.sim.engine import SimConfig, Simulator, step_budget
from traces.model import Trace, TraceJob

GB, MB = 1e9, 1e6


def _run(tiny: bool, policy: str):
    """Eight readers of 143 GB datasets overflow a 500 GB LRU over a 1 GB/s link; with `tiny`, a
    ninth job reads a 1 MB dataset at 1 kB/s (Gavel's A3C as the msr reader models it), whose
    chunks are far smaller than the leftover a whole-chunk eviction leaves."""
    jobs = [TraceJob(f"r{i}", 0.0, 1, "m", f"d{i}", 200 * MB, 2.0) for i in range(8)]
    sizes = {f"d{i}": 143 * GB for i in range(8)}
    if tiny:
        jobs.append(TraceJob("tiny", 0.0, 1, "a3c", "rl", 1e3, 3.0))
        sizes["rl"] = 1 * MB
    trace = Trace(tuple(jobs), sizes)
    cap = ClusterCapacity(gpus=16, cache=500 * GB, remote_io=1 * GB, gpus_per_node=4)
    result = Simulator(trace, cap, get_policy(policy), estimator_for("alluxio"), "alluxio", SimConfig()).run()
    assert not result.unfinished
    return result, trace


@pytest.mark.parametrize("policy", ["fifo", "gavel"])
def test_a_tiny_dataset_in_a_full_lru_does_not_multiply_the_steps(policy):
    # Before the fix, "stop where the LRU may become full" counted the leftover as free space
    # for as long as the tiny reader ran: 28,593 steps against 184 without it.
    alone, _ = _run(False, policy)
    mixed, trace = _run(True, policy)
    assert mixed.steps <= 2 * alone.steps
    assert mixed.steps <= step_budget(trace, mixed.makespan_s, 360.0)
    jct = {j.job_id: j.jct_s for j in alone.jobs}
    for j in mixed.jobs:
        if j.job_id in jct:
            assert j.jct_s == pytest.approx(jct[j.job_id], rel=0.005)
