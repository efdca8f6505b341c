"""Curriculum jobs and the irregular partition in `silod simulate`, checked by hand and against
the independent item-level model (tests/reference/itemsim.py), which shares no code with
scheduler/sim.

Each scenario runs through the real command. Per job: JCT within 5% of the item-level model
(the issue's bound); the hit ratio of every dataset's worth of reads within 4 points (the
chunk-level draws of a curriculum job fill a cache in steps of a chunk; measured gaps are below
3 points). Both sides average 3 seeds.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from reference.itemsim import RefJob, RefScenario, simulate
from reference.trace_csv import trace_csv
from scheduler.cli import app

GB = 1e9
MB = 1e6
ITEMS = 1000
SEEDS = 3
PACE = (0.1, 2.0, 200, 8)  # starting_percent, alpha, step (iterations), batch (items)
SLOW_PACE = (0.05, 1.5, 100, 4)


@dataclass(frozen=True)
class Case:
    name: str
    jobs: tuple[RefJob, ...]
    datasets: dict
    gpus: int
    cache: float
    link: float
    system: str
    partition: bool = True
    items: int = ITEMS


def cur(job_id, dataset, f_mb, passes, pace=PACE, submit=0.0):
    return RefJob(job_id, submit, 1, dataset, f_mb * MB, passes, pace)


def epoch(job_id, dataset, f_mb, epochs, submit=0.0):
    return RefJob(job_id, submit, 1, dataset, f_mb * MB, epochs)


CASES = [
    # One curriculum job whose eligible set outgrows half the dataset's worth of cache.
    *(Case(f"one-{s}{'' if p else '-uniform'}", (cur("c", "ds", 100, 6.0),), {"ds": 100 * GB}, 1, 50 * GB, 40 * MB, s, p, 2000)
      for s, p in (("silod", True), ("silod", False), ("alluxio", True))),
    # A regular and a curriculum job: two partitions; all regular; one LRU.
    *(Case(f"mixed-{s}{'' if p else '-uniform'}", (epoch("e", "d1", 100, 3.0), cur("c", "d2", 100, 5.0)),
           {"d1": 60 * GB, "d2": 80 * GB}, 2, 60 * GB, 50 * MB, s, p)
      for s, p in (("silod", True), ("silod", False), ("alluxio", True))),
    # Two curriculum jobs of different speeds and pacing on two datasets.
    *(Case(f"two-{s}", (cur("a", "d1", 100, 4.0), cur("b", "d2", 50, 3.0, SLOW_PACE, submit=300.0)),
           {"d1": 60 * GB, "d2": 80 * GB}, 2, 50 * GB, 40 * MB, s) for s in ("silod", "alluxio")),
    # A curriculum job holds the only GPU while a regular job on its dataset waits: the
    # dataset is the LRU partition's until the regular job runs (it had no cache at all: 3.1x
    # the item-level JCT; found by fuzzing the two models against each other).
    Case("queued-regular-silod", (cur("c", "d", 100, 2.0), epoch("r", "d", 100, 1.0, submit=10.0)),
         {"d": 40 * GB}, 1, 20 * GB, 30 * MB, "silod"),
    # Two curriculum jobs on one dataset, the second arriving later.
    *(Case(f"shared-{s}", (cur("a", "d1", 100, 4.0), cur("b", "d1", 60, 3.0, submit=500.0)),
           {"d1": 80 * GB}, 2, 40 * GB, 40 * MB, s) for s in ("silod", "alluxio")),
]


def _write_trace(path: Path, jobs, datasets: dict, items: int) -> None:
    path.write_text(trace_csv(jobs, datasets, items))


def _silod(jobs, datasets, items, tmp: Path, seed: int, *args: str) -> dict:
    trace = tmp / "trace.csv"
    _write_trace(trace, jobs, datasets, items)
    out = tmp / f"out{seed}"
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--policy", "fifo", "--seed", str(seed),
                                      "--out", str(out), "--quiet", *args])
    assert result.exit_code == 0, result.output
    with (out / "jobs.csv").open() as fh:
        return {r["job_id"]: (float(r["jct_s"]), [float(h) for h in r["epoch_hit_ratios"].split(";") if h]) for r in csv.DictReader(fh)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_curriculum_agrees_with_item_level_reference(case, tmp_path):
    sc = RefScenario(case.jobs, dict(case.datasets), {d: case.items for d in case.datasets}, case.gpus, case.cache, case.link,
                     case.system, partition=case.partition)
    refs = [simulate(sc, seed=s) for s in range(SEEDS)]
    args = ["--gpus", str(case.gpus), "--gpus-per-node", str(case.gpus), "--cache", f"{case.cache:.0f}",
            "--remote-io", f"{case.link:.0f}", "--cache-system", case.system]
    if not case.partition:
        args.append("--no-irregular-partition")
    ours = [_silod(case.jobs, case.datasets, case.items, tmp_path, s, *args) for s in range(SEEDS)]
    for j in case.jobs:
        ref_jct = float(np.mean([r.jct[j.job_id] for r in refs]))
        jct = float(np.mean([o[j.job_id][0] for o in ours]))
        assert jct == pytest.approx(ref_jct, rel=0.05), (j.job_id, jct, ref_jct)
        n = min(len(r.epoch_hits[j.job_id]) for r in refs)
        n = min(n, *(len(o[j.job_id][1]) for o in ours))
        assert n >= int(j.epochs) - 1
        ref_hits = np.mean([r.epoch_hits[j.job_id][:n] for r in refs], axis=0)
        hits = np.mean([o[j.job_id][1][:n] for o in ours], axis=0)
        assert np.abs(hits - ref_hits).max() <= 0.04, (j.job_id, hits, ref_hits)


def test_curriculum_by_hand(tmp_path):
    """starting_percent 1 (every item eligible), draws with replacement, a cache that holds the
    dataset, link B < f*. Each miss is admitted, so cached bytes c after x bytes read follow
    dc/dx = 1 - c/D: c = D (1 - exp(-x/D)). The job is IO-bound (time = remote bytes / B = c / B)
    until its miss ratio falls to B/f*, at c1 = D (1 - B/f*) after x1 = D ln(f*/B) bytes, then
    reads at f*: JCT = c1/B + (W - x1)/f*. With no cache every byte crosses the link: W/B."""
    d, f, b, work = 100 * GB, 100 * MB, 25 * MB, 3.0
    job = RefJob("c", 0.0, 1, "ds", f, work, (1.0, 1.0, 1, 1))
    x1 = d * math.log(f / b)
    cached = (d * (1 - b / f)) / b + (work * d - x1) / f  # 4,613.7 s
    uncached = work * d / b  # 12,000 s
    for cache, hand in ((150 * GB, cached), (0.0, uncached)):
        runs = [_silod((job,), {"ds": d}, 1000, tmp_path, s, "--gpus", "1", "--gpus-per-node", "1", "--cache", f"{cache:.0f}",
                       "--remote-io", f"{b:.0f}") for s in range(SEEDS)]
        assert float(np.mean([r["c"][0] for r in runs])) == pytest.approx(hand, rel=0.02)
    # A set that always fits: after the first reads of each growth everything hits, JCT ~ ideal.
    job = RefJob("c", 0.0, 1, "ds", f, 4.0, PACE)
    runs = _silod((job,), {"ds": d}, 1000, tmp_path, 0, "--gpus", "1", "--gpus-per-node", "1", "--cache", "200GB", "--remote-io", "1GB/s")
    assert runs["c"][0] == pytest.approx(4 * d / f, rel=0.01)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scheduler", *args], capture_output=True, text=True, timeout=300)


def test_curriculum_needs_item_size(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,access,starting_percent,alpha,step,batch\n"
                     "c,0,1,m,mystery,10GB,10MB/s,2,curriculum,0.1,2,100,8\n")
    proc = _cli("simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2
    assert "item_size" in proc.stderr and "mystery" in proc.stderr


@pytest.mark.parametrize("value, message", [("0", "must be > 0"), ("-5KB", "negative"), ("20GB", "at most the dataset"), ("lots", "item_size")])
def test_bad_item_size(tmp_path, value, message):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,item_size\n"
                     f"c,0,1,m,d,10GB,10MB/s,2,{value}\n")
    proc = _cli("simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "item_size" in proc.stderr and message in proc.stderr, proc.stderr


def test_irregular_partition_holds_in_simulation(tmp_path):
    """The LRU datasets never hold more than their allocation: every timeline sample's cached
    bytes stay within the cluster, and an irregular job's dataset is LRU-cached."""
    from policies.registry import estimator_for, get_policy
    from policies.types import ClusterCapacity
    from scheduler.sim.cache_systems import LruDomain
    from scheduler.sim.engine import SimConfig, Simulator
    from traces.csv_trace import load_csv_trace

    trace_path = tmp_path / "t.csv"
    jobs = (epoch("e", "d1", 100, 3.0), cur("c", "d2", 100, 5.0))
    _write_trace(trace_path, jobs, {"d1": 60 * GB, "d2": 80 * GB}, ITEMS)
    capacity = ClusterCapacity(gpus=2, cache=60 * GB, remote_io=50 * MB, gpus_per_node=2)
    sim = Simulator(load_csv_trace(trace_path), capacity, get_policy("fifo"), estimator_for("silod"), "silod", SimConfig())
    result = sim.run()
    assert not result.unfinished
    assert isinstance(sim.cache.domains.get("d2"), LruDomain)
    for row in result.timeline:
        assert row.cache_cached <= capacity.cache * (1 + 1e-9)


