"""CPU per request of silod's API against the bare FastAPI reference, in one process (issue 47).

bench_api.py measures latency at load through sockets, where a shared 2-core machine's noise
swings single cells 2-4x. This one asks a narrower, steadier question: how much CPU does one
request cost each app? Both ASGI apps are called directly (no socket, no client, no uvicorn),
one request at a time, on one event loop, against copies of the same SQLite database (10,000
queued jobs, as bench_api.py prepares it); `time.process_time()` counts the CPU of every thread
of the process (the event loop and the apps' worker threads, where the database work runs).
Blocks of requests alternate between the apps, so both see the same machine.

- silod: the app one `silod serve` API worker runs (`create_app` over `build_api_service`, the
  token store, the request guard), with bench_api.py's options (null backend, no queued quota).
- bare: bench_api.py's BARE_APP, the same code its reference runs.

    .venv/bin/python benchmarks/bench_api_cpu.py [--requests 500] [--blocks 15] [--profile DIR]

With --profile DIR, each app's POST requests then run alone under `py-spy record` (py-spy on PATH
or in the venv; idle threads are not sampled) and the raw collapsed stacks go to
DIR/silod-post.txt and DIR/bare-post.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_api import BARE_APP, JOB_BODY, USER_TOKEN, prepare_db  # noqa: E402
from benchmarks.bench_api_tenant_cost import _count  # noqa: E402

BODY = json.dumps(JOB_BODY).encode()


def silod_app(tmp: Path, db: Path) -> Any:
    from scheduler.service.api.app import create_app
    from scheduler.service.api.auth import TokenStore, load_token_key
    from scheduler.service.cli import build_api_service, parse_quota
    from scheduler.service.db import open_database

    open_database(f"sqlite:///{db}").dispose()  # migrated, as `silod serve` does before its workers start
    (tmp / "tokens").write_text(f"bench:{USER_TOKEN}\n")
    service = build_api_service(db=f"sqlite:///{db}", backend="null", gpus="256", gpus_per_node="8", cache="20TB",
                                remote_io="10GB/s", state_dir=tmp / "state", object_limits="jobs=10000000",
                                default_quota=parse_quota("queued=none"))
    tokens = TokenStore(service.engine, load_token_key(tmp / "state"))
    tokens.import_file(tmp / "tokens")
    return create_app(service, tokens, run_loop=False)


def bare_app(tmp: Path, db: Path) -> Any:
    os.environ["BARE_DB"] = f"sqlite:///{db}"
    namespace: dict[str, Any] = {"__name__": "bare_app"}
    exec(compile(BARE_APP, str(tmp / "bare_app.py"), "exec"), namespace)
    return namespace["app"]


def _scope(method: str, path: str, body: bytes | None) -> dict[str, Any]:
    headers = [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"wrk"), (b"authorization", f"Bearer {USER_TOKEN}".encode())]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}


async def call(app: Any, method: str, path: str, body: bytes | None, expect: int) -> None:
    sent = False
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body or b"", "more_body": False}
        await never.wait()  # the client stays connected
        return {"type": "http.disconnect"}

    status = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(method, path, body), receive, send)
    if status != expect:
        raise SystemExit(f"{method} {path} answered {status}, expected {expect}")


async def block(app: Any, method: str, path: str, body: bytes | None, expect: int, n: int) -> tuple[float, float]:
    """CPU seconds and wall seconds per request over n requests, one at a time."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        await call(app, method, path, body, expect)
    return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n


async def measure(apps: dict[str, Any], n: int, blocks: int, get_path: str) -> dict[str, Any]:
    cells = {("POST", "/v1/jobs", BODY, 201), ("GET", get_path, None, 200)}
    out: dict[str, Any] = {}
    for method, path, body, expect in sorted(cells):
        for app in apps.values():  # warm: first-call set-up, caches, the pool's connections
            await block(app, method, path, body, expect, 50)
        per: dict[str, list[float]] = {name: [] for name in apps}
        for b in range(blocks):
            order = list(apps) if b % 2 == 0 else list(reversed(apps))
            for name in order:
                cpu, _wall = await block(apps[name], method, path, body, expect, n)
                per[name].append(cpu)
        med = {name: statistics.median(v) for name, v in per.items()}
        ratio = med["silod"] / med["bare"]
        out[f"{method} {'/v1/jobs/{id}' if method == 'GET' else path}"] = {
            "cpu_us_per_request": {k: v * 1e6 for k, v in med.items()},
            "blocks_us": {k: [x * 1e6 for x in v] for k, v in per.items()}, "ratio": ratio}
        print(f"{method:4s} {path:16s} CPU per request: silod {med['silod'] * 1e6:7.0f} us  bare {med['bare'] * 1e6:7.0f} us"
              f"  ratio {ratio:.2f}x  (median of {blocks} blocks of {n}; silod blocks "
              f"{', '.join(f'{x * 1e6:.0f}' for x in per['silod'])}; bare {', '.join(f'{x * 1e6:.0f}' for x in per['bare'])})",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--active", type=_count(2, 1_000_000), default=10_000, help="queued jobs in the database")
    ap.add_argument("--requests", type=_count(1, 1_000_000), default=500, help="requests per block")
    ap.add_argument("--blocks", type=_count(1, 1000), default=15, help="blocks per app, alternating")
    ap.add_argument("--profile", type=Path, default=None, help="a directory for py-spy profiles of each app's POST")
    ap.add_argument("--out", type=Path, default=Path("out/bench_api_cpu.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="silod-bench-cpu-") as tmpdir:
        tmp = Path(tmpdir)
        prepare_db(tmp / "silod.db", args.active)
        shutil.copy(tmp / "silod.db", tmp / "bare.db")
        apps = {"silod": silod_app(tmp, tmp / "silod.db"), "bare": bare_app(tmp, tmp / "bare.db")}
        loop = asyncio.new_event_loop()
        results = {"active_jobs": args.active, "requests_per_block": args.requests, "blocks": args.blocks,
                   "load_average": os.getloadavg()[0],
                   "cells": loop.run_until_complete(measure(apps, args.requests, args.blocks, f"/v1/jobs/{args.active // 2}"))}
        if args.profile is not None:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            args.profile.mkdir(parents=True, exist_ok=True)
            for name, app in apps.items():
                raw = args.profile / f"{name}-post.txt"
                prof = subprocess.Popen([spy, "record", "-r", "1000", "-f", "raw", "-o", str(raw), "--pid",
                                         str(os.getpid()), "--threads", "--nonblocking"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                time.sleep(2)  # py-spy attached
                loop.run_until_complete(block(app, "POST", "/v1/jobs", BODY, 201, args.requests * args.blocks))
                prof.send_signal(2)
                prof.wait(60)
                print(f"profile of {name}'s POST (CPU samples only): {raw}")
        loop.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out} (load average {results['load_average']:.1f})")


if __name__ == "__main__":
    main()
