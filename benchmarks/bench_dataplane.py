"""Data plane at scale (issue 12): every figure is printed with a reference measured in the same run.

    python benchmarks/bench_dataplane.py                       # all sections (~10 min on 2 cores)
    python benchmarks/bench_dataplane.py --only miss --sizes 20000,200000,1280000
    python benchmarks/bench_dataplane.py --only hits --only dead --only remount --only stall

1. miss     epoch-1 miss path at N items (default 20k, 200k, 1.28M; items scaled down to 2 KB so
            1.28M fit on a laptop disk). The cache index is seeded with 40% of the items
            (allocation 50%), as it is late in epoch 1, then a data loader (16 threads) reads a
            random sample of *uncached* items through the mount. Printed: files/s, CPU ms per
            miss of the mount process, flatness (files/s at N vs the smallest N), and the ratio
            to reading the same items straight from the source directory (the remote's own rate).
2. remote   the same miss path against a latency-bound remote: a local HTTP server (own process)
            that answers each GET after 50 ms (an object store's first byte), 16 readers.
            Reference: the same GETs with 16 threads straight from the server. Also printed: the
            mount's CPU per miss, because on a 2-core machine the mount, the server and the
            readers share the CPU, the listing time and the mount's memory. The server's
            directory indexes are nginx's JSON autoindex (--remote-index json, so 1.28M items list
            in one GET per directory) or an HTML page (html: a HEAD per item).
3. hits     cached 110 KB files with 8 reader *processes* through the mount vs the cache directory
            directly; large cached files (1 reader) through the mount vs directly. Each for every
            front end in --backends (default raw,raw-nokeep,libfuse: the raw /dev/fuse server with
            passthrough, the same without kept backing files, libfuse), with the mount's CPU per
            file and the READ requests that still reached the daemon.
4. dead     the remote dies: time for an open to fail (vs --open-deadline), opens until the breaker
            opens, time until reads succeed again after the remote is back (vs --probe-interval);
            for a remote that refuses connections and one that accepts but never answers.
5. remount  a 100k-item cache: first read after a clean remount and after a kill -9, vs the
            time the same mount takes to list the source (the part no cache can save).
6. stall    hit latency while 64 misses stall on a paused remote (--io-rate 1B/s), vs the hit latency
            on an idle mount.
7. stall-remote  4x --fuse-threads (32) opens of uncached items against an HTTP remote that accepts
            and never answers: cached-read p50/p99 while they wait vs the same mount idle just before,
            and the time for the waiting readers, killed with -9, to be gone; per front end.

Results are written as JSON (--json).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import sqlite3
import statistics
import sys
import threading
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

sys.path.insert(0, str(REPO / "tests"))

from bench_fuse import MiB, Proc, make_files, silod, silod_mount  # noqa: E402
from json_index_server import json_index_handler  # noqa: E402

# -- helpers -----------------------------------------------------------------------------------


def make_many(root: Path, count: int, size: int) -> list[str]:
    """`count` files of `size` bytes in directories of 1000 (kept between runs: creation is slow)."""
    marker = root / f".complete-{count}-{size}"
    rels = [f"d{i // 1000:04d}/f{i:07d}.bin" for i in range(count)]
    if marker.exists():
        return rels
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = random.Random(count)
    block = rng.randbytes(size + 4096)
    for i, rel in enumerate(rels):
        if i % 1000 == 0:
            (root / rel).parent.mkdir()
        fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        off = i % 4096
        os.write(fd, block[off:off + size])
        os.close(fd)
    marker.touch()
    return rels


def seed_cache(cache_dir: Path, dataset: str, src: Path, rels: list[str], allocation: int) -> None:
    """Put `rels` into the cache as a finished admission would: file, index row, counters.

    Bulk (hard links + one transaction) because admitting 512k items one by one would take
    minutes of setup; the measured misses then go through the real admission path.
    """
    from fuse_client.cache_store import DatasetCache, item_key

    cache = DatasetCache(cache_dir, dataset)
    rows = []
    for rel in rels:
        key = item_key(rel)
        data = (src / rel).read_bytes()
        os.link(src / rel, cache.item_path(key))
        rows.append((key, len(data), zlib.crc32(data)))
    db = sqlite3.connect(cache.root / "index.sqlite", isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    db.executemany("INSERT INTO items VALUES (?, ?, ?)", rows)
    db.execute("INSERT OR REPLACE INTO meta VALUES ('cached_bytes', (SELECT SUM(size) FROM items))")
    db.execute("INSERT OR REPLACE INTO meta VALUES ('items_cached', (SELECT COUNT(*) FROM items))")
    db.execute("INSERT OR REPLACE INTO meta VALUES ('allocation_bytes', ?)", (allocation,))
    db.execute("INSERT OR REPLACE INTO meta VALUES ('clean', 1)")
    db.execute("COMMIT")
    db.close()
    cache.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_all(root: Path, rels: list[str], threads: int) -> float:
    """files/s reading each file once with `threads` threads."""

    def work(rel: str) -> int:
        with open(root / rel, "rb", buffering=0) as f:
            return len(f.read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(work, rels, chunksize=16):
            pass
    return len(rels) / (time.perf_counter() - t0)


def _read_share(args: tuple[str, list[str]]) -> int:
    root, rels = args
    n = 0
    for rel in rels:
        with open(os.path.join(root, rel), "rb", buffering=0) as f:
            n += len(f.read())
    return n


def read_all_procs(root: Path, rels: list[str], procs: int, passes: int = 3) -> float:
    """Best files/s of `passes`, each reading every file once with `procs` processes."""
    best = 0.0
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        for _ in range(passes):
            order = rels[:]
            random.shuffle(order)
            shares = [(str(root), order[i::procs]) for i in range(procs)]
            t0 = time.perf_counter()
            pool.map(_read_share, shares)
            best = max(best, len(rels) / (time.perf_counter() - t0))
    return best


def mount(src: str, mnt: Path, cache: Path, dataset: str, *extra: str, timeout: float = 600) -> tuple[Proc, Path]:
    stats = mnt.parent / f"{mnt.name}.stats.json"
    stats.unlink(missing_ok=True)
    proc = Proc([*silod(), "mount", str(mnt), "--source", src, "--dataset", dataset, "--job", "bench",
                 "--cache-dir", str(cache), "--stats-file", str(stats), *extra], mnt, ready=stats.exists, timeout=timeout)
    return proc, stats


# -- 1. miss path at scale ---------------------------------------------------------------------


def bench_miss(work: Path, sizes: list[int], item_size: int, sample: int, threads: int = 16,
               backend: str = "auto") -> dict:
    runs = []
    for n in sizes:
        src = work / f"miss-src-{n}"
        t0 = time.perf_counter()
        rels = make_many(src, n, item_size)
        created_s = time.perf_counter() - t0
        cache = work / f"miss-cache-{n}"
        shutil.rmtree(cache, ignore_errors=True)
        rng = random.Random(1)
        order = rels[:]
        rng.shuffle(order)
        seeded = order[: int(0.4 * n)]
        misses = order[int(0.4 * n):][:sample]
        seed_cache(cache, "miss", src, seeded, allocation=int(0.5 * n) * item_size)
        t0 = time.perf_counter()
        proc, stats = mount(str(src), work / "mnt-miss", cache, "miss", "--fuse-backend", backend)
        mount_s = time.perf_counter() - t0
        try:
            cpu0 = cpu_seconds(proc.p.pid)
            fps = read_all(proc.mnt, misses, threads)
            cpu = cpu_seconds(proc.p.pid) - cpu0
            time.sleep(0.6)
            st = json.loads(stats.read_text())
        finally:
            proc.stop()
        direct = read_all(src, misses, threads)
        run = {"items": n, "item_size": item_size, "index_rows_at_start": len(seeded), "sample": len(misses),
               "files_per_s": fps, "cpu_ms_per_miss": 1000 * cpu / len(misses), "direct_source_files_per_s": direct,
               "ratio_to_source": fps / direct, "misses_counted": st["misses"], "remote_bytes": st["remote_bytes"],
               "mount_s": mount_s, "dataset_created_s": created_s}
        runs.append(run)
        print(f"  [{backend}] miss path, {n:>8} items ({len(seeded)} cached): {fps:7.0f} files/s through the mount, "
              f"{run['cpu_ms_per_miss']:.2f} CPU ms/miss, source directly {direct:7.0f} files/s, ratio {fps / direct:.3f}"
              f"  (mount+list {mount_s:.1f} s)", flush=True)
    base = runs[0]["files_per_s"]
    for run in runs:
        run["ratio_to_smallest"] = run["files_per_s"] / base
    worst = min(r["ratio_to_smallest"] for r in runs)
    print(f"  flatness: slowest/smallest = {worst:.2f} (target >= 0.5: flat within 2x)", flush=True)
    return {"runs": runs, "flatness_worst_ratio": worst, "target": "files/s flat within 2x from 20k to 1.28M items"}


# -- 2. a latency-bound remote -----------------------------------------------------------------


class _SlowHandler(http.server.SimpleHTTPRequestHandler):
    latency_s = 0.02
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as object stores and web servers set it (nginx's default): without it the
    # response's second write (the body after the headers) waits for the client's delayed ACK,
    # which costs an aiohttp client (fsspec, i.e. the mount) ~40 ms per GET and urllib nothing.
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if not self.path.endswith("/"):
            time.sleep(self.latency_s)
        super().do_GET()


def serve_http(root: Path, port: int = 0, latency_s: float = 0.02, index: str = "json") -> http.server.ThreadingHTTPServer:
    # index "json": directory indexes as nginx's `autoindex_format json` (names and sizes, one
    # GET per directory); "html": Python's HTML index, which costs the mount a HEAD per item.
    handler = json_index_handler(_SlowHandler) if index == "json" else _SlowHandler
    handler = type("H", (handler,), {"latency_s": latency_s})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class HttpServerProcess:
    """The remote in its own process, so that it does not share a GIL with the readers."""

    def __init__(self, root: Path, latency_s: float, port: int = 0, index: str = "json", command=None) -> None:
        """`command(port)`: another server's command line (benchmarks/bench_cold_vs_rclone.py's)."""
        import subprocess

        port = port or _free_port()
        self.port = port
        self.url = f"http://127.0.0.1:{port}/"
        argv = command(port) if command is not None else [sys.executable, __file__, "--serve-http", str(root), str(port),
                                                          str(latency_s), index]
        self.p = subprocess.Popen(argv)
        deadline = time.time() + 20
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1).read()
                return
            except OSError:
                if time.time() > deadline or self.p.poll() is not None:
                    raise RuntimeError("HTTP server did not start")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_remote(work: Path, n: int, item_size: int, threads: int = 16, latency_s: float = 0.05, index: str = "json",
                 sample_size: int = 1500) -> dict:
    # The miss section's datasets are reused when they match (1.28M files take minutes to create).
    src = work / f"miss-src-{n}"
    if not (src / f".complete-{n}-{item_size}").exists():
        src = work / (f"remote-src-{n}" if item_size == 20_000 else f"remote-src-{n}-{item_size}")
    rels = make_many(src, n, item_size)
    server = HttpServerProcess(src, latency_s, index=index)
    url = server.url
    try:
        sample = rels[:]
        random.Random(2).shuffle(sample)
        sample = sample[: min(len(sample), sample_size)]

        def get(rel: str) -> int:
            with urllib.request.urlopen(url + rel) as r:
                return len(r.read())

        def direct_rate(items: list[str]) -> float:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(get, items))
            return len(items) / (time.perf_counter() - t0)

        # The reference is measured before and after the mount's run (other items, same server)
        # and averaged, because the load of a shared machine drifts during the run.
        measured = set(sample)
        others = [r for r in rels if r not in measured][: len(sample) // 2]
        direct_before = direct_rate(others)
        cache = work / "remote-cache"
        shutil.rmtree(cache, ignore_errors=True)
        t0 = time.perf_counter()
        proc, stats = mount(url, work / "mnt-remote", cache, "remote", "--cache-size", str(n * item_size // 2))
        mount_s = time.perf_counter() - t0  # mostly listing the source
        try:
            cpu0 = cpu_seconds(proc.p.pid)
            fps = read_all(proc.mnt, sample, threads)
            cpu_ms = 1000 * (cpu_seconds(proc.p.pid) - cpu0) / len(sample)
            rss_mb = proc.rss_mb()
        finally:
            proc.stop()
        direct_after = direct_rate(others)
        direct = (direct_before + direct_after) / 2
    finally:
        server.stop()
    r = {"items": n, "sample": len(sample), "latency_ms": latency_s * 1000, "threads": threads,
         "files_per_s": fps, "remote_direct_files_per_s": direct, "remote_direct_before": direct_before,
         "remote_direct_after": direct_after, "ratio": fps / direct, "cpu_ms_per_miss": cpu_ms, "index": index,
         "mount_s": mount_s, "mount_rss_mb": rss_mb, "item_size": item_size, "target": ">= 0.8x the remote's own rate"}
    print(f"  latency-bound HTTP remote, {n} items of {item_size} B ({latency_s * 1000:.0f} ms/GET, {threads} readers, {index} "
          f"directory indexes): mount ready in {mount_s:.1f} s (listing), {rss_mb:.0f} MB RSS; misses {fps:.0f} files/s, "
          f"remote directly {direct:.0f} files/s (before {direct_before:.0f}, after {direct_after:.0f}), ratio {fps / direct:.2f} "
          f"(target >= 0.8), {cpu_ms:.2f} CPU ms/miss", flush=True)
    return r


# -- 3. hits -----------------------------------------------------------------------------------


def bench_hits(work: Path, count: int, procs: int, large_mb: int, large_count: int, backends: list[str]) -> dict:
    """Each backend (--backends) in its own mount of the same cache, side by side; the reference
    is the cache directory read directly, in passes alternating with the mount's."""
    src, cache = work / "hits-src", work / "hits-cache"
    shutil.rmtree(cache, ignore_errors=True)
    rels = make_files(src, count, 110 * 1000)
    items = cache / "hits" / "items"
    small: dict = {"files": count, "file_size": 110_000, "reader_processes": procs,
                   "target": ">= 17k files/s and >= 0.25x direct", "load_avg_before": os.getloadavg()}
    for backend in backends:
        proc, stats = silod_mount(src, work / "mnt-hits", cache, "hits", *_frontend_args(backend),
                                  env=_FRONTEND_ENV.get(backend))
        try:
            read_all(proc.mnt, rels, 8)  # epoch 1 fills the cache (epoch 2+ of the first backend)
            item_rels = [str(p.relative_to(items)) for p in items.glob("*/*")]
            # Mount and direct passes alternate, best of three each: the load drifts meanwhile.
            mount_runs, direct_runs, cpu_us = [], [], []
            for _ in range(3):
                cpu0 = cpu_seconds(proc.p.pid)
                mount_runs.append(read_all_procs(proc.mnt, rels, procs, passes=1))
                cpu_us.append(1e6 * (cpu_seconds(proc.p.pid) - cpu0) / len(rels))
                direct_runs.append(read_all_procs(items, item_rels, procs, passes=1))
            time.sleep(0.6)
            st = json.loads(stats.read_text())
        finally:
            proc.stop()
        label = _backend_label(st) + (" (no kept backing files)" if backend == "raw-nokeep" else "")
        small[backend] = r = {"backend": label, "mount_files_per_s": max(mount_runs),
                              "direct_files_per_s": max(direct_runs), "mount_runs": mount_runs, "direct_runs": direct_runs,
                              "mount_cpu_us_per_file": min(cpu_us), "kept_opens": st.get("fuse_kept_opens"),
                              "read_requests": st.get("read_requests"), "passthrough_opens": st.get("passthrough_opens")}
        r["ratio"] = r["mount_files_per_s"] / r["direct_files_per_s"]
        print(f"  cached 110 KB files, {procs} reader processes, {r['backend']}: mount {r['mount_files_per_s']:.0f} files/s, "
              f"cache dir directly {r['direct_files_per_s']:.0f} files/s (best of 3 alternating passes each), ratio {r['ratio']:.2f} "
              f"(target >= 17000 and >= 0.25); mount CPU {r['mount_cpu_us_per_file']:.0f} us per file; "
              f"READ requests that reached the daemon: {r['read_requests']}", flush=True)
    small["load_avg_after"] = os.getloadavg()
    print(f"  load average (1 min) before/after: {small['load_avg_before'][0]:.2f} / {small['load_avg_after'][0]:.2f}", flush=True)

    lsrc, lcache = work / "large-src", work / "large-cache2"
    shutil.rmtree(lcache, ignore_errors=True)
    lrels = make_files(lsrc, large_count, large_mb * MiB)
    litems = lcache / "large" / "items"
    big = lambda root, rs: sum(_read_share((str(root), [r])) for r in rs)  # noqa: E731

    def direct_gbps() -> float:
        l_item_rels = [str(p.relative_to(litems)) for p in litems.glob("*/*")]
        t0 = time.perf_counter()
        nbytes = big(litems, l_item_rels)
        return nbytes / (time.perf_counter() - t0) / 1e9

    large: dict = {"files": large_count, "file_MiB": large_mb, "target": ">= 0.9x direct"}
    for backend in [b for b in backends if b != "raw-nokeep"]:
        proc, stats = silod_mount(lsrc, work / "mnt-large", lcache, "large", *_frontend_args(backend))
        try:
            big(proc.mnt, lrels)  # epoch 1 (or a re-read)
            # Mount and direct passes alternate, best of three each: the load drifts meanwhile.
            mount_runs, direct_runs = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                nbytes = big(proc.mnt, lrels)
                mount_runs.append(nbytes / (time.perf_counter() - t0) / 1e9)
                direct_runs.append(direct_gbps())
            time.sleep(0.6)
            st = json.loads(stats.read_text())
        finally:
            proc.stop()
        large[backend] = r = {"backend": _backend_label(st), "mount_GBps": max(mount_runs), "direct_GBps": max(direct_runs),
                              "mount_runs": mount_runs, "direct_runs": direct_runs}
        r["ratio"] = r["mount_GBps"] / r["direct_GBps"]
        print(f"  cached {large_mb} MiB files, 1 reader, {r['backend']}: mount {r['mount_GBps']:.2f} GB/s, directly "
              f"{r['direct_GBps']:.2f} GB/s (best of 3 alternating passes each), ratio {r['ratio']:.2f} (target >= 0.9)", flush=True)
    return {"small": small, "large": large}


