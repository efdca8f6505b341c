"""Benchmark: from `silod serve` being ready to a Gavel job admitted and running, on a loaded
machine, as a fresh install meets it (issue 48, item 1).

Each run starts `silod serve --policy gavel --backend null` on its own SQLite database,
registers a dataset, waits for `/readyz` to answer 200 ("ready"), submits a one-GPU job at once
and waits for it to be running. Meanwhile `--load N` busy processes (default: one per core) keep
every core busy, on top of whatever else runs on the machine. Two runs:

1. cold: an empty numba cache (`NUMBA_CACHE_DIR` in a new temporary directory), as the first
   start after an install, or in a new clone or venv of sources never compiled on this machine;
2. warm (the reference, same run): the same again with the cache the first run filled.

It prints, per run, start -> ready and ready -> running, the ratio of the cold run's ready ->
running to the warm run's, and checks the target: a Gavel job running within 10 s of ready.
Before the kernels were compiled ahead of the lease (scheduler/service/warmup.py), the first
Gavel round compiled them after ready, at nice +10: over a minute on a busy node.

    .venv/bin/python benchmarks/bench_startup.py [--load 2] [--out out/bench_startup.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ADMIN = "bench-startup-admin-0123"
H = {"Authorization": f"Bearer {ADMIN}"}
TARGET_S = 10.0


def _burn() -> None:
    while True:
        pass


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _silod() -> list[str]:
    script = Path(sys.executable).parent / "silod"
    return [str(script)] if script.exists() else [sys.executable, "-m", "scheduler"]


def _until(cond, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"bench_startup: {what} within {timeout:.0f} s")


def one_run(workdir: Path, numba_cache: Path, label: str) -> dict:
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = open(workdir / f"serve-{label}.log", "wb")
    env = {**os.environ, "SILOD_ADMIN_TOKEN": ADMIN, "NUMBA_CACHE_DIR": str(numba_cache)}
    start = time.monotonic()
    proc = subprocess.Popen(
        [*_silod(), "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{workdir / f'{label}.db'}",
         "--backend", "null", "--gpus", "8", "--gpus-per-node", "4", "--cache", "1TB", "--remote-io", "1GB/s",
         "--policy", "gavel", "--state-dir", str(workdir / f"state-{label}"), "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _until(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, 300, "the API did not answer")
        r = httpx.post(f"{url}/v1/datasets", headers=H, timeout=30,
                       json={"name": "imagenet", "uri": "s3://datasets/imagenet", "size": "143GB"})
        assert r.status_code == 201, r.text
        ready = _until(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 600, "/readyz did not say ready")
        job = httpx.post(f"{url}/v1/jobs", headers=H, timeout=30,
                         json={"name": "first", "gpus": 1, "dataset": "imagenet", "epochs": 1,
                               "ideal_throughput": "100MB/s"}).json()
        running = _until(lambda: httpx.get(f"{url}/v1/jobs/{job['id']}", headers=H, timeout=5).json()["state"] == "running",
                         600, "the job was not running")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    return {"start_to_ready_s": ready - start, "ready_to_running_s": running - ready}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes while it runs")
    ap.add_argument("--out", type=Path, default=Path("out/bench_startup.json"))
    args = ap.parse_args()
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
            work = Path(tmp)
            cache = work / "numba"
            cold = one_run(work, cache, "cold")
            warm = one_run(work, cache, "warm")
    finally:
        for b in burners:
            b.terminate()
    load = os.getloadavg()[0]
    ratio = cold["ready_to_running_s"] / max(warm["ready_to_running_s"], 1e-9)
    met = cold["ready_to_running_s"] <= TARGET_S
    print(f"load average {load:.1f} (with {args.load} busy processes of this benchmark)")
    for name, r in (("cold numba cache", cold), ("warm numba cache (reference)", warm)):
        print(f"{name:30s} start -> ready {r['start_to_ready_s']:6.1f} s   ready -> Gavel job running {r['ready_to_running_s']:5.2f} s")
    print(f"ready -> running, cold / warm: {ratio:.2f}x; target <= {TARGET_S:.0f} s after ready: {'met' if met else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cold": cold, "warm": warm, "ratio_ready_to_running": ratio, "load_average": load,
                                    "busy_processes": args.load, "target_s": TARGET_S, "met": met}, indent=2) + "\n")


if __name__ == "__main__":
    main()
