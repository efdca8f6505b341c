"""Random small scenarios through the simulator and the item-level model, side by side.

    cd tests && python -m reference.fuzz --start 0 --n 200 --out /tmp/fuzz.jsonl

Scenario i comes from one generator (seed 20261127), so its index names the same scenario on
every machine: docs/known-gaps.md and docs/simulator.md ("Random scenarios") refer to scenarios
by it. Each scenario: 1-4 jobs (FIFO), 1-3 GPUs, 1-3 datasets of 20-120 GB with 1,000 items,
cache 10-120 GB, link 20-100 MB/s, f* 20-300 MB/s, staggered arrivals; the four cache systems in
turn; on silod, 40% of scenarios have curriculum jobs (irregular partition on).

Each line of --out holds the scenario, both sides' JCT per seed and each job's ratio of mean
JCTs (ours / item level); a scenario whose worst job is off by more than --flag over 3 seeds is
run again over 6 and written with `"confirmed"`: whether it is still off. Not a test: a search for cases to turn into
tests (tests/test_sim_reference.py) or to write down (docs/known-gaps.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from reference.itemsim import RefJob, RefScenario, simulate
from reference.trace_csv import trace_csv

GB, MB = 1e9, 1e6
ITEMS = 1000  # items per dataset on both sides
SYSTEMS = ("silod", "alluxio", "coordl", "quiver")
#: (starting_percent, alpha, step, batch) of the curriculum jobs
PACINGS = ((0.1, 2.0, 200, 8), (0.05, 1.5, 100, 4))
GENERATOR_SEED = 20261127


def scenario(rng: random.Random, idx: int) -> RefScenario:
    """Scenario `idx`; the calls to `rng` must stay in this order for the indices to hold."""
    system = SYSTEMS[idx % 4]
    datasets = {f"d{i}": rng.randint(20, 120) * GB for i in range(rng.randint(1, 3))}
    gpus = rng.randint(1, 3)
    njobs = rng.randint(1, 4)
    curriculum_ok = system == "silod" and rng.random() < 0.4
    jobs = []
    for k in range(njobs):
        ds = rng.choice(list(datasets))
        f = rng.randint(20, 300)
        submit = 0.0 if k == 0 else float(rng.randint(0, 3000))
        if curriculum_ok and rng.random() < 0.5:
            jobs.append(RefJob(f"j{k}", submit, 1, ds, f * MB, float(rng.randint(1, 4)), tuple(rng.choice(PACINGS))))
        else:
            g = 2 if (gpus >= 2 and rng.random() < 0.2) else 1
            jobs.append(RefJob(f"j{k}", submit, g, ds, f * MB, float(rng.randint(1, 4))))
    return RefScenario(tuple(jobs), datasets, {d: ITEMS for d in datasets}, gpus, rng.randint(10, 120) * GB,
                       rng.randint(20, 100) * MB, system)


def scenarios(count: int) -> list[RefScenario]:
    rng = random.Random(GENERATOR_SEED)
    return [scenario(rng, i) for i in range(count)]


def run_simulator(sc: RefScenario, seeds) -> dict[str, list[float]]:
    """Job id -> JCT per seed from the simulator, configured as `silod simulate` would be."""
    from scheduler.core.cluster import load_cluster
    from scheduler.sim.cli import DEFAULT_CLUSTER, DEFAULT_RESOLUTION, DEFAULT_ROUND_S, run_simulation
    from traces.loader import TraceFormat, load_trace

    out: dict[str, list[float]] = {j.job_id: [] for j in sc.jobs}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.csv"
        trace.write_text(trace_csv(sc.jobs, sc.dataset_bytes, ITEMS))
        for seed in seeds:
            cap, speed = load_cluster(None, gpus=str(sc.gpus), gpus_per_node=str(sc.gpus), cache=f"{sc.cache:.0f}",
                                      remote_io=f"{sc.link:.0f}", defaults=DEFAULT_CLUSTER)
            result = run_simulation(load_trace(trace, TraceFormat.auto, 0.0, None, seed), cap, speed, "fifo", sc.system,
                                    DEFAULT_ROUND_S, DEFAULT_RESOLUTION, seed, None, partition=sc.partition)
            if result.unfinished:
                raise RuntimeError(f"the simulator left jobs unfinished: {result.unfinished}")
            for r in result.jobs:
                out[r.job_id].append(r.jct_s)
    return out


def run_reference(sc: RefScenario, seeds) -> dict[str, list[float]]:
    runs = [simulate(sc, seed=s) for s in seeds]
    return {j.job_id: [r.jct[j.job_id] for r in runs] for j in sc.jobs}


def compare(idx: int, sc: RefScenario, seeds) -> dict:
    t0 = time.perf_counter()
    ref = run_reference(sc, seeds)
    t1 = time.perf_counter()
    ours = run_simulator(sc, seeds)
    t2 = time.perf_counter()
    ratios = {k: float(np.mean(ours[k]) / np.mean(ref[k])) for k in ref}
    worst = max(ratios, key=lambda k: abs(math.log(ratios[k])))
    return dict(idx=idx, system=sc.system, scenario=repr(sc), seeds=list(seeds), ref=ref, ours=ours, ratios=ratios,
                worst_job=worst, worst_ratio=ratios[worst], ref_s=round(t1 - t0, 2), ours_s=round(t2 - t1, 2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=int, default=0, help="first scenario index")
    ap.add_argument("--n", type=int, default=100, help="how many scenarios")
    ap.add_argument("--only", type=str, default="", help="comma-separated scenario indices (instead of --start/--n)")
    ap.add_argument("--system", choices=SYSTEMS, help="only scenarios of this cache system")
    ap.add_argument("--flag", type=float, default=0.05, help="re-run over 6 seeds when the worst job is off by more")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    a = ap.parse_args(argv)
    if a.n < 0 or a.start < 0:
        ap.error("--start and --n must be >= 0")
    try:
        only = sorted({int(x) for x in a.only.split(",") if x.strip()}) if a.only else []
    except ValueError:
        ap.error(f"--only {a.only!r}: give scenario indices as integers, e.g. --only 180,244")
    if any(i < 0 for i in only):
        ap.error("--only takes scenario indices >= 0")
    wanted = only or list(range(a.start, a.start + a.n))
    all_scenarios = scenarios(max(wanted) + 1) if wanted else []
    with a.out.open("a") as fh:
        for idx in wanted:
            sc = all_scenarios[idx]
            if a.system and sc.system != a.system:
                continue
            rec = compare(idx, sc, range(3))
            if abs(rec["worst_ratio"] - 1) > a.flag:
                rec = compare(idx, sc, range(6))
                rec["confirmed"] = abs(rec["worst_ratio"] - 1) > a.flag
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            print(f"{idx} {sc.system} worst {rec['worst_job']} {rec['worst_ratio']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
