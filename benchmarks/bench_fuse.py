"""Data-plane benchmarks: every figure is a ratio against a reference measured in the same run.

    python benchmarks/bench_fuse.py                 # everything (about 3-4 minutes)
    python benchmarks/bench_fuse.py --only large --only small
    python benchmarks/bench_fuse.py --bucket-seconds 3  # shorter token-bucket runs

1. large  cached reads of large files through `silod mount`, against (a) a bare pass-through
          FUSE file system on the same binding (mfusepy) with the same fd-based read_buf and
          the same options, (b) the same with plain `read` returning bytes (what a naive
          mfusepy file system does), and (c) reading the cache directory directly.
2. small  110 KB cached files, 8 reader threads, files/s, same references.
3. bucket achieved remote-fetch rate over N seconds for 1 MB/s .. 500 MB/s (cache size 0, so
          every read is a remote fetch), ratio to the configured rate.
4. rss    peak RSS of the `silod mount` process while serving a 10 GB (sparse) dataset,
          against its RSS right after mounting.

Results are printed and written as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 1 << 20


# -- the bare pass-through reference (runs as `bench_fuse.py --serve-passthrough SRC MNT`) -----


def serve_passthrough(src: str, mnt: str, naive: bool, kernel_cache: bool = False) -> None:
    import errno
    import stat

    import mfusepy

    from fuse_client.fs import METADATA_TIMEOUT_S
    from fuse_client.fusebuf import enable_splice, pin_thread_state, reply_with_fd

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def init_with_config(self, conn, cfg):
            enable_splice(conn)
            if conn is not None:
                conn.max_readahead = max(conn.max_readahead, 1 << 20)
            if cfg is not None:
                cfg.entry_timeout = cfg.attr_timeout = cfg.negative_timeout = METADATA_TIMEOUT_S
                cfg.kernel_cache = int(kernel_cache)  # libfuse then sets keep_cache on every open

        def getattr(self, path, fh=None):
            pin_thread_state()  # same binding-level tuning as silod, so ratios measure silod's own cost
            try:
                st = os.lstat(src + path)
            except FileNotFoundError:
                raise mfusepy.FuseOSError(errno.ENOENT)
            mode = (stat.S_IFDIR | 0o555) if stat.S_ISDIR(st.st_mode) else (stat.S_IFREG | 0o444)
            return {"st_mode": mode, "st_size": st.st_size, "st_nlink": 1, "st_mtime": st.st_mtime_ns}

        def readdir(self, path, fh):
            return [".", "..", *os.listdir(src + path)]

        def open(self, path, fi):
            pin_thread_state()
            fi.fh = os.open(src + path, os.O_RDONLY)
            return 0

        def release(self, path, fi):
            pin_thread_state()
            os.close(fi.fh)
            return 0

    if naive:
        def read(self, path, size, offset, fi):
            pin_thread_state()
            return os.pread(fi.fh, size, offset)

        Passthrough.read = read
    else:
        def read_buf(self, path, bufpp, size, offset, fi):
            pin_thread_state()
            return reply_with_fd(bufpp, fi.fh, size, offset)

        Passthrough.read_buf = read_buf

    mfusepy.FUSE(Passthrough(), mnt, raw_fi=True, foreground=True, ro=True, fsname="passthrough", default_permissions=True)


# -- process helpers ---------------------------------------------------------------------------


def silod() -> list[str]:
    script = Path(sys.executable).parent / "silod"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from scheduler.cli import main; main()"]


def unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-u", str(path)], ["fusermount3", "-u", "-z", str(path)]):
        if os.path.ismount(path):
            subprocess.run(cmd, capture_output=True)


class Proc:
    def __init__(self, args: list[str], mnt: Path, ready=None, timeout: float = 60, env: dict | None = None) -> None:
        unmount(mnt)
        mnt.mkdir(parents=True, exist_ok=True)
        self.mnt = mnt
        self.log = open(mnt.parent / f"{mnt.name}.log", "w")
        self.p = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.time() + timeout
        while not (os.path.ismount(mnt) and (ready is None or ready())):
            if self.p.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{args} did not mount: see {self.log.name}")
            time.sleep(0.05)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.p.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
        unmount(self.mnt)


def silod_mount(src: Path, mnt: Path, cache: Path, dataset: str, *extra: str, env: dict | None = None) -> tuple[Proc, Path]:
    stats = mnt.parent / f"{mnt.name}.stats.json"
    stats.unlink(missing_ok=True)
    proc = Proc([*silod(), "mount", str(mnt), "--source", str(src), "--dataset", dataset, "--job", "bench",
                 "--cache-dir", str(cache), "--stats-file", str(stats), *extra], mnt, ready=stats.exists, env=env)
    return proc, stats


def passthrough_mount(src: Path, mnt: Path, naive: bool = False, kernel_cache: bool = False) -> Proc:
    args = [sys.executable, __file__, "--serve-passthrough", str(src), str(mnt)] + (["--naive"] if naive else [])
    args += ["--kernel-cache"] if kernel_cache else []
    return Proc(args, mnt)


# -- readers -----------------------------------------------------------------------------------


def read_file(path: Path, buf: bytearray) -> int:
    total = 0
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        while n := f.readinto(view):
            total += n
    return total


def throughput(root: Path, rels: list[str], threads: int, passes: int = 3, bufsize: int = MiB) -> float:
    """Best of `passes` (bytes/s) reading every file once with `threads` readers."""
    best = 0.0
    for _ in range(passes):
        bufs = [bytearray(bufsize) for _ in range(threads)]
        local = threading.local()
        counter = iter(range(threads))

        def work(rel: str) -> int:
            if not hasattr(local, "buf"):
                local.buf = bufs[next(counter)]
            return read_file(root / rel, local.buf)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(work, rels))
        best = max(best, total / (time.perf_counter() - t0))
    return best


def files_per_s(root: Path, rels: list[str], threads: int, passes: int = 3) -> float:
    best = 0.0
    for _ in range(passes):
        order = rels[:]
        random.shuffle(order)

        def work(rel: str) -> int:
            with open(root / rel, "rb", buffering=0) as f:
                return len(f.read())

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            for _ in pool.map(work, order, chunksize=64):
                pass
        best = max(best, len(order) / (time.perf_counter() - t0))
    return best


def make_files(root: Path, count: int, size: int, sparse: bool = False) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(MiB)
    rels = []
    for i in range(count):
        rel = f"d{i % 16:02d}/f{i:06d}.bin"
        path = root / rel
        rels.append(rel)
        if path.exists() and path.stat().st_size == size:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            if sparse:
                f.truncate(size)
                continue
            left = size
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    return rels


# -- benchmarks --------------------------------------------------------------------------------


def cache_dir_files(cache: Path, dataset: str) -> tuple[Path, list[str]]:
    items = cache / dataset / "items"
    return items, sorted(str(p.relative_to(items)) for p in items.glob("*/*"))


def bench_large(work: Path, size_mb: int, count: int) -> dict:
    """Cached large files. Two regimes, each against a pass-through with the same options:

    - data path: every byte goes through the FUSE daemon (`--no-kernel-cache`, or the first read
      of an item after mounting), reference = pass-through answering read_buf with the fd;
    - steady state: silod's default `--kernel-cache` lets the kernel keep pages of cached
      items, reference = pass-through with libfuse's kernel_cache.
    """
    src, cache = work / "large-src", work / "large-cache"
    shutil.rmtree(cache, ignore_errors=True)
    rels = make_files(src, count, size_mb * MiB)
    proc, _ = silod_mount(src, work / "mnt-silod", cache, "large")
    try:
        throughput(proc.mnt, rels, 2, passes=1)  # epoch 1: fetch into the cache
    finally:
        proc.stop()
    r: dict = {"dataset": f"{count} x {size_mb} MiB"}
    proc, _ = silod_mount(src, work / "mnt-silod", cache, "large")  # fresh mount: no FUSE page cache
    try:
        r["silod_first_pass_GBps"] = throughput(proc.mnt, rels, 1, passes=1) / 1e9
        r["silod_GBps_1_thread"] = throughput(proc.mnt, rels, 1) / 1e9
        r["silod_GBps_4_threads"] = throughput(proc.mnt, rels, 4) / 1e9
    finally:
        proc.stop()
    proc, _ = silod_mount(src, work / "mnt-silod", cache, "large", "--no-kernel-cache")
    try:
        r["silod_no_kernel_cache_GBps_1_thread"] = throughput(proc.mnt, rels, 1) / 1e9
        r["silod_no_kernel_cache_GBps_4_threads"] = throughput(proc.mnt, rels, 4) / 1e9
    finally:
        proc.stop()
    items, item_rels = cache_dir_files(cache, "large")
    r["direct_GBps_1_thread"] = throughput(items, item_rels, 1) / 1e9
    r["direct_GBps_4_threads"] = throughput(items, item_rels, 4) / 1e9
    pt = passthrough_mount(items, work / "mnt-pt")
    try:
        r["passthrough_GBps_1_thread"] = throughput(pt.mnt, item_rels, 1) / 1e9
        r["passthrough_GBps_4_threads"] = throughput(pt.mnt, item_rels, 4) / 1e9
    finally:
        pt.stop()
    pt = passthrough_mount(items, work / "mnt-pt", kernel_cache=True)
    try:
        r["passthrough_kc_first_pass_GBps"] = throughput(pt.mnt, item_rels, 1, passes=1) / 1e9
        r["passthrough_kc_GBps_1_thread"] = throughput(pt.mnt, item_rels, 1) / 1e9
        r["passthrough_kc_GBps_4_threads"] = throughput(pt.mnt, item_rels, 4) / 1e9
    finally:
        pt.stop()
    pt = passthrough_mount(items, work / "mnt-pt", naive=True)
    try:
        r["naive_passthrough_GBps_1_thread"] = throughput(pt.mnt, item_rels, 1) / 1e9
    finally:
        pt.stop()
    r.update(
        ratio_steady_to_passthrough_kc_1_thread=r["silod_GBps_1_thread"] / r["passthrough_kc_GBps_1_thread"],
        ratio_steady_to_passthrough_kc_4_threads=r["silod_GBps_4_threads"] / r["passthrough_kc_GBps_4_threads"],
        ratio_first_pass_to_passthrough_kc_first_pass=r["silod_first_pass_GBps"] / r["passthrough_kc_first_pass_GBps"],
        ratio_data_path_to_passthrough_1_thread=r["silod_no_kernel_cache_GBps_1_thread"] / r["passthrough_GBps_1_thread"],
        ratio_data_path_to_passthrough_4_threads=r["silod_no_kernel_cache_GBps_4_threads"] / r["passthrough_GBps_4_threads"],
        ratio_data_path_to_naive_passthrough=r["silod_no_kernel_cache_GBps_1_thread"] / r["naive_passthrough_GBps_1_thread"],
        ratio_steady_to_direct_1_thread=r["silod_GBps_1_thread"] / r["direct_GBps_1_thread"],
        ratio_data_path_to_direct_1_thread=r["silod_no_kernel_cache_GBps_1_thread"] / r["direct_GBps_1_thread"],
        target=">= 1.5 GB/s and >= 0.9 x passthrough",
    )
    return r


def bench_small(work: Path, count: int, threads: int = 8) -> dict:
    src, cache = work / "small-src", work / "small-cache"
    shutil.rmtree(cache, ignore_errors=True)
    rels = make_files(src, count, 110 * 1000)
    proc, _ = silod_mount(src, work / "mnt-silod", cache, "small")
    try:
        files_per_s(proc.mnt, rels, threads, passes=1)  # epoch 1: fetch into the cache
        silod_fps = files_per_s(proc.mnt, rels, threads)
    finally:
        proc.stop()
    items, item_rels = cache_dir_files(cache, "small")
    direct = files_per_s(items, item_rels, threads)
    pt = passthrough_mount(items, work / "mnt-pt")
    try:
        files_per_s(pt.mnt, item_rels, threads, passes=1)
        pt_fps = files_per_s(pt.mnt, item_rels, threads)
    finally:
        pt.stop()
    return {
        "files": count, "file_size": 110_000, "threads": threads,
        "silod_files_per_s": silod_fps, "passthrough_files_per_s": pt_fps, "direct_files_per_s": direct,
        "ratio_to_passthrough": silod_fps / pt_fps, "ratio_to_direct": silod_fps / direct,
        "target": ">= 10000 files/s",
    }


def bench_bucket(work: Path, rates: list[float], seconds: float) -> dict:
    src, cache = work / "bucket-src", work / "bucket-cache"
    rels = make_files(src, 64, 16 * MiB)
    out = []
    for rate in rates:
        shutil.rmtree(cache, ignore_errors=True)
        proc, stats_path = silod_mount(src, work / "mnt-silod", cache, "bucket", "--cache-size", "0", "--io-rate", str(rate))
        stop = threading.Event()

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            buf = bytearray(MiB)
            while not stop.is_set():
                try:
                    read_file(proc.mnt / rng.choice(rels), buf)
                except OSError:
                    return

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(4)]
        try:
            for t in threads:
                t.start()
            time.sleep(1.0)  # let the bucket reach steady state
            first = _fresh_stats(stats_path)
            time.sleep(seconds)
            last = _fresh_stats(stats_path)
            achieved = (last["remote_bytes"] - first["remote_bytes"]) / (last["updated_at"] - first["updated_at"])
            out.append({"rate_Bps": rate, "achieved_Bps": achieved, "ratio": achieved / rate,
                        "window_s": last["updated_at"] - first["updated_at"]})
        finally:
            stop.set()
            proc.stop()
            for t in threads:
                t.join(5)
    return {"runs": out, "target": "ratio within 0.97 .. 1.03"}


def _fresh_stats(path: Path) -> dict:
    t0 = time.time()
    while True:
        s = json.loads(path.read_text())
        if s["updated_at"] > t0:
            return s
        time.sleep(0.01)


def bench_rss(work: Path, total_gb: float, file_mb: int) -> dict:
    src, cache = work / "rss-src", work / "rss-cache"
    shutil.rmtree(cache, ignore_errors=True)
    count = int(total_gb * 1e9 / (file_mb * MiB)) + 1
    rels = make_files(src, count, file_mb * MiB, sparse=True)
    proc, stats_path = silod_mount(src, work / "mnt-silod", cache, "rss", "--cache-size", "1GB")
    peak = 0.0
    try:
        time.sleep(0.5)
        idle = proc.rss_mb()
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, proc.rss_mb())
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        total = throughput(proc.mnt, rels, 2, passes=1)
        elapsed = time.perf_counter() - t0
        done.set()
        sampler.join()
        served = json.loads(stats_path.read_text())["read_bytes"]
    finally:
        proc.stop()
    return {"dataset_GB": count * file_mb * MiB / 1e9, "served_GB": served / 1e9, "read_GBps": total / 1e9,
            "elapsed_s": elapsed, "idle_rss_MB": idle, "peak_rss_MB": peak, "ratio_peak_to_idle": peak / idle,
            "target": "peak RSS <= 200 MB"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-passthrough", nargs=2, metavar=("SRC", "MNT"), help=argparse.SUPPRESS)
    ap.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernel-cache", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", action="append", choices=["large", "small", "bucket", "rss"])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/silod-bench"))
    ap.add_argument("--json", type=Path, default=REPO / "out" / "bench_fuse.json")
    ap.add_argument("--large-mb", type=int, default=512, help="size of each large file (MiB)")
    ap.add_argument("--large-count", type=int, default=4)
    ap.add_argument("--small-count", type=int, default=4000)
    ap.add_argument("--bucket-seconds", type=float, default=10.0)
    ap.add_argument("--rates", default="1e6,10e6,100e6,500e6")
    ap.add_argument("--rss-gb", type=float, default=10.0)
    args = ap.parse_args()
    if args.serve_passthrough:
        serve_passthrough(*args.serve_passthrough, naive=args.naive, kernel_cache=args.kernel_cache)
        return
    which = args.only or ["large", "small", "bucket", "rss"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"host": {"cpus": os.cpu_count()}}
    if "large" in which:
        results["large"] = r = bench_large(args.workdir, args.large_mb, args.large_count)
        print(f"large cached reads ({r['dataset']}), GB/s, 1 thread / 4 threads:")
        print(f"  silod (kernel cache, default)    {r['silod_GBps_1_thread']:.2f} / {r['silod_GBps_4_threads']:.2f}"
              f"   first pass after mount {r['silod_first_pass_GBps']:.2f}")
        print(f"  passthrough, kernel_cache         {r['passthrough_kc_GBps_1_thread']:.2f} / {r['passthrough_kc_GBps_4_threads']:.2f}"
              f"   first pass after mount {r['passthrough_kc_first_pass_GBps']:.2f}")
        print(f"  silod --no-kernel-cache           {r['silod_no_kernel_cache_GBps_1_thread']:.2f} / {r['silod_no_kernel_cache_GBps_4_threads']:.2f}")
        print(f"  passthrough, read_buf(fd)         {r['passthrough_GBps_1_thread']:.2f} / {r['passthrough_GBps_4_threads']:.2f}")
        print(f"  passthrough, naive read()         {r['naive_passthrough_GBps_1_thread']:.2f}")
        print(f"  cache dir directly                {r['direct_GBps_1_thread']:.2f} / {r['direct_GBps_4_threads']:.2f}")
        print(f"  ratios: steady/passthrough_kc {r['ratio_steady_to_passthrough_kc_1_thread']:.2f} / {r['ratio_steady_to_passthrough_kc_4_threads']:.2f}, "
              f"first pass {r['ratio_first_pass_to_passthrough_kc_first_pass']:.2f}, data path/passthrough {r['ratio_data_path_to_passthrough_1_thread']:.2f} / "
              f"{r['ratio_data_path_to_passthrough_4_threads']:.2f}, data path/naive {r['ratio_data_path_to_naive_passthrough']:.2f}, "
              f"steady/direct {r['ratio_steady_to_direct_1_thread']:.2f}, data path/direct {r['ratio_data_path_to_direct_1_thread']:.2f}", flush=True)
    if "small" in which:
        results["small"] = r = bench_small(args.workdir, args.small_count)
        print(f"small cached files (110 KB, 8 threads): silod {r['silod_files_per_s']:.0f} files/s; passthrough "
              f"{r['passthrough_files_per_s']:.0f}; direct {r['direct_files_per_s']:.0f}; ratio to passthrough "
              f"{r['ratio_to_passthrough']:.2f}, to direct {r['ratio_to_direct']:.2f}", flush=True)
    if "bucket" in which:
        rates = [float(x) for x in args.rates.split(",")]
        results["bucket"] = r = bench_bucket(args.workdir, rates, args.bucket_seconds)
        for run in r["runs"]:
            print(f"token bucket {run['rate_Bps'] / 1e6:g} MB/s: achieved {run['achieved_Bps'] / 1e6:.3f} MB/s "
                  f"over {run['window_s']:.1f} s, ratio {run['ratio']:.4f}", flush=True)
    if "rss" in which:
        results["rss"] = r = bench_rss(args.workdir, args.rss_gb, 256)
        print(f"RSS serving {r['dataset_GB']:.1f} GB ({r['served_GB']:.1f} GB read at {r['read_GBps']:.2f} GB/s): "
              f"peak {r['peak_rss_MB']:.0f} MB, idle {r['idle_rss_MB']:.0f} MB, ratio {r['ratio_peak_to_idle']:.2f}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
