"""Simulated results must not depend on how the simulator slices time or data.

The same scenarios run with scheduling rounds of 60, 360 and 1,800 s and with 128 and 256
chunks per dataset; every job's JCT stays within 2% of the 360 s / 128-chunk run. The link
and the cache are contended, where a step-length artefact would show. A different resolution
draws different random epoch orders, which moves one run by a few percent either way, so
resolutions are compared on the mean over seeds.
"""

from __future__ import annotations

import pytest

from policies import ClusterCapacity, get_policy
from policies.registry import estimator_for
from scheduler.sim.engine import SimConfig, Simulator
from traces.model import Trace, TraceJob

GB = 1e9
MB = 1e6

JOBS = (
    TraceJob("a", 0.0, 1, "m", "d1", 100 * MB, 3.0),
    TraceJob("b", 200.0, 1, "m", "d2", 60 * MB, 3.0),
    TraceJob("c", 400.0, 1, "m", "d3", 30 * MB, 2.0),
    TraceJob("d", 900.0, 2, "m", "d1", 150 * MB, 2.0),  # shares d1 with a, waits for GPUs
)
SIZES = {"d1": 80 * GB, "d2": 60 * GB, "d3": 40 * GB}
CAPACITY = ClusterCapacity(gpus=4, cache=90 * GB, remote_io=60 * MB, gpus_per_node=4)


def jcts(policy: str, system: str, round_s: float, resolution: int, seed: int = 1) -> dict[str, float]:
    config = SimConfig(round_s=round_s, resolution=resolution, seed=seed)
    result = Simulator(Trace(JOBS, SIZES), CAPACITY, get_policy(policy), estimator_for(system), system, config).run()
    assert not result.unfinished
    return {r.job_id: r.jct_s for r in result.jobs}


def mean_jcts(policy: str, system: str, round_s: float, resolution: int, seeds: int = 6) -> dict[str, float]:
    runs = [jcts(policy, system, round_s, resolution, seed) for seed in range(seeds)]
    return {job_id: sum(r[job_id] for r in runs) / seeds for job_id in runs[0]}


@pytest.mark.parametrize("system", ["silod", "alluxio", "coordl", "quiver"])
@pytest.mark.parametrize("policy", ["fifo", "sjf"])
def test_jct_does_not_depend_on_round_length(policy, system):
    base = jcts(policy, system, 360.0, 128)
    for round_s in (60.0, 1800.0):
        other = jcts(policy, system, round_s, 128)
        for job_id, jct in base.items():
            assert other[job_id] == pytest.approx(jct, rel=0.02), (round_s, job_id, other[job_id], jct)


@pytest.mark.parametrize("system", ["silod", "alluxio", "coordl", "quiver"])
def test_jct_does_not_depend_on_resolution(system):
    base = mean_jcts("fifo", system, 360.0, 128)
    other = mean_jcts("fifo", system, 60.0, 256)
    for job_id, jct in base.items():
        assert other[job_id] == pytest.approx(jct, rel=0.02), (job_id, other[job_id], jct)


def test_gavel_jct_barely_depends_on_round_length():
    # Time sharing itself changes with the round (who runs when), and Gavel's rounds hold an
    # arrival until the round's end and leave a finished job's GPUs idle until it, so Gavel is
    # held to 3% on the average JCT between rounds short against its jobs (60 and 360 s on jobs
    # of 4-6 h). A 30-minute round is another schedule: each job's time since an allocation
    # change starts at half a round (Gavel's offset), so priorities answer slowly; it measured
    # -11% here (the 360 s schedule switches more often between jobs that share a small cache).
    jobs = tuple(TraceJob(j.job_id, j.submit_time, j.num_gpus, j.model, j.dataset, j.ideal_throughput, j.epochs * 5) for j in JOBS)

    def avg(round_s: float) -> float:
        config = SimConfig(round_s=round_s, seed=1)
        result = Simulator(Trace(jobs, SIZES), CAPACITY, get_policy("gavel"), estimator_for("silod"), "silod", config).run()
        return sum(r.jct_s for r in result.jobs) / len(result.jobs)

    base = avg(360.0)
    assert avg(60.0) == pytest.approx(base, rel=0.03)
