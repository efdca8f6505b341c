"""Parity with Gavel's own simulator (stanford-futuredata/gavel at c4fa400, OSDI'20).

tests/reference/gavel_parity/results holds what Gavel's simulator gave on small cuts of the msr
traces (regenerate.py there says how to run it again); here our simulator runs the same traces
with storage made irrelevant (a cache and a link no job can fill), one GPU type, Gavel's 360 s
rounds and the same allocation-recompute interval, and must agree (issue 46's targets):

- max-min fairness (`--policy gavel`), at intervals 0 and Gavel's default 1,920 s: average JCT
  within 3% of Gavel's simulator as its code is, except where one of its simulator's artefacts
  moves it (51b7ef at 1,920 s: an idle cluster waits for the next arrival, -3.05%); and, against
  the same runs `corrected` (regenerate.CORRECTIONS: its LP solver's noise rounded off the
  shares, an idle cluster deciding at once, whole 360 s rounds), average JCT within 3% and at
  least 90% of the jobs within 10%, on every case and interval. Gavel as is is noisy per job by
  itself: its shares perturbed by 1e-7 (within ECOS's tolerance) put 93-100% of its own jobs
  within 10% of its unperturbed JCT;
- FIFO: Gavel's FIFO is head-of-line (`--policy fifo-strict`): average JCT within 3%.

Every case takes a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policies.registry import estimator_for, get_policy
from policies.types import ClusterCapacity
from scheduler.sim.engine import SimConfig, Simulator
from traces.gavel_trace import load_gavel_trace

HERE = Path(__file__).resolve().parent / "reference" / "gavel_parity"
CASES = sorted(p.stem for p in (HERE / "results").glob("*.json"))
AVG_TOLERANCE = 0.03
PER_JOB_SHARE = 0.9  # of the jobs within 10% of Gavel's (corrected) JCT
#: The MEASURED miss of the targets, not a tuning knob: (case, interval, corrected) -> bound just
#: above the figure. 51b7ef at 1,920 s as is: an 8-GPU job waits 6,818 s on an idle cluster in
#: Gavel's simulator (corrected: -0.00%, 100% of jobs). No per-job exception: e13805 at interval
#: 0 (80% of jobs within 10% while spare GPU time was water-filled and spread; 96% since it is
#: split at the optimal face's analytic centre, as Gavel's interior-point solver does) is held to
#: 90% like every case.
AVG_EXCEPTIONS = {("51b7ef-small", 1920, False): 0.035}
POLICIES = {"max_min_fairness": "gavel", "fifo": "fifo-strict"}


def _ours(case: dict, trace, policy: str, interval: float) -> np.ndarray:
    cap = ClusterCapacity(gpus=case["gpus"], cache=1e21, remote_io=1e13, gpus_per_node=1)
    sim = Simulator(trace, cap, get_policy(policy), estimator_for("alluxio"), "alluxio",
                    SimConfig(round_s=case["round_s"], decision_interval_s=interval))
    result = sim.run()
    assert not result.unfinished
    jct = {r.job_id: r.jct_s for r in result.jobs}
    return np.array([jct[j.job_id] for j in sorted(trace.jobs, key=lambda j: j.job_id)])


@pytest.mark.parametrize("name", CASES)
def test_our_simulator_agrees_with_gavels(name):
    case = json.loads((HERE / "results" / f"{name}.json").read_text())
    trace = load_gavel_trace(HERE / "traces" / f"{name}.trace", HERE / "throughputs.json")
    assert len(trace.jobs) == case["jobs"]
    ours_by_run: dict = {}  # (policy, interval) -> our JCTs: one run of ours per Gavel pair
    for run in case["runs"]:
        gavel = np.array(run["jct_s"])
        key = (run["policy"], run["interval_s"])
        if key not in ours_by_run:
            ours_by_run[key] = _ours(case, trace, POLICIES[run["policy"]], run["interval_s"])
        ours = ours_by_run[key]
        corrected = "corrections" in run
        label = f"{name} {run['policy']} interval {run['interval_s']} s{' corrected' if corrected else ''}"
        exception = (name, run["interval_s"], corrected)
        assert ours.mean() == pytest.approx(gavel.mean(), rel=AVG_EXCEPTIONS.get(exception, AVG_TOLERANCE)), label
        if corrected:
            within = float(np.mean(np.abs(ours / gavel - 1) <= 0.10))
            assert within >= PER_JOB_SHARE, f"{label}: {within:.0%} of jobs within 10%"


def test_the_cases_cover_single_gpu_and_gang_traces():
    gpus = {name: {int(line.split("\t")[6]) for line in (HERE / "traces" / f"{name}.trace").read_text().splitlines()} for name in CASES}
    assert any(g == {1} for g in gpus.values())  # the 1-GPU-only case
    assert any(max(g) >= 8 for g in gpus.values())
    for name in CASES:
        runs = {(r["policy"], r["interval_s"], "corrections" in r) for r in json.loads((HERE / "results" / f"{name}.json").read_text())["runs"]}
        assert {("max_min_fairness", i, c) for i in (0, 1920) for c in (False, True)} <= runs