def test_curriculum_mix_keeps_the_traces_own_item_sizes():
    """with_curriculum_jobs (the irregular-mix experiment) paces a job by the item size the trace
    gives for its dataset; only datasets without one take the catalog's (or 110 KB)."""
    from scheduler.sim.experiments import with_curriculum_jobs
    from traces.model import Trace, TraceJob

    jobs = tuple(TraceJob(f"j{i}", float(i), 1, "ResNet-50", ds, 100e6, 2.0)
                 for i, ds in enumerate(["given", "no-size", "given", "no-size"]))
    trace = Trace(jobs, {"given": 100e9, "no-size": 100e9}, item_sizes={"given": 4e6})
    mixed = with_curriculum_jobs(trace, 1.0, seed=0)
    assert all(j.access.kind == "curriculum" for j in mixed.jobs)
    assert mixed.item_sizes == {"given": 4e6, "no-size": 110e3}
    step = {j.dataset: j.access.curriculum.step for j in mixed.jobs}
    # Step = iterations / 12, iterations = 2 x 100 GB / (256 x item): 36x more items at 110 KB.
    assert step["given"] == int(2 * 100e9 / (256 * 4e6) / 12)
    assert step["no-size"] == int(2 * 100e9 / (256 * 110e3) / 12)


def _run(jobs, datasets: dict, tmp_path: Path, gpus: int, cache: float, link: float, seed: int = 0, **config):
    from policies.registry import estimator_for, get_policy
    from policies.types import ClusterCapacity
    from scheduler.sim.engine import SimConfig, Simulator
    from traces.csv_trace import load_csv_trace

    trace_path = tmp_path / f"t{seed}.csv"
    _write_trace(trace_path, jobs, datasets, ITEMS)
    capacity = ClusterCapacity(gpus=gpus, cache=cache, remote_io=link, gpus_per_node=gpus)
    result = Simulator(load_csv_trace(trace_path), capacity, get_policy("fifo"), estimator_for("silod"), "silod",
                       SimConfig(seed=seed, **config)).run()
    assert not result.unfinished
    return result


