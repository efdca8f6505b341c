"""The estimator against a real PyTorch job: min(f*, b / (1 - c/d)) vs measured throughput.

The job is silod_client/examples/train_cnn.py (a small CNN on JPEGs decoded with Pillow in a
torch DataLoader of `--workers` processes, trained on the CPU), run in this process over a real
`silod mount` of a file:// "remote" store: the mount's --cache-size c (uniform caching) and
--io-rate b (the job's remote-IO cap) are the two resources the estimator models. For each point
(c/d in 0, .25, .5, .75, 1) x (b binding, b not binding):

- epoch 0 fills the cache (delayed effectiveness); each later epoch's throughput is its source
  bytes over its time;
- b is 0.35 (binding) or 3 (not) times f* measured just before the point (two reference epochs);
- f* is the job alone with its dataset fully cached (cache = d, no cap): a second trainer on a
  fully cached mount runs one epoch before and one after each measured epoch of a point, since
  this machine's load moves f* by tens of percent within a minute; a point's ratio is the median
  over its epochs of measured / min(mean f* of the epochs around it, b / (1 - c/d)); its f*,
  predicted and measured columns are medians too (so ratio need not be measured / predicted exactly);
- per point and per its f* epochs, the CPU and the run-queue wait (runnable, no core free:
  /proc schedstat) per item of the job's processes (the loop, the loader's workers, the mount),
  the job's cores and the machine's busy share (a second table): what located the partial-cache
  shortfall (docs/sdk.md); beside it two diagnostics, `wait-L` (the point's mount L plus its
  threads' run-queue wait per miss) and the input pipeline's CPU bound (estimator.cpu_perf with
  a hit's and a miss's CPU, the latter from c/d = 0);
- the hit ratio the mount measured over the steady epochs is printed beside c/d;
- beside the paper's prediction, the extended one (estimator.loader_perf, window_io_perf):
  min(1 / (1/f* + (1 - c/d)/m), (b + B/E) / (1 - c/d)). m = W s / L is the rate at which the
  loader's W workers absorb misses of s-byte items that each take L seconds (L and s: the mount's
  measured per-miss service time, open request to last byte delivered, and mean missed item
  size at the same c/d with the link not binding; nothing is fitted); B is the
  burst the mount's token bucket banks while the link idles (the reference epoch before each
  measured one), which an epoch of E seconds reads on top of b E;
- the model alone, as planning sees an allocation it has not run: one L_free (the c/d = 0 point's
  with the link free) and at every point L(b) = max(L_free, W s (1/b' - 1/((1-h) f*))), the wait
  a miss has in the token bucket's queue (estimator.loader_miss_time, b' = b + B/E), beside the
  mount's measured L; and, as a diagnostic, the loader term with L as the workers see it (their
  own open + read time per item, less a hit's, per missed item);
- `spread`: the lowest and highest per-pair ratio; the fully cached points' spread is the
  measurement's noise floor (their prediction is the reference's f* itself). Epochs shorter than
  a second (300 images at ~10 MB/s) gave those controls 0.72-1.20 under load: the default, 1,000
  images and 5 pairs, gives each epoch about a second of steady reading.

Then the job's epoch time under SiloD's plan and under a storage-unaware plan (CoorDL-style
private cache of its GPU share, an equal share of the link), the same cache and link for two
1-GPU jobs: this job and one on a dataset 4x larger with the same f*. SiloD's plan comes from
policies.storage (cache by f*/d, the link max-min by demand).

    .venv/bin/python benchmarks/bench_pytorch_estimator.py [--images 1000] [--pairs 5] [--quick] [--out FILE]
        [--out-of-order] [--fractions 0,0.5,1] [--free-only]

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
    miss_latency_s: float | None  # the mount's mean open latency of a miss over the steady epochs
    miss_service_s: float | None  # the mount's mean per-miss service time (open request to last byte)
    miss_item_bytes: float | None  # mean size of the missed items counted in miss_service_s
    mount_cpu_per_item_s: float | None  # the mount process's CPU seconds per item read (steady epochs)
    burst_bytes: float  # what the token bucket banks while the link idles (0: no cap)
    read_per_item_s: float | None  # the workers' own open + read seconds per item (steady epochs)
    ratio_spread: tuple[float, float]  # min and max of the per-pair ratios
    epoch_s: list[float]
    pairs: list[tuple[float, float]]  # (f* of the reference epoch, the point's epoch), bytes/s
    usage: dict | None = None  # the point's epochs: usage_summary (CPU and run-queue wait per item, per role)
    usage_ref: dict | None = None  # the reference (f*) epochs between them, the same figures


@contextlib.contextmanager
def mounted(work: Path, source: Path, name: str, cache_size: float, io_rate: float | None,  # type: ignore[no-untyped-def]
            fresh: bool = True):
    """A real `silod mount` of `source` with its own cache (dataset `name`; `fresh`: emptied first):
    (mount point, stats file, the mount process's pid)."""
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
        yield mnt, stats, proc.pid
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
        force_unmount(mnt)
        log.close()


def trainer(data: Path, workers: int, prefetch: int = 2, in_order: bool = True):  # type: ignore[no-untyped-def]
    from silod_client.examples.train_cnn import Trainer, parser

    argv = ["--data", str(data), "--workers", str(workers), "--prefetch", str(prefetch)]
    return Trainer(parser().parse_args(argv + ([] if in_order else ["--out-of-order"])))


def run_job(data: Path, epochs: int, workers: int, prefetch: int = 2, in_order: bool = True) -> list[dict]:
    """The training job for `epochs` epochs on `data`: its per-epoch records."""
    t = trainer(data, workers, prefetch, in_order)
    try:
        return [t.epoch() for _ in range(epochs)]
    finally:
        t.close()


def rate(record: dict) -> float:
    return record["bytes"] / record["seconds"]


def steady(records: list[dict]) -> float:
    later = records[1:]
    return sum(e["bytes"] for e in later) / sum(e["seconds"] for e in later)


def median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2



def bracketed(around: list[float]) -> list[float]:
    """The f* of each measured epoch from the reference epochs around it (R P R P ... P R): the
    mean of the one before and the one after (a load drift within a pair cancels to first order)."""
    if len(around) < 2:
        raise ValueError(f"bracketed needs a reference epoch before and after each measured one, got {len(around)}")
    return [(a + z) / 2 for a, z in zip(around, around[1:])]


#: The job's processes whose CPU the benchmark accounts: the training loop's (this process: the
#: model's compute and the batches' collation), the DataLoader's workers (decode) and the mount's.
ROLES = ("main", "workers", "mount")


def schedstat(pid: int) -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a core) of process `pid`; 0, 0 once it is gone.

    CPU from /proc/<pid>/stat (utime + stime: every thread, those that exited too); the wait
    from the kernel's run-queue accounting of its live threads (/proc/<pid>/task/*/schedstat;
    a thread that exited takes its wait with it: libfuse's and the pools' threads persist)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    wait = 0
    for f in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            wait += int(f.read_text().split()[1])
    return cpu, wait / 1e9


