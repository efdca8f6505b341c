"""Gavel max-min fairness: the closed-form solver against the cvxpy reference LP.

    python benchmarks/bench_gavel.py [--sizes 128 512 2048] [--repeats 5] [--out benchmarks/results/gavel.json]

Random but realistic instances: f* 2-900 MB/s, 1-8 GPUs per job, datasets 100 GB-20 TB with about
a third of the jobs sharing a dataset with another job; cluster 400 GPUs, 20 TB cache, 4 GB/s
remote IO. For each size the table gives the exact solver's time (median of --repeats), the
reference's time (one solve; it is the slow side), their ratio (measured in the same run, since
these machines are noisy), and the relative optimality gap |t_exact - t_ref| / t_ref.
Target: exact <= 0.5 s at 2,048 jobs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import cvxpy as cp
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from policies import ClusterCapacity, DatasetView, JobView, SiloDEstimator, Snapshot
from policies.gavel import GavelPolicy, GavelProblem, solve_max_min
from policies.gavel_reference import solve_max_min_reference

MB, GB, TB = 1e6, 1e9, 1e12


def random_snapshot(n: int, rng: np.random.Generator, shared_fraction: float = 0.3, remote_io: float = 4 * GB) -> Snapshot:
    """n active jobs on a 400-GPU, 20 TB cache cluster with `remote_io` bytes/s (default 4 GB/s)."""
    jobs: list[JobView] = []
    sizes: dict[str, float] = {}
    for i in range(n):
        if sizes and rng.random() < shared_fraction:
            name = str(rng.choice(sorted(sizes)))
        else:
            name = f"ds{len(sizes)}"
            sizes[name] = float(np.exp(rng.uniform(np.log(100 * GB), np.log(20 * TB))))
        jobs.append(
            JobView(
                job_id=f"job{i}",
                gpus=int(rng.choice([1, 1, 1, 2, 2, 4, 8])),
                dataset=name,
                ideal_throughput=float(np.exp(rng.uniform(np.log(2 * MB), np.log(900 * MB)))),
                remaining_bytes=float(rng.uniform(1, 50)) * sizes[name],
                submit_time=float(i),
            )
        )
    return Snapshot(
        time=0.0,
        jobs=tuple(jobs),
        datasets={k: DatasetView(k, v) for k, v in sizes.items()},
        capacity=ClusterCapacity(gpus=400, cache=20 * TB, remote_io=remote_io),
    )


def _binding(p: GavelProblem, sol) -> str:
    """Which capacity limits t*: a job's whole gang (x_j = 1), the GPUs, or the remote link."""
    tight = []
    if sol.share.max() >= 1 - 1e-9:
        tight.append("gang")
    if float(p.gpus @ sol.share) >= p.total_gpus * (1 - 1e-9):
        tight.append("GPUs")
    if float(sol.avg_io.sum()) >= p.total_io * (1 - 1e-9):
        tight.append("IO")
    return "+".join(tight) or "?"


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(sizes: list[int], repeats: int, seed: int, ref_limit_s: float, method: str, console: Console, remote_io: float = 4 * GB) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    skip_reference = False
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmark", total=len(sizes))
        for n in sizes:
            progress.update(task, description=f"{n} jobs")
            snapshot = random_snapshot(n, rng, remote_io=remote_io)
            problem = GavelProblem.from_snapshot(snapshot, manages_storage=True)
            exact_s, exact = _timed(lambda p=problem: solve_max_min(p), repeats)
            policy_s, _ = _timed(lambda s=snapshot: GavelPolicy().allocate(s, SiloDEstimator()), repeats)
            row = {
                "jobs": n,
                "datasets": len(problem.dataset_names),
                "exact_s": exact_s,
                "policy_allocate_s": policy_s,
                "exact_ratio": exact.ratio,
                "reference_s": None,
                "reference_ratio": None,
                "speedup": None,
                "gap": None,
                "reference_method": method,
                "binding": _binding(problem, exact),
            }
            if not skip_reference:
                t0 = time.perf_counter()
                ref = solve_max_min_reference(problem, method=method)
                row["reference_s"] = time.perf_counter() - t0
                row["reference_ratio"] = ref.ratio
                row["speedup"] = row["reference_s"] / exact_s
                row["gap"] = abs(exact.ratio - ref.ratio) / ref.ratio
                if row["reference_s"] > ref_limit_s:
                    skip_reference = True  # larger sizes would only take longer
            rows.append(row)
            progress.advance(task)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5, help="timings of the exact solver (median)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--method", choices=["lp", "bisection"], default="lp", help="reference formulation")
    parser.add_argument("--reference-limit", type=float, default=120.0, help="stop running the reference after a solve this slow (s)")
    parser.add_argument("--remote-io", type=float, default=4.0, help="cluster remote IO in GB/s (default 4)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gavel.json"))
    args = parser.parse_args(argv)

    console = Console(width=max(Console().width, 110))
    rows = run(args.sizes, args.repeats, args.seed, args.reference_limit, args.method, console, args.remote_io * GB)

    table = Table(title=f"Gavel max-min: closed form vs cvxpy reference (400 GPUs, 20 TB, {args.remote_io:g} GB/s)")
    for col in ("jobs", "datasets", "exact", "policy.allocate", f"reference ({args.method})", "ref/exact", "gap", "t*", "binds"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["jobs"]),
            str(r["datasets"]),
            f"{r['exact_s'] * 1e3:.2f} ms",
            f"{r['policy_allocate_s'] * 1e3:.2f} ms",
            "not run" if r["reference_s"] is None else f"{r['reference_s']:.3f} s",
            "-" if r["speedup"] is None else f"{r['speedup']:.0f}x",
            "-" if r["gap"] is None else f"{r['gap']:.1e}",
            f"{r['exact_ratio']:.4f}",
            r["binding"],
        )
    console.print(table)
    largest = max(rows, key=lambda r: r["jobs"])
    ok = largest["exact_s"] <= 0.5
    console.print(f"exact solve at {largest['jobs']} jobs: {largest['exact_s'] * 1e3:.2f} ms (target <= 500 ms: {'met' if ok else 'MISSED'})")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "gavel_max_min",
                "cluster": {"gpus": 400, "cache_bytes": 20 * TB, "remote_io_bytes_per_s": args.remote_io * GB},
                "seed": args.seed,
                "repeats": args.repeats,
                "reference_solver": cp.installed_solvers(),
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "rows": rows,
            },
            indent=2,
        )
    )
    console.print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
