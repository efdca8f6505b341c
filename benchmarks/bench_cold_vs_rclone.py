"""Cold and warm epochs through silod and through rclone, side by side, on the same HTTP source.

    python benchmarks/bench_cold_vs_rclone.py                   # 2,000 x 110 KB and 4 x 64 MiB
    python benchmarks/bench_cold_vs_rclone.py --small 5000 --large 8 --large-mb 256
    python benchmarks/bench_cold_vs_rclone.py --small 20000 --large 1 --large-mb 1 --runs 2

Each tool's cache is a fresh ext4 with a journal on a loop device, made and removed around every
run and identical for both tools, as a node's cache disk (`--cache-fs root` keeps it under the
temporary directory instead). Runs alternate A-B-B-A (`--runs N` per tool, silod first); printed are
every run, the medians, and the ratio within each adjacent silod/rclone pair.

The source is one local HTTP server process (Python's, with byte ranges, as nginx serves them)
over one directory: rclone's http backend reads its HTML index pages, silod the same directories
as nginx's JSON index (the same server code, a second port). For each tool and each set (small
files, large files) the mount starts on an empty cache, `--readers` threads read every file once
(cold: every read is a miss) and then again (warm: cache hits), with rclone as
`rclone mount :http: --vfs-cache-mode full --read-only`. Printed: files/s and MB/s, the mount
process's CPU per file in the cold pass, and the ratios silod / rclone and silod / direct (the
source directory read straight from disk). rclone comes from Debian (`apt-get install rclone`);
without it the rclone rows are skipped with a message.

Why a fresh file system: on an ext4 without a journal (this VM's root) creating a file skips every
inode of its group deleted in the last 60-360 s (`recently_deleted()` in fs/ext4/ialloc.c, checked
only when the file system has no journal), so a run right after another deleted 20k files pays up to
3.6 ms per miss, whichever tool runs. Figures depend on the machine's load (2 cores shared here):
compare the ratios of one run and the per-pair ratios.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from bench_dataplane import HttpServerProcess, cpu_seconds  # noqa: E402
from bench_fuse import Proc, silod  # noqa: E402
from json_index_server import json_index_handler  # noqa: E402

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Python's file server with `Range: bytes=a-[b]` (206) and TCP_NODELAY, as nginx."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:
        pass

    def send_head(self):
        m = _RANGE.match(self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if m is None or os.path.isdir(path):
            return super().send_head()
        try:
            f = open(path, "rb")
        except OSError:
            self.send_error(404)
            return None
        size = os.fstat(f.fileno()).st_size
        start = int(m.group(1))
        end = min(size - 1, int(m.group(2))) if m.group(2) else size - 1
        if start >= size:
            f.close()
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Last-Modified", self.date_time_string(int(os.fstat(f.fileno()).st_mtime)))
        self.end_headers()
        return _Limited(f, end - start + 1)


class _Limited:
    def __init__(self, f, n: int) -> None:
        self.f, self.n = f, n

    def read(self, size: int = -1) -> bytes:
        size = self.n if size < 0 else min(size, self.n)
        data = self.f.read(size)
        self.n -= len(data)
        return data

    def close(self) -> None:
        self.f.close()


def serve(root: str, port: int, index: str) -> None:
    handler = json_index_handler(RangeHandler) if index == "json" else RangeHandler
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=root))
    server.daemon_threads = True
    server.serve_forever()


class Server(HttpServerProcess):
    """The source in its own process (no GIL shared with the readers): this file's server, started
    and waited for by bench_dataplane's HttpServerProcess."""

    def __init__(self, root: Path, index: str) -> None:
        super().__init__(root, 0.0, index=index,
                         command=lambda port: [sys.executable, __file__, "--serve", str(root), str(port), index])


def make_set(root: Path, count: int, size: int) -> list[str]:
    root.mkdir(parents=True)
    rng = random.Random(count)
    names = []
    block = os.urandom(size + 4096)
    for i in range(count):
        name = f"f{i:06d}.bin"
        off = rng.randrange(4096)
        (root / name).write_bytes(block[off:off + size])
        names.append(name)
    return names


