"""Estimator check: measured job throughput through the local backend vs SiloDPerf (Eq. 4).

For each point (f*, b, c, d) a job runs through `LocalBackend` exactly as in the service: a
worker process with a real `silod mount` (static --cache-size c, --io-rate b), reading a real
dataset of d bytes from a file:// "remote" store, each epoch in a fresh random order, sleeping
batch/f* per batch (the paper's accelerated-GPU method). The first epoch fills the cache
(delayed effectiveness); throughput is measured on the later epochs and compared with

    predicted = min(f*, b / (1 - c/d))

Each point gets its own dataset name (so its own cache) over one of two shared source
directories. Prints a table and writes JSON (`--out`). The paper reports <= 3% error for its
accelerated-GPU runs; the reference here is the model itself, measured in the same run.

    .venv/bin/python benchmarks/bench_estimator.py --out bench_estimator.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from estimator import silod_perf  # noqa: E402
from policies.types import ClusterCapacity  # noqa: E402
from scheduler.backends.base import BackendConfig, DatasetInfo, JobAllocation, JobSpec  # noqa: E402
from scheduler.backends.local import LocalBackend, fuse_problems  # noqa: E402

MB = 1e6


@dataclass(frozen=True)
class Point:
    ideal: float  # f*, bytes/s
    io: float  # b, bytes/s
    cache_fraction: float  # c/d
    dataset: str  # "small" | "large"


POINTS = [
    Point(8 * MB, 3 * MB, 0.0, "small"),
    Point(8 * MB, 3 * MB, 0.25, "large"),
    Point(8 * MB, 3 * MB, 0.5, "small"),
    Point(8 * MB, 3 * MB, 0.75, "large"),
    Point(6 * MB, 4 * MB, 0.0, "large"),
    Point(6 * MB, 2 * MB, 0.5, "small"),
    Point(12 * MB, 4 * MB, 0.5, "large"),
    Point(4 * MB, 8 * MB, 0.0, "small"),
    Point(10 * MB, 5 * MB, 0.3, "large"),
    Point(6 * MB, 2 * MB, 0.8, "small"),
    Point(16 * MB, 6 * MB, 0.4, "large"),
    Point(5 * MB, 1.5 * MB, 0.6, "small"),
]


def make_dataset(root: Path, n_files: int, min_size: int, max_size: int, seed: int) -> int:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(n_files):
        size = rng.randint(min_size, max_size)
        (root / f"class{i % 8}").mkdir(exist_ok=True)
        (root / f"class{i % 8}" / f"img{i:05d}.bin").write_bytes(rng.randbytes(size))
        total += size
    return total


@dataclass
class Result:
    point: int
    ideal_mb_s: float
    io_mb_s: float
    cache_fraction: float
    dataset_mb: float
    predicted_mb_s: float
    measured_mb_s: float
    error: float
    hit_ratio: float | None
    measured_epochs: int


def run_point(backend: LocalBackend, i: int, p: Point, sources: dict[str, tuple[Path, int]], epochs: int) -> Result:
    src, d = sources[p.dataset]
    cache = p.cache_fraction * d
    job_id = f"bench{i}"
    spec = JobSpec(job_id, job_id, "bench", 1, DatasetInfo(f"bench-ds{i}", src.as_uri(), float(d)),
                   ideal_throughput=p.ideal, total_bytes=epochs * d, consumed_bytes=0.0)
    backend.start(spec, JobAllocation(job_id, 1, 1.0, cache, p.io))
    deadline = time.time() + 60 + epochs * d / min(p.ideal, p.io) * 2
    status = None
    while time.time() < deadline:
        status = backend.job_status(job_id)
        if status and status.get("state") in ("finished", "failed", "stopped"):
            break
        time.sleep(0.25)
    backend.stop(job_id)
    if not status or status.get("state") != "finished":
        raise RuntimeError(f"point {i}: job ended as {status and status.get('state')}: {status and status.get('message')}")
    later = [e for e in status["epochs"] if e["epoch"] >= 1 and e["full"] and e["end"]]
    span = later[-1]["end"] - later[0]["start"]
    measured = sum(e["bytes"] for e in later) / span
    hits = [e["hit_bytes"] for e in later if e["hit_bytes"] is not None]
    hit_ratio = sum(hits) / sum(e["bytes"] for e in later) if len(hits) == len(later) else None
    predicted = float(silod_perf(p.ideal, p.io, cache, d))
    return Result(i, p.ideal / MB, p.io / MB, p.cache_fraction, d / MB, predicted / MB, measured / MB,
                  (measured - predicted) / predicted, hit_ratio, len(later))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_estimator.json"))
    ap.add_argument("--epochs", type=int, default=4, help="epochs per job (the first is the warm-up)")
    ap.add_argument("--parallel", type=int, default=2, help="points measured at once")
    ap.add_argument("--quick", action="store_true", help="smaller datasets, 3 epochs (a rough check)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    problems = fuse_problems()
    if problems:
        print("error: real FUSE mounts are unavailable: " + "; ".join(problems), file=sys.stderr)
        return 1
    from rich.console import Console
    from rich.table import Table

    console = Console()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="silod-bench-estimator-"))
    scale = 0.5 if args.quick else 1.0
    epochs = 3 if args.quick else args.epochs
    sources = {
        "small": (work / "remote" / "small", 0),
        "large": (work / "remote" / "large", 0),
    }
    sources["small"] = (sources["small"][0], make_dataset(sources["small"][0], int(120 * scale), 100_000, 300_000, 1))
    sources["large"] = (sources["large"][0], make_dataset(sources["large"][0], int(160 * scale), 150_000, 350_000, 2))
    cap = ClusterCapacity(gpus=len(POINTS), cache=1e12, remote_io=1e12, gpus_per_node=len(POINTS))
    backend = LocalBackend(BackendConfig(capacity=cap, state_dir=work / "state"))
    t0 = time.time()
    results: list[Result] = []
    try:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool, console.status("measuring...") as st:
            futures = [pool.submit(run_point, backend, i, p, sources, epochs) for i, p in enumerate(POINTS)]
            for n, fut in enumerate(futures, 1):
                results.append(fut.result())
                st.update(f"measuring... {n}/{len(POINTS)} points")
    finally:
        backend.stop_all()
    table = Table(title=f"SiloDPerf vs measured throughput (local backend, real mounts; {epochs - 1} measured epochs)")
    for col in ("#", "f* MB/s", "b MB/s", "c/d", "d MB", "hit ratio", "predicted MB/s", "measured MB/s", "error"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.point), f"{r.ideal_mb_s:g}", f"{r.io_mb_s:g}", f"{r.cache_fraction:.2f}", f"{r.dataset_mb:.1f}",
                      "-" if r.hit_ratio is None else f"{r.hit_ratio:.2f}", f"{r.predicted_mb_s:.2f}",
                      f"{r.measured_mb_s:.2f}", f"{r.error:+.1%}")
    console.print(table)
    errors = [abs(r.error) for r in results]
    summary = {
        "points": len(results),
        "mean_abs_error": sum(errors) / len(errors),
        "max_abs_error": max(errors),
        "epochs": epochs,
        "wall_s": time.time() - t0,
        "results": [asdict(r) for r in results],
    }
    console.print(f"mean |error| {summary['mean_abs_error']:.2%}, max |error| {summary['max_abs_error']:.2%} "
                  f"over {len(results)} points (paper: <= 3%); {summary['wall_s']:.0f}s")
    args.out.write_text(json.dumps(summary, indent=2))
    console.print(f"wrote {args.out}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