def machine_busy() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the whole machine (/proc/stat's cpu line)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(v[:8]), v[3] + v[4]


def worker_pids(t) -> list[int]:  # type: ignore[no-untyped-def]
    """The pids of a Trainer's DataLoader workers (persistent: alive from its first epoch on)."""
    it = getattr(t.loader, "_iterator", None)
    return [w.pid for w in getattr(it, "_workers", [])] if it is not None else []


@dataclass
class Usage:
    """What the job's processes used over some epochs: CPU and run-queue wait (seconds) per
    role, the items read, the wall seconds and the machine's busy share over them."""

    cpu: dict[str, float]
    wait: dict[str, float]
    items: int = 0
    seconds: float = 0.0
    machine: tuple[int, int] = (0, 0)  # (all, idle) jiffies

    @classmethod
    def zero(cls) -> Usage:
        return cls({r: 0.0 for r in ROLES}, {r: 0.0 for r in ROLES})

    def per_item(self, what: str, role: str) -> float | None:
        v = (self.cpu if what == "cpu" else self.wait)[role]
        return v / self.items if self.items else None

    @property
    def busy(self) -> float | None:
        return 1 - self.machine[1] / self.machine[0] if self.machine[0] else None

    @property
    def cores(self) -> float | None:
        """The job's CPU over its wall time: the cores it used."""
        return sum(self.cpu.values()) / self.seconds if self.seconds else None


def usage_summary(u: Usage) -> dict:
    """{"cpu_ms": {role: CPU ms per item}, "wait_ms": {role: run-queue ms per item}, "cores": the
    job's CPU over its wall time, "busy": the machine's busy share}."""
    ms = lambda v: None if v is None else round(v * 1e3, 4)  # noqa: E731
    return {"cpu_ms": {r: ms(u.per_item("cpu", r)) for r in ROLES}, "wait_ms": {r: ms(u.per_item("wait", r)) for r in ROLES},
            "cores": None if u.cores is None else round(u.cores, 3), "busy": None if u.busy is None else round(u.busy, 3),
            "items": u.items}


def accounted_epoch(t, mount_pid: int, usage: Usage) -> dict:  # type: ignore[no-untyped-def]
    """One epoch of Trainer `t` (on the mount of `mount_pid`), its processes' CPU and run-queue
    wait added to `usage`; the epoch's record."""
    pids = {"main": [os.getpid()], "workers": worker_pids(t), "mount": [mount_pid]}
    before = {r: [schedstat(p) for p in ps] for r, ps in pids.items()}
    m0 = machine_busy()
    rec = t.epoch()
    m1 = machine_busy()
    pids["workers"] = pids["workers"] or worker_pids(t)  # a first epoch starts them
    for r, ps in pids.items():
        after = [schedstat(p) for p in ps]
        start = before[r] if len(before[r]) == len(after) else [(0.0, 0.0)] * len(after)
        usage.cpu[r] += sum(a[0] - b[0] for a, b in zip(after, start))
        usage.wait[r] += sum(a[1] - b[1] for a, b in zip(after, start))
    usage.items += rec["items"]
    usage.seconds += rec["seconds"]
    usage.machine = (usage.machine[0] + m1[0] - m0[0], usage.machine[1] + m1[1] - m0[1])
    return rec


def run_point(work: Path, source: Path, d: int, i: int, p: Point, reference, pairs: int, workers: int,  # type: ignore[no-untyped-def]
              prefetch: int = 2, in_order: bool = True, ref_pid: int | None = None) -> Result:
    """One point. Its epochs alternate with epochs of `reference` (a Trainer on the fully cached
    dataset, alone: f*), so that each measured epoch has an f* measured seconds before it: this
    machine's load moves f* by tens of percent within a minute. The point's figure is the median
    over `pairs` pairs after its first epoch (which fills the cache)."""
    cache = p.cache_fraction * d
    b = p.io_rate if p.io_rate is not None else float("inf")
    with mounted(work, source, f"p{i}", max(cache, 0.0), p.io_rate) as (mnt, stats, mount_pid):
        t = trainer(mnt, workers, prefetch, in_order)
        try:
            first = t.epoch()
            time.sleep(0.6)  # the mount rewrites its stats twice a second
            before = json.loads(stats.read_text())
            around, ts, reads = [], [], []
            used, used_ref = Usage.zero(), Usage.zero()

            def ref_epoch() -> float:
                return rate(accounted_epoch(reference, ref_pid, used_ref) if ref_pid else reference.epoch())

            # Each measured epoch between two reference epochs (R P R P ... P R): its f* is the mean
            # of the one before and the one after, so a drift of the machine's load within a pair
            # cancels to first order (one more reference epoch per point than pairs).
            around.append(ref_epoch())
            for _ in range(pairs):
                rec = accounted_epoch(t, mount_pid, used)
                reads.append(rec["read_s"] / rec["items"] if rec["items"] else 0.0)
                ts.append(rate(rec))
                around.append(ref_epoch())
            fs = bracketed(around)
            ratios = [m / (min(f, b / (1 - p.cache_fraction)) if p.cache_fraction < 1 else f) for f, m in zip(fs, ts)]
            time.sleep(0.6)
            after = json.loads(stats.read_text())
        finally:
            t.close()
    read = after["read_bytes"] - before["read_bytes"]
    hit = (after["hit_bytes"] - before["hit_bytes"]) / read if read else None
    lat0, lat1 = before.get("open_latency_miss") or {}, after.get("open_latency_miss") or {}
    misses = (lat1.get("count") or 0) - (lat0.get("count") or 0)
    latency = ((lat1.get("sum_s") or 0.0) - (lat0.get("sum_s") or 0.0)) / misses if misses > 0 else None
    sv0, sv1 = before.get("miss_service") or {}, after.get("miss_service") or {}
    served = (sv1.get("count") or 0) - (sv0.get("count") or 0)
    service = ((sv1.get("sum_s") or 0.0) - (sv0.get("sum_s") or 0.0)) / served if served > 0 else None
    served_item = ((sv1.get("bytes") or 0) - (sv0.get("bytes") or 0)) / served if served > 0 else None
    items = (after.get("hits", 0) + after.get("misses", 0)) - (before.get("hits", 0) + before.get("misses", 0))
    cpu = after.get("process_cpu_s", 0.0) - before.get("process_cpu_s", 0.0)
    cpu_per_item = cpu / items if items > 0 and "process_cpu_s" in after else None
    from fuse_client.token_bucket import TokenBucket

    burst = TokenBucket(rate=b).burst if p.io_rate is not None else 0.0
    fstar, measured = median(fs), median(ts)
    predicted = min(fstar, b / (1 - p.cache_fraction)) if p.cache_fraction < 1 else fstar
    with_hits = None if hit is None else (min(fstar, b / (1 - hit)) if hit < 1 else fstar)
    return Result(p.label, p.cache_fraction, None if p.io_rate is None else p.io_rate / MB, fstar / MB, predicted / MB,
                  measured / MB, median(ratios), hit, None if with_hits is None else with_hits / MB,
                  None if with_hits is None else measured / with_hits, latency, service, served_item, cpu_per_item, burst,
                  median(reads), (min(ratios), max(ratios)),
                  [round(first["seconds"], 3)] + [round(e["seconds"], 3) for e in t.records[1:]], list(zip(fs, ts)),
                  usage_summary(used), usage_summary(used_ref) if ref_pid else None)


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
    ap.add_argument("--images", type=int, default=1000, help="JPEGs in the dataset (~9 KB each)")
    ap.add_argument("--pairs", type=int, default=5, help="measured epochs per point, each after an f* epoch")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--prefetch", type=int, default=2, help="batches each DataLoader worker loads ahead (torch's prefetch_factor)")
    ap.add_argument("--out-of-order", dest="in_order", action="store_false",
                    help="the DataLoader hands batches out as they finish (torch's in_order=False)")
    ap.add_argument("--fractions", default=None, help="comma-separated c/d values to run (default 0,.25,.5,.75,1)")
    ap.add_argument("--free-only", action="store_true", help="only the points whose link does not bind (b = 3 f*)")
    ap.add_argument("--quick", action="store_true", help="200 images, 2 pairs, c/d in 0, .5, 1 (a rough check)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    chosen: tuple[float, ...] = ()
    if args.fractions:
        try:
            chosen = tuple(float(v) for v in args.fractions.split(","))
        except ValueError:
            ap.error(f"--fractions {args.fractions!r}: give comma-separated numbers in [0, 1], e.g. 0,0.5,1")
        if any(not 0 <= c <= 1 for c in chosen):
            ap.error(f"--fractions {args.fractions!r}: each c/d must be in [0, 1]")
    from estimator import silod_perf
    from scheduler.backends.local import fuse_problems
    from scheduler.demo import make_jpegs, torch_problem

    problems = fuse_problems() + ([torch_problem()] if torch_problem() else [])
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 1
    images, pairs, fractions = (200, 2, (0.0, 0.5, 1.0)) if args.quick else (args.images, args.pairs, FRACTIONS)
    if args.fractions:
        fractions = chosen
    links = (B_FREE,) if args.free_only else (B_BIND, B_FREE)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="silod-bench-pytorch-"))
    source = work / "remote" / "jpegs"
    shutil.rmtree(source, ignore_errors=True)
    d = make_jpegs(source, images, seed=1)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    # f*: the job alone on a fully cached mount (filled once, kept), one of its epochs before
    # every measured epoch of a point (run_point).
    with mounted(work, source, "fstar", d * 1.05, None) as (mnt, _stats, ref_pid):
        reference = trainer(mnt, args.workers, args.prefetch, args.in_order)
        try:
            reference.epoch()  # fills the cache
            reference.epoch()  # warm-up: a new DataLoader's first cached epochs run slow
            f_before = median([rate(reference.epoch()) for _ in range(3)])
            print(f"dataset {images} JPEGs, {d / MB:.2f} MB; f* alone, fully cached: {f_before / MB:.3f} MB/s", flush=True)
            # Each point's b from f* measured just before it (two reference epochs), not from the
            # first f* alone: on a shared machine f* moved 2-3x between runs, and a b placed from
            # a low or high first figure moved the bound points across the knee (c/d = 0.5 at
            # 0.35 f* is next to the loader's X(0.5)) from one run to the next.
            results = []
            for i, (c, frac) in enumerate((c, frac) for c in fractions for frac in links):
                f_now = median([rate(reference.epoch()) for _ in range(2)])
                p = Point(c, frac * f_now, f"c/d={c:g} b={'bind' if frac == B_BIND else 'free'}")
                r = run_point(work, source, d, i, p, reference, pairs, args.workers, args.prefetch, args.in_order, ref_pid)
                results.append(r)
                print(f"  {p.label:18s} f* {r.fstar_mb_s:.3f}, predicted {r.predicted_mb_s:.3f}, measured"
                      f" {r.measured_mb_s:.3f} MB/s: {r.ratio:.2f} (hit {r.hit_ratio if r.hit_ratio is not None else float('nan'):.2f})",
                      flush=True)
        finally:
            reference.close()
    refs = [r.fstar_mb_s * MB for r in results]
    fstar = median(refs)

    # The extended prediction (module docstring): the loader's miss term, with the per-miss
    # service time the mount measured at the same c/d with the link not binding (a bound link's
    # token waits are the IO term's), and the token bucket's burst over each measured epoch's length.
    from estimator import loader_miss_rate, loader_perf, window_io_perf

    service_free = {r.cache_fraction: (r.miss_service_s, r.miss_item_bytes) for r in results if r.label.endswith("free")}

    def extended(f: float, r: Result, seconds: float) -> float:
        lat, item = service_free.get(r.cache_fraction) or (None, None)
        m = float(loader_miss_rate(args.workers, item, lat)) if lat and item else float("inf")
        b = r.io_mb_s * MB if r.io_mb_s is not None else float("inf")
        io = float(window_io_perf(b, r.cache_fraction, 1.0, seconds, r.burst_bytes)) if r.cache_fraction < 1 else float("inf")
        return min(float(loader_perf(f, r.cache_fraction, m)), io)

    ext = {r.label: (extended(r.fstar_mb_s * MB, r, d / (r.measured_mb_s * MB)) / MB,
                     median([t / extended(f, r, d / t) for f, t in r.pairs])) for r in results}

    # The same with L as the service reads it: the point's own measured service time (a job's
    # running mean at its allocation). Where the link binds, a miss also waits for the bucket's
    # tokens: the worker is held L_free + that wait, which is what the loader term's Little's law
    # needs (the link term stays the upper bound beside it, min, not added).
    def extended_at(f: float, r: Result, seconds: float) -> float:
        own = (r.miss_service_s, r.miss_item_bytes) if r.miss_service_s and r.miss_item_bytes else None
        lat, item = own or service_free.get(r.cache_fraction) or (None, None)
        m = float(loader_miss_rate(args.workers, item, lat)) if lat and item else float("inf")
        b = r.io_mb_s * MB if r.io_mb_s is not None else float("inf")
        io = float(window_io_perf(b, r.cache_fraction, 1.0, seconds, r.burst_bytes)) if r.cache_fraction < 1 else float("inf")
        return min(float(loader_perf(f, r.cache_fraction, m)), io)

    ext_at = {r.label: median([t / extended_at(f, r, d / t) for f, t in r.pairs]) for r in results}

    # The model alone, as planning sees an allocation it has not run: one L_free for the job (the
    # mount's per-miss time at c/d = 0 with the link free, i.e. measured once) and, at every other
    # point, L(b) = max(L_free, W s (1/b' - 1/((1-h) f*))), the token bucket's queue
    # (estimator.loader_miss_time; b' = b + burst / epoch). Its prediction is
    # loader_perf(f*, c/d, W s / L(b)) beside the window's IO term.
    from estimator import loader_miss_time

    free0 = service_free.get(0.0) or (None, None)

    def model_l(f: float, r: Result, seconds: float) -> float | None:
        if not (free0[0] and free0[1]) or r.cache_fraction >= 1:
            return None
        b = r.io_mb_s * MB if r.io_mb_s is not None else float("inf")
        return float(loader_miss_time(free0[0], args.workers, free0[1], f, r.cache_fraction, b, r.burst_bytes, seconds))

    def model(f: float, r: Result, seconds: float) -> float:
        lat = model_l(f, r, seconds)
        m = float(loader_miss_rate(args.workers, free0[1], lat)) if lat else float("inf")
        b = r.io_mb_s * MB if r.io_mb_s is not None else float("inf")
        io = float(window_io_perf(b, r.cache_fraction, 1.0, seconds, r.burst_bytes)) if r.cache_fraction < 1 else float("inf")
        return min(float(loader_perf(f, r.cache_fraction, m)), io)

    model_at = {r.label: (model_l(r.fstar_mb_s * MB, r, d / (r.measured_mb_s * MB)),
                          median([t / model(f, r, d / t) for f, t in r.pairs])) for r in results}

    # The miss time as the loader's workers see it (train_cnn's open + read per item, less a
    # hit's at the fully cached point with the same b, per missed item): what Little's law needs;
    # the mount's figure starts when the request reaches it and ends at its last byte sent.
    hit_read = {r.label.split()[1]: r.read_per_item_s for r in results if r.cache_fraction == 1.0}

    def worker_l(r: Result) -> float | None:
        hr = hit_read.get(r.label.split()[1])
        if r.cache_fraction >= 1 or hr is None or r.read_per_item_s is None:
            return None
        return max(r.read_per_item_s - hr, 0.0) / (1 - r.cache_fraction)

    def with_worker_l(f: float, r: Result, seconds: float) -> float:
        lat, item = worker_l(r), (service_free.get(r.cache_fraction) or (None, None))[1] or free0[1]
        m = float(loader_miss_rate(args.workers, item, lat)) if lat and item else float("inf")
        b = r.io_mb_s * MB if r.io_mb_s is not None else float("inf")
        io = float(window_io_perf(b, r.cache_fraction, 1.0, seconds, r.burst_bytes)) if r.cache_fraction < 1 else float("inf")
        return min(float(loader_perf(f, r.cache_fraction, m)), io)

    worker_at = {r.label: median([t / with_worker_l(f, r, d / t) for f, t in r.pairs]) for r in results}

    # A diagnostic beside it, not the model the service uses: the misses' cost as the mount's CPU
    # rather than its wall time. A missed item costs the mount cpu_miss - cpu_hit more CPU seconds
    # than a hit (cpu_hit: the fully cached point with the same b); on C cores shared with the
    # job's compute that is the loader term with m = C s / (cpu_miss - cpu_hit).
    cpu_hit = {r.label.split()[1]: r.mount_cpu_per_item_s for r in results if r.cache_fraction == 1.0}

    def cpu_term(f: float, r: Result, seconds: float) -> float:
        hit_cpu, item = cpu_hit.get(r.label.split()[1]), (service_free.get(r.cache_fraction) or (None, None))[1]
        b = r.io_mb_s * MB if r.io_mb_s is not None else float("inf")
        io = float(window_io_perf(b, r.cache_fraction, 1.0, seconds, r.burst_bytes)) if r.cache_fraction < 1 else float("inf")
        if r.cache_fraction >= 1 or hit_cpu is None or r.mount_cpu_per_item_s is None or not item:
            return min(f, io)
        h = r.cache_fraction
        extra = (r.mount_cpu_per_item_s - hit_cpu) / (1 - h)  # CPU seconds per miss beyond a hit's
        m = float(loader_miss_rate(os.cpu_count() or 1, item, extra)) if extra > 0 else float("inf")
        return min(float(loader_perf(f, h, m)), io)

    cpu_ext = {r.label: (cpu_term(r.fstar_mb_s * MB, r, d / (r.measured_mb_s * MB)) / MB,
                         median([t / cpu_term(f, r, d / t) for f, t in r.pairs])) for r in results}

    # Where a miss's time goes beyond what the mount times (a diagnostic): the mount's threads'
    # run-queue wait (schedstat: runnable, no core free) per miss, beyond what a hit of the
    # reference's mount waits. The mount's miss_service starts when its handler runs; a request
    # whose thread waits for a core waits outside it. `wait-L ratio`: the loader term with
    # L = the point's own mount L + that wait.
    def mount_wait_per_miss(r: Result) -> float | None:
        if r.cache_fraction >= 1 or not r.usage or not r.usage_ref:
            return None
        pt, ref = r.usage["wait_ms"]["mount"], r.usage_ref["wait_ms"]["mount"]
        return None if pt is None or ref is None else max(pt - ref, 0.0) / 1e3 / (1 - r.cache_fraction)

    def with_wait_l(f: float, r: Result, seconds: float) -> float:
        wait, (lat, item) = mount_wait_per_miss(r), (r.miss_service_s, r.miss_item_bytes)
        b = r.io_mb_s * MB if r.io_mb_s is not None else float("inf")
        io = float(window_io_perf(b, r.cache_fraction, 1.0, seconds, r.burst_bytes)) if r.cache_fraction < 1 else float("inf")
        if wait is None or not lat or not item:
            return min(float(loader_perf(f, r.cache_fraction, float("inf"))), io)
        return min(float(loader_perf(f, r.cache_fraction, float(loader_miss_rate(args.workers, item, lat + wait)))), io)

    wait_at = {r.label: median([t / with_wait_l(f, r, d / t) for f, t in r.pairs]) for r in results}

    # The input pipeline's CPU as a bound beside the loader term (Plumber's CPU stage, Cachew's
    # cached/uncached cost: estimator.cpu_perf, k / (h/p + (1-h)/r)): every item costs the job's
    # processes (loop, workers, mount) kappa_1 CPU seconds when it is a hit (the point's f*
    # epochs, fully cached: p = s / kappa_1) and kappa_1 + delta when it is a miss (delta: the
    # job's extra CPU per item at c/d = 0 with the link free, measured once: r = s / (kappa_1 +
    # delta)); k: the cores the machine left the job while its f* was measured (C less what other
    # work used: busy C - the job's cores). Nothing of the point's own epochs enters it.
    from estimator import cpu_perf

    item_s = d / images

    def job_cpu(u: dict | None) -> float | None:
        return None if not u or any(v is None for v in u["cpu_ms"].values()) else sum(u["cpu_ms"].values()) / 1e3

    free_0 = next((r for r in results if r.cache_fraction == 0.0 and r.label.endswith("free")), None)
    delta = None
    if free_0 is not None and job_cpu(free_0.usage) is not None and job_cpu(free_0.usage_ref) is not None:
        delta = max(job_cpu(free_0.usage) - job_cpu(free_0.usage_ref), 0.0)  # type: ignore[operator]
    ncpu = os.cpu_count() or 1

    def cpu_bound(r: Result) -> float:
        k1, ref = job_cpu(r.usage_ref), r.usage_ref
        if delta is None or k1 is None or not ref or ref["busy"] is None or ref["cores"] is None or k1 <= 0:
            return float("inf")
        cores = ncpu - max(ref["busy"] * ncpu - ref["cores"], 0.0)
        return float(cpu_perf(cores, item_s / (k1 + delta), r.cache_fraction, item_s / k1))

    def with_cpu(f: float, r: Result, seconds: float, term) -> float:  # type: ignore[no-untyped-def]
        return min(term(f, r, seconds), cpu_bound(r))

    ext_cpu = {r.label: median([t / with_cpu(f, r, d / t, extended) for f, t in r.pairs]) for r in results}
    model_cpu = {r.label: median([t / with_cpu(f, r, d / t, model) for f, t in r.pairs]) for r in results}
    # SiloD's plan vs a storage-unaware one for this job, same cache and link: each cache filled
    # first (in the service the link's spare capacity goes to a job while its cache fills:
    # WorkConservingPusher), then epochs under the two plans' caps, alternating.
    plan = plans(fstar, d)
    room = {name: cache * 1.02 if cache >= d else cache for name, (cache, _io) in plan.items()}  # mount bookkeeping slack
    for name in plan:
        with mounted(work, source, f"plan-{name}", room[name], None) as (mnt, _stats, _pid):
            run_job(mnt, 1, args.workers, args.prefetch, args.in_order)
    with contextlib.ExitStack() as stack:
        runs = {}
        for name, (_cache, io) in plan.items():
            mnt, _stats, _pid = stack.enter_context(mounted(work, source, f"plan-{name}", room[name], io, fresh=False))
            runs[name] = trainer(mnt, args.workers, args.prefetch, args.in_order)
            stack.callback(runs[name].close)
        seconds: dict[str, list[float]] = {name: [] for name in plan}
        for _ in range(pairs + 1):
            for name, t in runs.items():
                seconds[name].append(t.epoch()["seconds"])
    plan_epoch = {name: {"cache_fraction": cache / d, "io_mb_s": io / MB, "epoch_s": median(seconds[name][1:]),
                         "predicted_epoch_s": d / float(silod_perf(fstar, io, cache, d))}
                  for name, (cache, io) in plan.items()}
    load1 = os.getloadavg()[0]

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"real PyTorch job vs min(f*, b/(1-c/d)); f* measured before each point "
                        f"({min(refs) / MB:.3f}-{max(refs) / MB:.3f} MB/s, mean {fstar / MB:.3f}), d = {d / MB:.2f} MB")
    for col in ("c/d", "b MB/s", "f*", "predicted", "measured", "ratio", "spread", "hit (mount)", "miss ms", "model ms",
                "worker ms", "extended", "ratio", "own-L ratio", "model ratio", "worker-L ratio", "cpu-term ratio"):
        table.add_column(col, justify="right")
    fmt = lambda v, f=".3f": "-" if v is None else format(v, f)  # noqa: E731
    ms = lambda v: fmt(None if v is None else v * 1e3, ".2f")  # noqa: E731
    for r in results:
        e = ext[r.label]
        table.add_row(f"{r.cache_fraction:g}", fmt(r.io_mb_s), fmt(r.fstar_mb_s), fmt(r.predicted_mb_s), fmt(r.measured_mb_s),
                      fmt(r.ratio, ".2f"), f"{r.ratio_spread[0]:.2f}-{r.ratio_spread[1]:.2f}", fmt(r.hit_ratio, ".2f"),
                      ms(r.miss_service_s), ms(model_at[r.label][0]), ms(worker_l(r)), fmt(e[0]), fmt(e[1], ".2f"),
                      fmt(ext_at[r.label], ".2f"), fmt(model_at[r.label][1], ".2f"), fmt(worker_at[r.label], ".2f"),
                      fmt(cpu_ext[r.label][1], ".2f"))
    Console(width=200).print(table)
    # The job's processes at each point against its reference (f*) epochs: CPU and run-queue
    # wait per item (ms) of the loop (main), the loader's workers and the mount; the job's cores
    # (CPU over wall) and the machine's busy share (all processes, other work included).
    use = Table(title="the job's CPU and run-queue wait per item (ms; point / its f* epochs), cores used, machine busy")
    for col in ("point", "cpu main", "cpu workers", "cpu mount", "wait main", "wait workers", "wait mount",
                "job cores", "machine busy", "mount wait/miss ms", "wait-L ratio", "cpu bound", "ext+cpu", "model+cpu"):
        use.add_column(col, justify="right")
    pair = lambda u, v, k, role: (f"{fmt(u[k][role], '.2f')} / {fmt(v[k][role], '.2f')}" if u and v else "-")  # noqa: E731
    for r in results:
        u, v = r.usage, r.usage_ref
        use.add_row(r.label, pair(u, v, "cpu_ms", "main"), pair(u, v, "cpu_ms", "workers"), pair(u, v, "cpu_ms", "mount"),
                    pair(u, v, "wait_ms", "main"), pair(u, v, "wait_ms", "workers"), pair(u, v, "wait_ms", "mount"),
                    f"{fmt(u and u['cores'], '.2f')} / {fmt(v and v['cores'], '.2f')}",
                    f"{fmt(u and u['busy'], '.2f')} / {fmt(v and v['busy'], '.2f')}", ms(mount_wait_per_miss(r)),
                    fmt(wait_at[r.label], ".2f"), fmt(cpu_bound(r) / MB), fmt(ext_cpu[r.label], ".2f"),
                    fmt(model_cpu[r.label], ".2f"))
    Console(width=200).print(use)
    within = sum(abs(r.ratio - 1) <= 0.10 for r in results)
    worst = max(results, key=lambda r: abs(r.ratio - 1))
    print(f"{within}/{len(results)} points within 10% of the prediction; worst {worst.label}: ratio {worst.ratio:.2f}")
    within2 = sum(abs(v[1] - 1) <= 0.10 for v in ext.values())
    print(f"extended (loader miss term from the mount's per-miss service time, token-bucket burst): {within2}/{len(ext)}"
          f" points within 10%")
    within_at = sum(abs(v - 1) <= 0.10 for v in ext_at.values())
    print(f"extended with each point's own measured L (as the service reads it: token waits included): {within_at}/{len(ext_at)}"
          f" points within 10%")
    within_model = sum(abs(v[1] - 1) <= 0.10 for v in model_at.values())
    print(f"the model alone (one L_free, from c/d = 0 with the link free; L(b) from the token bucket at every point):"
          f" {within_model}/{len(model_at)} points within 10%")
    within_worker = sum(abs(v - 1) <= 0.10 for v in worker_at.values())
    print(f"diagnostic (L as the loader's workers see it: open + read per miss): {within_worker}/{len(worker_at)} points within 10%")
    controls = [r for r in results if r.cache_fraction >= 1]
    print("noise floor (the fully cached controls, whose prediction is f* itself): per-pair ratios "
          + ", ".join(f"{r.label.split()[1]} {r.ratio_spread[0]:.2f}-{r.ratio_spread[1]:.2f}" for r in controls))
    within3 = sum(abs(v[1] - 1) <= 0.10 for v in cpu_ext.values())
    print(f"diagnostic (the misses' cost as the mount's extra CPU per miss on {os.cpu_count()} cores): {within3}/{len(cpu_ext)}"
          f" points within 10%")
    within_wait = sum(abs(v - 1) <= 0.10 for v in wait_at.values())
    print(f"diagnostic (L = the point's mount L + its threads' run-queue wait per miss): {within_wait}/{len(wait_at)} points within 10%")
    print(f"the job's extra CPU per miss (c/d = 0, link free): {fmt(None if delta is None else delta * 1e3, '.2f')} ms")
    for name, col in (("extended + the CPU bound", ext_cpu), ("the model alone + the CPU bound", model_cpu)):
        print(f"{name}: {sum(abs(v - 1) <= 0.10 for v in col.values())}/{len(col)} points within 10%")
    print(f"load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    s, u = plan_epoch["silod"], plan_epoch["storage-unaware"]
    print(f"epoch time, same cache ({d / MB:.2f} MB) and link ({0.6 * fstar / MB:.3f} MB/s) shared with a 4x-larger"
          f" dataset's job: SiloD's plan (cache {s['cache_fraction']:.2f} d, {s['io_mb_s']:.3f} MB/s) {s['epoch_s']:.2f}s,"
          f" storage-unaware (cache {u['cache_fraction']:.2f} d, {u['io_mb_s']:.3f} MB/s) {u['epoch_s']:.2f}s:"
          f" {u['epoch_s'] / s['epoch_s']:.2f}x (predicted {u['predicted_epoch_s'] / s['predicted_epoch_s']:.2f}x)")
    print(f"wall {time.time() - t0:.0f}s; load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    args.out.write_text(json.dumps({"fstar_mb_s": fstar / MB, "fstar_refs_mb_s": [f / MB for f in refs], "dataset_mb": d / MB, "images": images,
                                    "pairs": pairs, "workers": args.workers, "prefetch": args.prefetch, "in_order": args.in_order, "extended_own_l": ext_at, "model": model_at,
                                    "worker_l": worker_at, "points": [asdict(r) for r in results],
                                    "plans": plan_epoch, "load": [load0, load1],
                                    "extended": ext, "cpu_term": cpu_ext, "wait_l": wait_at, "extended_cpu": ext_cpu, "model_cpu": model_cpu,
                                    "cpu_per_miss_s": delta}, indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