def read_pass(root: Path, names: list[str], readers: int) -> tuple[float, int]:
    """(seconds, bytes) reading every file once with `readers` threads, in a shuffled order."""
    order = names[:]
    random.shuffle(order)

    def work(name: str) -> int:
        n = 0
        with open(root / name, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(work, order))
    return time.perf_counter() - t0, total


def drop_caches() -> None:
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: the direct reference then reads from the page cache


class CacheFs:
    """A fresh file system for one run's cache: a sparse image with a new ext4 (journal included, as
    mkfs makes it) on a loop device, unmounted and deleted afterwards; or, for `root`, a plain
    directory under the work directory (whatever file system holds it)."""

    def __init__(self, kind: str, path: Path, size: int) -> None:
        self.kind, self.path = kind, path
        self.image = path.with_suffix(".img")
        path.mkdir(parents=True)
        if kind == "root":
            return
        with open(self.image, "wb") as f:
            f.truncate(size)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True)
        try:
            subprocess.run(["mount", "-o", "loop", str(self.image), str(path)], check=True, capture_output=True)
        except subprocess.CalledProcessError as e:
            self.image.unlink()
            raise SystemExit(f"--cache-fs loop: mounting a loop device failed ({e.stderr.decode().strip()}); "
                             "run as root with loop devices, or pass --cache-fs root") from None

    def close(self) -> None:
        if self.kind != "root":
            subprocess.run(["umount", str(self.path)], check=False)
            self.image.unlink(missing_ok=True)
        shutil.rmtree(self.path, ignore_errors=True)


def run_tool(tool: str, url: str, work: Path, names: list[str], readers: int, cache_fs: str, cache_bytes: int,
             run: int) -> dict:
    mnt = work / f"mnt-{tool}"
    cache_dir = CacheFs(cache_fs, work / f"cache-{tool}-{run}", cache_bytes)
    cache = cache_dir.path / "cache"
    try:
        return _run_tool(tool, url, work, mnt, cache, names, readers)
    finally:
        cache_dir.close()


def _run_tool(tool: str, url: str, work: Path, mnt: Path, cache: Path, names: list[str], readers: int) -> dict:
    if tool == "silod":
        stats = work / f"{tool}.stats.json"
        stats.unlink(missing_ok=True)
        proc = Proc([*silod(), "mount", str(mnt), "--source", url, "--dataset", "bench", "--job", "bench",
                     "--cache-dir", str(cache), "--stats-file", str(stats)], mnt, ready=stats.exists, timeout=120)
    else:
        proc = Proc(["rclone", "mount", ":http:", str(mnt), "--http-url", url, "--vfs-cache-mode", "full",
                     "--cache-dir", str(cache), "--read-only", "--dir-cache-time", "1h"], mnt, timeout=120)
    try:
        os.listdir(mnt)  # the listing is not part of the epoch
        cpu0 = cpu_seconds(proc.p.pid)
        cold_s, cold_bytes = read_pass(mnt, names, readers)
        cpu = cpu_seconds(proc.p.pid) - cpu0
        warm_s, _ = read_pass(mnt, names, readers)
        return {"cold_files_s": len(names) / cold_s, "cold_mb_s": cold_bytes / cold_s / 1e6,
                "warm_files_s": len(names) / warm_s, "warm_mb_s": cold_bytes / warm_s / 1e6,
                "cpu_ms_per_miss": cpu / len(names) * 1e3, "rss_mb": proc.rss_mb(),
                "load": os.getloadavg()[0]}
    finally:
        proc.stop()


def abba(tools: list[str], runs: int) -> list[tuple[str, int]]:
    """The run order: A B B A A B B A ... (`runs` per tool), each entry (tool, its run number)."""
    order: list[tuple[str, int]] = []
    for i in range(runs):
        pair = tools if i % 2 == 0 else tools[::-1]
        order += [(t, i) for t in pair]
    return order


_KEYS = ("cold_files_s", "cold_mb_s", "warm_files_s", "warm_mb_s", "cpu_ms_per_miss", "rss_mb")