def test_a_cached_eligible_set_does_not_shorten_steps(tmp_path):
    """A curriculum job whose eligible set never grows (10% of its items) and fits its LRU
    partition: once it is cached the job reads at f* and admits nothing, so nothing but the
    longest step (1,800 s) bounds its steps. By hand: 2 passes of 80 GB at 20 MB/s = 8,000 s,
    never held by the 50 MB/s link. Its fill takes the curriculum bound's 25-s steps (1/16 of
    the 8 GB set at 20 MB/s) until its last chunk is cached (about 80). The engine before took
    320 steps (25 s each to the end: the bound ignored that nothing was left to fill); and with
    a small LRU partition, steps of free space / whole link, which made a 200-job irregular-mix
    trace take 339 CPU s instead of 10."""
    never_grows = (0.1, 2.0, 10**7, 8)
    for cache in (20 * GB, 9 * GB):
        result = _run((cur("c", "d2", 20, 2.0, never_grows),), {"d2": 80 * GB}, tmp_path, 1, cache, 50 * MB)
        assert result.jobs[0].jct_s == pytest.approx(8000.0, rel=1e-9)
        assert result.steps <= 100, result.steps


def test_curriculum_steps_are_converged(tmp_path):
    """As tests/test_sim_convergence.py for the epoch readers: halving the step bound moves no
    job's mean JCT by 1% in the partition cases, where a curriculum job's demand decays as it
    fills its own LRU partition and the link it frees goes to the others at the next step
    (a bound taken at its own IO alone moved mixed-silod's regular job by 1.0%)."""
    from scheduler.sim.engine import SimConfig

    tol = SimConfig().demand_tolerance
    for case in CASES:
        if case.system != "silod" or not case.partition:
            continue
        runs = {t: [_run(case.jobs, case.datasets, tmp_path, case.gpus, case.cache, case.link, seed=s, demand_tolerance=t)
                    for s in range(SEEDS)] for t in (tol, tol / 2)}
        for j in case.jobs:
            base, finer = ([next(r.jct_s for r in res.jobs if r.job_id == j.job_id) for res in runs[t]] for t in (tol, tol / 2))
            assert float(np.mean(finer)) == pytest.approx(float(np.mean(base)), rel=0.01), (case.name, j.job_id)