# Front-end variants the hits section compares (--backends): raw-nokeep is the raw server without
# kept backing files (every open registers one: what keeping them saves); raw-nopassthrough is
# the raw server as on kernels without passthrough (reads reach it; page cache kept for hits).
_FRONTEND_ENV = {"raw-nokeep": {"SILOD_RAW_KEEP_BACKING": "0"}}


def _frontend_args(backend: str) -> list[str]:
    if backend == "raw-nopassthrough":
        return ["--fuse-backend", "raw", "--no-passthrough"]
    return ["--fuse-backend", backend.split("-")[0]]


def _backend_label(stats: dict) -> str:
    if stats.get("fuse_backend") == "raw":
        return "raw+passthrough" if stats.get("passthrough") else "raw"
    return "libfuse"


# -- 4. dead remote ----------------------------------------------------------------------------


def _blackhole(port: int) -> socket.socket:
    """Accepts connections on `port` and never answers (a remote that hangs)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(1024)
    conns = []

    def accept() -> None:
        while True:
            try:
                conns.append(s.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return s


def bench_dead(work: Path, deadline: float, threshold: int, probe: float) -> dict:
    src = work / "dead-src"
    rels = make_many(src, 400, 20_000)
    out = {"open_deadline_s": deadline, "breaker_threshold": threshold, "probe_interval_s": probe}
    for mode in ("refused", "hang"):
        server = HttpServerProcess(src, 0.0)
        port, url = server.port, server.url
        cache = work / "dead-cache"
        shutil.rmtree(cache, ignore_errors=True)
        proc, stats = mount(url, work / "mnt-dead", cache, "dead", "--open-deadline", str(deadline),
                            "--breaker-threshold", str(threshold), "--probe-interval", str(probe))
        hole = None
        try:
            for rel in rels[:20]:
                (proc.mnt / rel).read_bytes()
            server.stop()
            if mode == "hang":
                hole = _blackhole(port)
            failures, durations, i = 0, [], 20
            while True:
                t0 = time.perf_counter()
                try:
                    (proc.mnt / rels[i]).read_bytes()
                    raise RuntimeError("a read succeeded with the remote down")
                except OSError:
                    pass
                dt = time.perf_counter() - t0
                i += 1
                if dt < 0.05:  # failed at once: the breaker is open
                    break
                failures += 1
                durations.append(dt)
                if failures > 50:
                    raise RuntimeError("the breaker never opened")
            t0 = time.perf_counter()
            for rel in rels[:20]:
                (proc.mnt / rel).read_bytes()  # cached items while the remote is down
            cached_fps = 20 / (time.perf_counter() - t0)
            if hole is not None:
                hole.close()
            server = HttpServerProcess(src, 0.0, port=port)
            back = time.perf_counter()
            while True:
                try:
                    (proc.mnt / rels[i]).read_bytes()
                    break
                except OSError:
                    i += 1
                    time.sleep(0.02)
                if time.perf_counter() - back > 30:
                    raise RuntimeError("no recovery within 30 s")
            recovery = time.perf_counter() - back
        finally:
            proc.stop()
            server.stop()
        out[mode] = r = {"failed_opens_until_breaker_open": failures, "max_failed_open_s": max(durations),
                         "mean_failed_open_s": statistics.mean(durations), "ratio_max_open_to_deadline": max(durations) / deadline,
                         "cached_reads_while_down_per_s": cached_fps, "recovery_s": recovery,
                         "ratio_recovery_to_probe_interval": recovery / probe}
        print(f"  dead remote ({mode}): opens fail in <= {r['max_failed_open_s']:.2f} s (deadline {deadline:g} s, ratio "
              f"{r['ratio_max_open_to_deadline']:.2f}), breaker open after {failures} failures (threshold {threshold}), "
              f"cached items served at {cached_fps:.0f}/s meanwhile, reads again {recovery:.2f} s after the remote is back "
              f"(probe interval {probe:g} s, ratio {r['ratio_recovery_to_probe_interval']:.2f})", flush=True)
    out["target"] = "open fails within the deadline (<= 5 s); breaker open in <= 10 failures; recovery within one probe interval"
    return out


# -- 5. remount --------------------------------------------------------------------------------


def bench_remount(work: Path, n: int) -> dict:
    src = work / f"remount-src-{n}"
    rels = make_many(src, n, 1000)
    cache = work / "remount-cache"
    shutil.rmtree(cache, ignore_errors=True)
    seed_cache(cache, "rm", src, rels, allocation=2**62)
    out: dict = {"items": n}
    for label in ("clean", "clean_again", "after_kill9"):
        t0 = time.perf_counter()
        proc, stats = mount(str(src), work / "mnt-rm", cache, "rm")
        mounted = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            (proc.mnt / rels[n // 2]).read_bytes()
            first = time.perf_counter() - t1
            time.sleep(0.6)
            st = json.loads(stats.read_text())
            assert st["remote_bytes"] == 0, "remount refetched"
        finally:
            if label == "clean_again":
                proc.p.send_signal(signal.SIGKILL)
                proc.p.wait()
            proc.stop()
        out[label] = {"mount_ready_s": mounted, "first_read_after_ready_s": first, "recovery_s": st["recovery_seconds"],
                      "recovery_clean": st["recovery_clean"], "verify_pending": st["cache_verify_pending"]}
    # Reference: listing the source, which every mount pays whatever the cache does.
    from fuse_client.remote import RemoteStore

    t0 = time.perf_counter()
    RemoteStore(str(src)).list()
    out["listing_s"] = time.perf_counter() - t0
    out["target"] = "clean remount of a 100k-item cache: first read in < 1 s"
    # "clean" is the first mount of the seeded cache (no listing snapshot yet: it lists the
    # source); "clean_again" is the remount a job sees after a clean unmount (snapshot saved).
    labels = {"clean": "clean, first mount: lists the source", "clean_again": "clean remount",
              "after_kill9": "remount after kill -9"}
    for label, text in labels.items():
        r = out[label]
        r["first_read_end_to_end_s"] = r["mount_ready_s"] + r["first_read_after_ready_s"]
        print(f"  {text}, {n} cached items: index ready in {r['recovery_s'] * 1000:.1f} ms (clean={r['recovery_clean']}), "
              f"mount ready {r['mount_ready_s']:.2f} s after `silod mount` started (listing the source alone: {out['listing_s']:.2f} s), "
              f"first read {r['first_read_after_ready_s'] * 1000:.1f} ms after that: {r['first_read_end_to_end_s']:.2f} s end to end "
              f"(target < 1 s)", flush=True)
    return out


# -- 6. hits while misses stall ----------------------------------------------------------------


def bench_stall(work: Path, stalled: int = 64) -> dict:
    src = work / "stall-src"
    rels = make_many(src, 400, 20_000)
    cache = work / "stall-cache"
    shutil.rmtree(cache, ignore_errors=True)
    proc, _ = mount(str(src), work / "mnt-stall", cache, "stall")
    try:
        for rel in rels[:50]:
            (proc.mnt / rel).read_bytes()
    finally:
        proc.stop()

    def hit_latencies(mnt: Path) -> list[float]:
        out = []
        for rel in rels[:50]:
            t0 = time.perf_counter()
            with open(mnt / rel, "rb", buffering=0) as f:
                f.read()
            out.append(time.perf_counter() - t0)
        return out

    proc, _ = mount(str(src), work / "mnt-stall", cache, "stall", "--no-kernel-cache")
    try:
        idle = hit_latencies(proc.mnt)
    finally:
        proc.stop()
    proc, _ = mount(str(src), work / "mnt-stall", cache, "stall", "--io-rate", "1B/s", "--no-kernel-cache")
    try:
        for rel in rels[100:100 + stalled]:
            threading.Thread(target=lambda p=proc.mnt / rel: _quiet_read(p), daemon=True).start()
        time.sleep(1.0)
        busy = hit_latencies(proc.mnt)
    finally:
        proc.stop()
    r = {"stalled_misses": stalled, "idle_hit_p50_ms": 1000 * statistics.median(idle), "idle_hit_max_ms": 1000 * max(idle),
         "stalled_hit_p50_ms": 1000 * statistics.median(busy), "stalled_hit_max_ms": 1000 * max(busy)}
    r["ratio_p50"] = r["stalled_hit_p50_ms"] / r["idle_hit_p50_ms"]
    print(f"  hits while {stalled} misses stall: p50 {r['stalled_hit_p50_ms']:.2f} ms, max {r['stalled_hit_max_ms']:.2f} ms; "
          f"idle mount p50 {r['idle_hit_p50_ms']:.2f} ms, max {r['idle_hit_max_ms']:.2f} ms; ratio p50 {r['ratio_p50']:.2f}", flush=True)
    return r


def _stalling_http(names: list[str], size: int):
    """A JSON-index HTTP source on 127.0.0.1 whose item GETs, once `stall` is set, are accepted and
    never answered (until `release`). Returns (server, url, stall, release)."""
    stall, release = threading.Event(), threading.Event()
    index = json.dumps([{"name": n, "type": "file", "size": size} for n in names]).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/ds/":
                body = index
            else:
                if stall.is_set():
                    release.wait(300)
                    return
                body = self.path.encode().ljust(size, b".")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/ds/", stall, release


def bench_stall_remote(work: Path, backends: list[str], threads: int = 32, cached: int = 50, reads: int = 400) -> dict:
    """Issue 19: 4x --fuse-threads opens of uncached items against a remote that accepts and never
    answers. Printed per front end: cached-read latency (p50, p99) while they wait, against the same
    mount idle just before (same run); and how long readers killed with -9 take to be gone."""
    import subprocess

    stalled = 4 * threads
    names = [f"c{i:04d}" for i in range(cached)] + [f"s{i:04d}" for i in range(stalled)]
    out: dict = {}
    for backend in backends:
        server, url, stall, release = _stalling_http(names, 20_000)
        cache = work / f"stallr-cache-{backend}"
        shutil.rmtree(cache, ignore_errors=True)
        proc, _ = mount(url, work / "mnt-stallr", cache, "stallr", "--no-kernel-cache", "--fuse-threads", str(threads),
                        "--open-deadline", "120", "--breaker-threshold", "10000", *_frontend_args(backend))
        readers: list = []
        try:
            for n in names[:cached]:
                (proc.mnt / n).read_bytes()

            def latencies() -> list[float]:
                lat = []
                for i in range(reads):
                    t0 = time.perf_counter()
                    with open(proc.mnt / names[i % cached], "rb", buffering=0) as f:
                        f.read()
                    lat.append(time.perf_counter() - t0)
                return sorted(lat)

            idle = latencies()
            stall.set()
            readers = [subprocess.Popen(["cat", str(proc.mnt / n)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                       for n in names[cached:]]
            time.sleep(2.0)
            waiting = [r for r in readers if r.poll() is None]
            busy = latencies()
            t0 = time.perf_counter()
            for r in waiting:
                r.kill()
            for r in waiting:
                try:
                    r.wait(timeout=max(0.1, 30 - (time.perf_counter() - t0)))
                except subprocess.TimeoutExpired:
                    pass
            exit_s = time.perf_counter() - t0
            still = sum(r.poll() is None for r in waiting)
        finally:
            for r in readers:
                if r.poll() is None:
                    r.kill()
            release.set()
            proc.stop()
            server.shutdown()
        q = lambda xs, f: 1000 * xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
        r = {"fuse_threads": threads, "stalled_opens": stalled, "waiting_opens": len(waiting),
             "refused_opens": stalled - len(waiting), "idle_p50_ms": q(idle, 0.5), "idle_p99_ms": q(idle, 0.99),
             "stalled_p50_ms": q(busy, 0.5), "stalled_p99_ms": q(busy, 0.99), "killed_exit_s": exit_s,
             "killed_still_there": still}
        r["ratio_p99"] = r["stalled_p99_ms"] / r["idle_p99_ms"]
        out[backend] = r
        print(f"  {backend}: {stalled} opens on a remote that never answers ({len(waiting)} waiting, "
              f"{r['refused_opens']} refused): cached read p50 {r['stalled_p50_ms']:.2f} ms, p99 {r['stalled_p99_ms']:.2f} ms "
              f"vs idle p50 {r['idle_p50_ms']:.2f} ms, p99 {r['idle_p99_ms']:.2f} ms (ratio p99 {r['ratio_p99']:.2f}); "
              f"{len(waiting)} killed readers gone in {exit_s:.2f} s ({still} left)", flush=True)
    return out


def _quiet_read(path: Path) -> None:
    try:
        path.read_bytes()
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-http", nargs=4, metavar=("ROOT", "PORT", "LATENCY", "INDEX"), help=argparse.SUPPRESS)
    ap.add_argument("--only", action="append", choices=["miss", "remote", "hits", "dead", "remount", "stall", "stall-remote"])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/silod-bench"))
    ap.add_argument("--json", type=Path, default=REPO / "out" / "bench_dataplane.json")
    ap.add_argument("--sizes", default="20000,200000,1280000", help="dataset sizes (items) for the miss path")
    ap.add_argument("--item-size", type=int, default=2048, help="bytes per item in the miss-path datasets")
    ap.add_argument("--sample", type=int, default=3000, help="misses measured per dataset size")
    ap.add_argument("--remote-items", type=int, default=4000)
    ap.add_argument("--remote-index", choices=["json", "html"], default="json",
                    help="directory indexes of the remote: nginx's JSON autoindex (sizes included) or an HTML page (a HEAD per item)")
    ap.add_argument("--remote-sample", type=int, default=1500, help="uncached items read through the mount")
    ap.add_argument("--remote-item-size", type=int, default=20_000,
                    help="bytes per item of the HTTP remote (2048 with 1280000 items reuses the miss section's dataset)")
    ap.add_argument("--small-count", type=int, default=4000)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--backends", default="raw,raw-nokeep,libfuse",
                    help="FUSE front ends to compare (silod mount --fuse-backend; raw-nokeep: raw without kept backing "
                         "files; raw-nopassthrough: raw as on kernels without passthrough)")
    ap.add_argument("--large-mb", type=int, default=256)
    ap.add_argument("--large-count", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=5.0)
    ap.add_argument("--threshold", type=int, default=5)
    ap.add_argument("--probe", type=float, default=1.0)
    ap.add_argument("--remount-items", type=int, default=100_000)
    args = ap.parse_args()
    if args.serve_http:
        root, port, latency, index = args.serve_http
        serve_http(Path(root), int(port), float(latency), index)
        threading.Event().wait()
    which = args.only or ["miss", "remote", "hits", "dead", "remount", "stall", "stall-remote"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"host": {"cpus": os.cpu_count(), "kernel": os.uname().release}}
    if "miss" in which:
        print("epoch-1 miss path:", flush=True)
        results["miss"] = {b: bench_miss(args.workdir, [int(x) for x in args.sizes.split(",")], args.item_size, args.sample,
                                         backend=b) for b in args.backends.split(",") if b in ("raw", "libfuse")}
    if "remote" in which:
        results["remote"] = bench_remote(args.workdir, args.remote_items, args.remote_item_size, index=args.remote_index,
                                         sample_size=args.remote_sample)
    if "hits" in which:
        results["hits"] = bench_hits(args.workdir, args.small_count, args.procs, args.large_mb, args.large_count,
                                     args.backends.split(","))
    if "dead" in which:
        results["dead"] = bench_dead(args.workdir, args.deadline, args.threshold, args.probe)
    if "remount" in which:
        results["remount"] = bench_remount(args.workdir, args.remount_items)
    if "stall" in which:
        results["stall"] = bench_stall(args.workdir)
    if "stall-remote" in which:
        print("stalled remote, 4x --fuse-threads opens:", flush=True)
        results["stall_remote"] = bench_stall_remote(args.workdir, [b for b in args.backends.split(",") if b != "raw-nokeep"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
