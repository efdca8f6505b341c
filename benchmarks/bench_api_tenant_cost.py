"""Benchmark: what one tenant's queued jobs cost other tenants' reads (issue 47, Build 2).

Against `silod serve --workers 2` (null backend, SQLite file): alice has 2 jobs (one running,
one queued), bob has 1. Each run measures, one request at a time, alice's `GET /v1/overview`
(what the web view polls every 2 s) and bob's `GET /v1/jobs?limit=1` and `GET /v1/jobs/{id}`:

1. with carol holding 0 queued jobs: the reference;
2. with carol holding 12,000 queued jobs (bulk-inserted into a copy of the same database).

Both servers run at once and are asked in turn, request by request, so both see the same load
on a shared machine.

It prints each figure's median and p90 and the ratio of 2 to 1 (target: <= 1.5x). Before the
overview was built from the caller's own jobs (scheduler/service/overview.py), alice's overview
took 1.3-2.3 s with carol's 12,000 jobs against 8-13 ms without.

    .venv/bin/python benchmarks/bench_api_tenant_cost.py [--requests 80] [--carol 12000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_api as b  # noqa: E402

TOKENS = {"alice": "alice-bench-token-0001", "bob": "bob-bench-token-00002", "carol": "carol-bench-token-0003"}


def prepare(db: Path) -> dict[str, int]:
    """Datasets of alice, bob and carol; alice's running and queued job, bob's queued job."""
    from sqlalchemy import insert

    from scheduler.service.db import open_database
    from scheduler.service.db.models import Dataset, Job, JobAllocationRow, JobState

    engine = open_database(f"sqlite:///{db}")
    now = time.time()
    ids: dict[str, int] = {}
    with engine.begin() as c:
        for i, who in enumerate(TOKENS):
            c.execute(insert(Dataset), [dict(name="ds", uri=f"s3://bench/{who}", size=100e9, item_count=None, owner=who,
                                             created_at=now, credential_id=None)])
        for name, owner, ds, state in (("a-run", "alice", 1, JobState.RUNNING), ("a-wait", "alice", 1, JobState.QUEUED),
                                       ("b-wait", "bob", 2, JobState.QUEUED)):
            jid = c.execute(insert(Job).returning(Job.id), [dict(
                name=name, owner=owner, gpus=8, dataset_id=ds, model=None, ideal_throughput=200e6, epochs=1, steps=None,
                step_bytes=None, total_bytes=100e9, consumed_bytes=0.0, priority=0, state=state, submit_time=now,
                start_time=now if state == JobState.RUNNING else None, finish_time=None, message="")]).scalar_one()
            ids[name] = jid
            if state == JobState.RUNNING:
                c.execute(insert(JobAllocationRow), [dict(job_id=jid, gpus=8, gpu_share=1.0, running=True, remote_io=1e8,
                                                           round_id=None, updated_at=now)])
    engine.dispose()
    return ids


def add_carol(db: Path, n: int) -> None:
    from sqlalchemy import insert

    from scheduler.service.db import open_database
    from scheduler.service.db.models import Job, JobState

    engine = open_database(f"sqlite:///{db}")
    now = time.time()
    rows = [dict(name=f"c-{i}", owner="carol", gpus=8, dataset_id=3, model=None, ideal_throughput=200e6, epochs=1,
                 steps=None, step_bytes=None, total_bytes=100e9, consumed_bytes=0.0, priority=0, state=JobState.QUEUED,
                 submit_time=now + i * 1e-3, start_time=None, finish_time=None, message="") for i in range(n)]
    with engine.begin() as c:
        for i in range(0, n, 2000):
            c.execute(insert(Job), rows[i:i + 2000])
    engine.dispose()


def start(tmp: Path, db: Path) -> tuple[subprocess.Popen, str]:
    (tmp / "tokens").write_text("".join(f"{u}:{t}\n" for u, t in TOKENS.items()))
    port = b._port()
    # 8 GPUs: alice's running job holds them all, every other job waits; rounds every 360 s.
    cmd = [sys.executable, "-c", "from scheduler.cli import main; main()", "serve", "--listen", f"127.0.0.1:{port}",
           "--db", f"sqlite:///{db}", "--backend", "null", "--gpus", "8", "--gpus-per-node", "8", "--cache", "20TB",
           "--remote-io", "10GB/s", "--policy", "fifo", "--tokens", str(tmp / "tokens"), "--round", "360",
           "--workers", "2", "--state-dir", str(tmp / "state"), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "SILOD_ADMIN_TOKEN": b.ADMIN}, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "silod.log", "ab"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    b._wait_healthy(url, proc)
    # The scheduling process's first round reads every active job: measure after it, not during.
    deadline = time.monotonic() + 300
    while httpx.get(f"{url}/v1/cluster", headers={"Authorization": f"Bearer {b.ADMIN}"},
                    timeout=60).json().get("last_round_time") is None:
        if time.monotonic() > deadline:
            raise SystemExit("no round within 300 s")
        time.sleep(0.5)
    time.sleep(2.0)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(urls: dict[str, str], ids: dict[str, int], requests: int) -> dict[str, dict[str, list[float]]]:
    """Latencies per server and probe. The servers are asked in turn, request by request (the
    order alternating), so both see the same machine: on a shared machine the load drifts by
    more than the effect within minutes."""
    h = {u: {"Authorization": f"Bearer {t}"} for u, t in TOKENS.items()}
    probes = {
        "alice GET /v1/overview": ("/v1/overview", h["alice"]),
        "bob GET /v1/jobs?limit=1": ("/v1/jobs?limit=1", h["bob"]),
        "bob GET /v1/jobs/{id}": (f"/v1/jobs/{ids['b-wait']}", h["bob"]),
    }
    out = {label: {k: [] for k in probes} for label in urls}
    clients = {label: httpx.Client(base_url=url, timeout=120) for label, url in urls.items()}
    try:
        for c in clients.values():
            for path, headers in probes.values():  # warm both workers' connections and caches
                for _ in range(4):
                    assert c.get(path, headers=headers).status_code == 200
        labels = list(urls)
        for i in range(requests):
            for name, (path, headers) in probes.items():
                for label in (labels if i % 2 == 0 else labels[::-1]):
                    t0 = time.perf_counter()
                    r = clients[label].get(path, headers=headers)
                    out[label][name].append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
        for c in clients.values():
            o = c.get("/v1/overview", headers=h["alice"]).json()
            # Hers only (whether the round started a-run or not).
            assert {q["owner"] for q in o["queue"] + o["running"]} == {"alice"}, o
    finally:
        for c in clients.values():
            c.close()
    return out


def _stats(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    return {"n": len(lat), "median_ms": statistics.median(lat) * 1e3, "p90_ms": lat[int(0.9 * (len(lat) - 1))] * 1e3}


def _count(low: int, high: int):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        if not text.strip().isdigit() or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {low} to {high}")
        return int(text)
    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=_count(1, 100_000), default=80, help="requests of each kind to each server")
    ap.add_argument("--carol", type=_count(1, 1_000_000), default=12_000, help="carol's queued jobs on the second server")
    ap.add_argument("--out", type=Path, default=Path("out/bench_api_tenant_cost.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="silod-bench-tenant-"))
    try:
        db = tmp / "silod.db"
        from scheduler.service.db import open_database

        open_database(f"sqlite:///{db}").dispose()  # migrated
        ids = prepare(db)
        loaded_label = f"carol {args.carol}"
        dbs = {"carol 0": db, loaded_label: tmp / "silod-carol.db"}
        shutil.copyfile(db, dbs[loaded_label])
        add_carol(dbs[loaded_label], args.carol)
        procs, urls = {}, {}
        try:
            for label, path in dbs.items():
                (tmp / label.replace(" ", "-")).mkdir()
                procs[label], urls[label] = start(tmp / label.replace(" ", "-"), path)
            phases = measure(urls, ids, args.requests)
        finally:
            for proc in procs.values():
                stop(proc)
        ref, loaded = phases["carol 0"], phases[loaded_label]
        result = {"requests": args.requests, "carol_jobs": args.carol, "phases": {}, "ratios_median": {}}
        print(f"{'probe':28s} {'0 jobs: median / p90 ms':>26s} {f'{args.carol} jobs: median / p90 ms':>30s} {'ratio':>7s}")
        for name in ref:
            a, z = _stats(ref[name]), _stats(loaded[name])
            ratio = z["median_ms"] / a["median_ms"]
            result["phases"][name] = {"carol 0": a, f"carol {args.carol}": z}
            result["ratios_median"][name] = ratio
            print(f"{name:28s} {a['median_ms']:12.1f} / {a['p90_ms']:7.1f} {z['median_ms']:16.1f} / {z['p90_ms']:7.1f}"
                  f" {ratio:6.2f}x {'ok' if ratio <= 1.5 else 'OVER 1.5x'}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
