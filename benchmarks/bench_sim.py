"""Simulator speed and memory (issue 2 targets), as ratios to a reference measured in the same run.

    python benchmarks/bench_sim.py [--trace ../shared/traces/gavel-msr/6c71a0.trace] [--out FILE]

1. One (policy, cache system) run of the 2,000-job Philly trace on 400 GPUs, 100 TB, 4 GB/s,
   for every pair of the 3 x 4 matrix (target: <= 20 s each, <= 3 min in all).
2. Growth of run time with 1k, 2k and 10k jobs (synthetic Philly-distribution traces at the same
   load, one job every 1,210 s on average, so 2,000 jobs span 4 weeks; FIFO on silod), reported
   as the ratio to the 1k-job run.
3. Peak memory (ru_maxrss of a child process) of the 10k-job run (target <= 2 GB), and the ratio
   to the child's memory after imports alone.
"""

from __future__ import annotations

import argparse
import json

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import resource, sys, json, time
sys.path.insert(0, {root!r})
from traces.synthetic import generate_trace
from scheduler.cli_sim import run_simulation
from scheduler.cluster import load_cluster
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = {n}
trace = generate_trace(n, mean_interarrival_s=1210.0, seed=3)  # same load at every size
cap, speed = load_cluster(gpus=400, gpus_per_node=4, cache="100TB", remote_io="4GB/s")
t = time.perf_counter()
run_simulation(trace, cap, speed, "fifo", "silod", 360.0, 128, 0)
print(json.dumps({{"jobs": n, "wall_s": time.perf_counter() - t, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "import_kb": base}}))
"""


def child_run(n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), n=n)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "gavel-msr" / "6c71a0.trace"))
    parser.add_argument("--out", default=str(ROOT / "out" / "bench_sim.json"))
    parser.add_argument("--skip-matrix", action="store_true")
    args = parser.parse_args()

    from scheduler.cli_sim import TraceFormat, load_trace, run_simulation
    from scheduler.cluster import load_cluster

    results: dict = {"matrix": {}, "growth": [], "memory": {}}
    if not args.skip_matrix:
        trace = load_trace(Path(args.trace), TraceFormat.gavel)
        cap, speed = load_cluster(gpus=400, gpus_per_node=4, cache="100TB", remote_io="4GB/s")
        total = 0.0
        for policy in ("fifo", "sjf", "gavel"):
            for system in ("silod", "alluxio", "coordl", "quiver"):
                t = time.perf_counter()
                run_simulation(trace, cap, speed, policy, system, 360.0, 128, 0)
                wall = time.perf_counter() - t
                total += wall
                results["matrix"][f"{policy}/{system}"] = wall
                print(f"{policy:>6}/{system:<8} {len(trace)} jobs: {wall:6.1f} s", flush=True)
        results["matrix_total_s"] = total
        print(f"matrix total: {total:.1f} s (target <= 180 s); worst single run {max(results['matrix'].values()):.1f} s (target <= 20 s)")

    runs = [child_run(n) for n in (1000, 2000, 10000)]
    ref = runs[0]["wall_s"]
    for r in runs:
        r["ratio_to_1k"] = r["wall_s"] / ref
        results["growth"].append(r)
        print(f"{r['jobs']:>6} jobs: {r['wall_s']:6.1f} s  ({r['ratio_to_1k']:.2f}x the 1k-job run)  peak RSS {r['peak_kb'] / 1024:.0f} MB")
    big = runs[-1]
    results["memory"] = {"peak_mb_10k": big["peak_kb"] / 1024, "import_mb": big["import_kb"] / 1024, "ratio": big["peak_kb"] / big["import_kb"]}
    print(f"10k-job peak memory {big['peak_kb'] / 1024:.0f} MB (target <= 2048 MB), {results['memory']['ratio']:.2f}x the process after imports")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