def _row(kind: str, label: str, r: dict) -> str:
    return (f"{kind:6} {label:10} {r['cold_files_s']:13.0f} {r['cold_mb_s']:10.0f} {r['warm_files_s']:13.0f} "
            f"{r['warm_mb_s']:10.0f} {r['cpu_ms_per_miss']:12.2f} {r['rss_mb']:7.0f}" +
            (f" {r['load']:5.1f}" if "load" in r else ""))


def report(rows: list) -> None:
    print(f"{'set':6} {'tool':10} {'cold files/s':>13} {'cold MB/s':>10} {'warm files/s':>13} {'warm MB/s':>10} "
          f"{'CPU ms/miss':>12} {'RSS MB':>7} {'load':>5}")
    for kind, direct, res in rows:
        print(f"{kind:6} {'direct':10} {direct['files_s']:13.0f} {direct['mb_s']:10.0f}")
        med = {}
        for tool, runs in res.items():
            for i, r in enumerate(runs):
                print(_row(kind, f"{tool}#{i + 1}", r))
            med[tool] = {k: statistics.median(r[k] for r in runs) for k in _KEYS}
            print(_row(kind, f"{tool} med", med[tool]))
        s = med["silod"]
        if "rclone" in med:
            rc = med["rclone"]
            # A tiny set can cost rclone less CPU than the clock's tick: no ratio then, not a crash.
            cpu = (f"{s['cpu_ms_per_miss'] / rc['cpu_ms_per_miss']:.2f}x" if rc["cpu_ms_per_miss"] > 0
                   else "n/a (rclone's CPU below the clock's resolution)")
            pairs = ", ".join(f"{a['cold_files_s'] / b['cold_files_s']:.2f}x"
                              for a, b in zip(res["silod"], res["rclone"]))
            print(f"{kind:6} silod/rclone (medians): cold {s['cold_files_s'] / rc['cold_files_s']:.2f}x, warm "
                  f"{s['warm_files_s'] / rc['warm_files_s']:.2f}x, CPU per miss {cpu}; cold per pair: {pairs}")
        print(f"{kind:6} silod/direct (medians): cold {s['cold_files_s'] / direct['files_s']:.2f}x, warm "
              f"{s['warm_files_s'] / direct['files_s']:.2f}x")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--small-size", type=int, default=110_000)
    ap.add_argument("--large", type=int, default=4)
    ap.add_argument("--large-mb", type=int, default=64)
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1, help="runs per tool, alternated A-B-B-A (default 1)")
    ap.add_argument("--cache-fs", choices=("loop", "root"), default="loop",
                    help="loop: a fresh journaled ext4 on a loop device per run (default); root: a directory "
                         "in the temporary directory's file system")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    tools = ["silod"]
    if shutil.which("rclone"):
        tools.append("rclone")
    else:
        print("rclone is not installed (apt-get install rclone): its rows are skipped")
    work = Path(tempfile.mkdtemp(prefix="silod-vs-rclone-"))
    try:
        sets = {"small": make_set(work / "src" / "small", args.small, args.small_size),
                "large": make_set(work / "src" / "large", args.large, args.large_mb << 20)}
        sizes = {"small": args.small * args.small_size, "large": args.large * (args.large_mb << 20)}
        servers = {"json": Server(work / "src", "json"), "html": Server(work / "src", "html")}
        try:
            rows = []
            for kind, names in sets.items():
                drop_caches()
                d_s, d_bytes = read_pass(work / "src" / kind, names, args.readers)
                direct = {"files_s": len(names) / d_s, "mb_s": d_bytes / d_s / 1e6}
                # Room for the items, their metadata and the file system's own (ext4 reserves 5%).
                cache_bytes = max(1 << 30, int(sizes[kind] * 1.5) + (len(names) << 13))
                res: dict[str, list[dict]] = {t: [] for t in tools}
                for tool, run in abba(tools, args.runs):
                    server = servers["json" if tool == "silod" else "html"]
                    drop_caches()
                    res[tool].append(run_tool(tool, f"{server.url}{kind}/", work, names, args.readers,
                                              args.cache_fs, cache_bytes, run))
                rows.append((kind, direct, res))
        finally:
            for s in servers.values():
                s.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows)


if __name__ == "__main__":
    main()
