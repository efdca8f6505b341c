"""The estimator against a real PyTorch job: min(f*, b / (1 - c/d)) vs measured throughput.

The job is silod_client/examples/train_cnn.py (a small CNN on JPEGs decoded with Pillow in a
torch DataLoader of `--workers` processes, trained on the CPU), run in this process over a real
`silod mount` of a file:// "remote" store: the mount's --cache-size c (uniform caching) and
--io-rate b (the job's remote-IO cap) are the two resources the estimator models. For each point
(c/d in 0, .25, .5, .75, 1) x (b binding, b not binding):

- epoch 0 fills the cache (delayed effectiveness); the steady throughput is the source bytes of
  the later epochs over their time;
- f* is the job alone with its dataset fully cached (cache = d, no cap), measured before and
  after the points (the machine's load drifts; the mean is used, both are printed);
- predicted = min(f*, b / (1 - c/d)); also with the hit ratio the mount measured in the steady
  epochs instead of c/d (which tells a cache-model error from a loader effect).

Then the job's epoch time under SiloD's plan and under a storage-unaware plan (CoorDL-style
private cache of its GPU share, an equal share of the link), the same cache and link for two
1-GPU jobs: this job and one on a dataset 4x larger with the same f*. SiloD's plan comes from
policies.storage (cache by f*/d, the link max-min by demand).

    .venv/bin/python benchmarks/bench_pytorch_estimator.py [--quick] [--out FILE]

Needs torch (pip install torch==2.13.0), /dev/fuse, fusermount3 and root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1e6
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: b as a fraction of f*: binding (at c/d < 1 - 0.35 = 0.65 the link is what bounds the job)
#: and not binding (3 f*: never, whatever the cache)
B_BIND, B_FREE = 0.35, 3.0


@dataclass
class Point:
    cache_fraction: float
    io_rate: float | None  # bytes/s; None: no cap
    label: str


@dataclass
class Result:
    label: str
    cache_fraction: float
    io_mb_s: float | None
    fstar_mb_s: float
    predicted_mb_s: float
    measured_mb_s: float
    ratio: float  # measured / predicted
    hit_ratio: float | None  # measured by the mount over the steady epochs
    predicted_with_hits_mb_s: float | None
    ratio_with_hits: float | None
    epoch_s: list[float]


@contextlib.contextmanager
def mounted(work: Path, source: Path, name: str, cache_size: float, io_rate: float | None,  # type: ignore[no-untyped-def]
            fresh: bool = True):
    """A real `silod mount` of `source` with its own cache (dataset `name`; `fresh`: emptied first)."""
    from scheduler.backends.local import silod_cmd
    from scheduler.backends.local_worker import force_unmount

    mnt, cache, stats = work / f"mnt-{name}", work / f"cache-{name}", work / f"stats-{name}.json"
    if fresh:
        shutil.rmtree(cache, ignore_errors=True)
    mnt.mkdir(parents=True, exist_ok=True)
    stats.unlink(missing_ok=True)
    args = [*silod_cmd(), "mount", str(mnt), "--source", source.as_uri(), "--dataset", name, "--job", name,
            "--cache-dir", str(cache), "--cache-size", str(int(cache_size)), "--stats-file", str(stats)]
    if io_rate is not None:
        args += ["--io-rate", repr(float(io_rate))]
    log = open(work / f"mount-{name}.log", "ab")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "SILOD_ALLOWED_URIS": source.parent.as_uri() + "/"})
    try:
        deadline = time.monotonic() + 60
        while not (os.path.ismount(mnt) and stats.exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"silod mount did not come up: {(work / f'mount-{name}.log').read_text()[-1000:]}")
            time.sleep(0.05)
        yield mnt, stats
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
        force_unmount(mnt)
        log.close()


def run_job(data: Path, epochs: int, workers: int, stats_file: Path | None = None) -> tuple[list[dict], list[dict]]:
    """The training job for `epochs` epochs on `data`; per-epoch records, and the mount's
    counters at each epoch's end (when `stats_file` is a mount's)."""
    from silod_client.examples.train_cnn import parser, train

    counters: list[dict] = []

    def on_epoch(_records: list[dict]) -> None:
        if stats_file is not None:
            time.sleep(0.6)  # the mount rewrites its stats twice a second
            counters.append(json.loads(stats_file.read_text()))

    args = parser().parse_args(["--data", str(data), "--epochs", str(epochs), "--workers", str(workers)])
    return train(args, on_epoch), counters


def steady(records: list[dict]) -> float:
    later = records[1:]
    return sum(e["bytes"] for e in later) / sum(e["seconds"] for e in later)


def run_point(work: Path, source: Path, d: int, i: int, p: Point, fstar: float, epochs: int, workers: int) -> Result:
    """One point; `fstar`: the reference measured just before it (the machine's load drifts)."""
    from estimator import silod_perf

    cache = p.cache_fraction * d
    with mounted(work, source, f"p{i}", max(cache, 0.0), p.io_rate) as (mnt, stats):
        records, counters = run_job(mnt, epochs, workers, stats)
    measured = steady(records)
    b = p.io_rate if p.io_rate is not None else float("inf")
    predicted = float(silod_perf(fstar, b, cache, d)) if p.io_rate is not None else fstar
    hit = None
    if len(counters) == len(records) and counters[0].get("read_bytes") is not None:
        read = counters[-1]["read_bytes"] - counters[0]["read_bytes"]
        hits = counters[-1]["hit_bytes"] - counters[0]["hit_bytes"]
        hit = hits / read if read else None
    with_hits = None if hit is None else (min(fstar, b / (1 - hit)) if hit < 1 else fstar)
    return Result(p.label, p.cache_fraction, None if p.io_rate is None else p.io_rate / MB, fstar / MB, predicted / MB,
                  measured / MB, measured / predicted, hit, None if with_hits is None else with_hits / MB,
                  None if with_hits is None else measured / with_hits, [round(e["seconds"], 3) for e in records])


def plans(fstar: float, d: float) -> dict[str, tuple[float, float]]:
    """(cache bytes, link bytes/s) the job gets under SiloD's plan and a storage-unaware one, in a
    cluster of 2 GPUs, cache d and link 0.6 f*, shared with a 1-GPU job of the same f* on a
    dataset of 4 d."""
    import numpy as np

    from policies.storage import fill_in_order, max_min_share

    cache_total, link = d, 0.6 * fstar
    sizes, ideal = np.array([d, 4 * d]), np.array([fstar, fstar])
    cache = fill_in_order(sizes, ideal / sizes, cache_total)  # SiloD: the cache to the job that gains most per byte
    demand = ideal * (1 - cache / sizes)  # Eq. 2: what each needs to run at f* with that cache
    io = max_min_share(demand, link)
    if demand[0] <= 0:  # fully cached: it needs no link (a sliver, for the mount's own metadata)
        io[0] = max(io[0], 0.05 * link)
    return {"silod": (float(cache[0]), float(io[0])), "storage-unaware": (cache_total / 2, link / 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_pytorch_estimator.json"))
    ap.add_argument("--images", type=int, default=400, help="JPEGs in the dataset (~9 KB each)")
    ap.add_argument("--epochs", type=int, default=4, help="epochs per point (the first fills the cache)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--quick", action="store_true", help="120 images, 3 epochs, c/d in 0, .5, 1 (a rough check)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    from scheduler.backends.local import fuse_problems
    from scheduler.demo import make_jpegs, torch_problem

    problems = fuse_problems() + ([torch_problem()] if torch_problem() else [])
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 1
    images, epochs, fractions = (200, 3, (0.0, 0.5, 1.0)) if args.quick else (args.images, args.epochs, FRACTIONS)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="silod-bench-pytorch-"))
    source = work / "remote" / "jpegs"
    shutil.rmtree(source, ignore_errors=True)
    d = make_jpegs(source, images, seed=1)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    # f*: the job alone on a fully cached mount (filled once, kept), measured again just before
    # every point: this machine's load drifts by tens of percent within minutes.
    room = d * 1.05
    with mounted(work, source, "fstar", room, None) as (mnt, _stats):
        run_job(mnt, 1, args.workers)  # fills the cache
        f_before = steady(run_job(mnt, epochs, args.workers)[0])
        print(f"dataset {images} JPEGs, {d / MB:.2f} MB; f* alone, fully cached: {f_before / MB:.3f} MB/s", flush=True)
        points = [Point(c, b * f_before, f"c/d={c:g} b={'bind' if b == B_BIND else 'free'}")
                  for c in fractions for b in (B_BIND, B_FREE)]
        results = []
        refs: list[float] = []
        for i, p in enumerate(points):
            ref = f_before if i == 0 else steady(run_job(mnt, epochs, args.workers)[0])
            refs.append(ref)
            r = run_point(work, source, d, i, p, ref, epochs, args.workers)
            results.append(r)
            print(f"  {p.label:18s} f* {ref / MB:.3f}, predicted {r.predicted_mb_s:.3f}, measured {r.measured_mb_s:.3f}"
                  f" MB/s: {r.ratio:.2f} (hit {r.hit_ratio if r.hit_ratio is not None else float('nan'):.2f})", flush=True)
        f_after = steady(run_job(mnt, epochs, args.workers)[0])
        refs.append(f_after)
    fstar = sum(refs) / len(refs)
    # SiloD's plan vs a storage-unaware one for this job, same cache and link.
    plan_epoch = {}
    for name, (cache, io) in plans(fstar, d).items():
        # The cache filled first (in the service the link's spare capacity goes to a job while its
        # cache fills: WorkConservingPusher), then the steady epochs with the plan's cap.
        room = cache * 1.02 if cache >= d else cache  # a full cache, with the mount's bookkeeping slack
        with mounted(work, source, f"plan-{name}", room, None) as (mnt, _stats):
            run_job(mnt, 1, args.workers)
        with mounted(work, source, f"plan-{name}", room, io, fresh=False) as (mnt, _stats):
            records, _ = run_job(mnt, epochs, args.workers)
        plan_epoch[name] = {"cache_fraction": cache / d, "io_mb_s": io / MB,
                            "epoch_s": sum(e["seconds"] for e in records[1:]) / len(records[1:]),
                            "predicted_epoch_s": d / float(silod_perf(fstar, io, cache, d))}
    load1 = os.getloadavg()[0]

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"real PyTorch job vs min(f*, b/(1-c/d)); f* measured before each point "
                        f"({min(refs) / MB:.3f}-{max(refs) / MB:.3f} MB/s, mean {fstar / MB:.3f}), d = {d / MB:.2f} MB")
    for col in ("c/d", "b MB/s", "f*", "predicted", "measured", "ratio", "hit (mount)", "pred. w/ hit", "ratio w/ hit"):
        table.add_column(col, justify="right")
    fmt = lambda v, f=".3f": "-" if v is None else format(v, f)  # noqa: E731
    for r in results:
        table.add_row(f"{r.cache_fraction:g}", fmt(r.io_mb_s), fmt(r.fstar_mb_s), fmt(r.predicted_mb_s), fmt(r.measured_mb_s),
                      fmt(r.ratio, ".2f"), fmt(r.hit_ratio, ".2f"), fmt(r.predicted_with_hits_mb_s), fmt(r.ratio_with_hits, ".2f"))
    Console(width=120).print(table)
    within = sum(abs(r.ratio - 1) <= 0.10 for r in results)
    worst = max(results, key=lambda r: abs(r.ratio - 1))
    print(f"{within}/{len(results)} points within 10% of the prediction; worst {worst.label}: ratio {worst.ratio:.2f}")
    s, u = plan_epoch["silod"], plan_epoch["storage-unaware"]
    print(f"epoch time, same cache ({d / MB:.2f} MB) and link ({0.6 * fstar / MB:.3f} MB/s) shared with a 4x-larger"
          f" dataset's job: SiloD's plan (cache {s['cache_fraction']:.2f} d, {s['io_mb_s']:.3f} MB/s) {s['epoch_s']:.2f}s,"
          f" storage-unaware (cache {u['cache_fraction']:.2f} d, {u['io_mb_s']:.3f} MB/s) {u['epoch_s']:.2f}s:"
          f" {u['epoch_s'] / s['epoch_s']:.2f}x (predicted {u['predicted_epoch_s'] / s['predicted_epoch_s']:.2f}x)")
    print(f"wall {time.time() - t0:.0f}s; load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    args.out.write_text(json.dumps({"fstar_mb_s": fstar / MB, "fstar_refs_mb_s": [f / MB for f in refs], "dataset_mb": d / MB, "images": images,
                                    "epochs": epochs, "workers": args.workers, "points": [asdict(r) for r in results],
                                    "plans": plan_epoch, "load": [load0, load1]}, indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
