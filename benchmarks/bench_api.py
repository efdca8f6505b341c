"""Benchmarks of the scheduler service (issue 4).

1. 1,000 job submissions through the REST API, SQLite database     (target <= 10 s)
2. GET /v1/jobs with 100 concurrent clients                        (target p99 <= 100 ms)
3. one scheduling round for 1,000 active jobs: snapshot, policy,
   persist with audit rows                                          (target <= 1 s)

The service runs as a real `silod serve` process (null backend: nothing is launched) so the
client does not share its interpreter. Because these machines are noisy, each figure comes
with a reference measured in the same run: a bare FastAPI + uvicorn app with one equivalent
endpoint (1, 2) and the pure policy call `SchedulingCore.plan` (3); the ratios are reported.

    .venv/bin/python benchmarks/bench_api.py [--jobs 1000] [--clients 100] [--out bench_api.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

ADMIN = "bench-admin-token-0000"
BARE_APP = textwrap.dedent(
    """
    import sys, time
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel

    app = FastAPI()
    items = []

    class Item(BaseModel):
        name: str
        gpus: int
        dataset: str
        epochs: float
        ideal_throughput: float | str

    @app.post("/v1/jobs", status_code=201)
    def post(item: Item) -> dict:
        items.append(item)
        return {"id": str(len(items)), **item.model_dump()}

    @app.get("/v1/jobs")
    def get() -> list[dict]:
        return [{"id": str(i), **it.model_dump()} for i, it in enumerate(items[:N])]

    @app.get("/healthz")
    def health() -> dict:
        return {"status": "ok"}

    N = int(sys.argv[2])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not become healthy")


def _start_silod(tmp: Path, users: int) -> tuple[subprocess.Popen, str, dict[str, str]]:
    tokens = {f"user{i}": f"bench-user-token-{i:04d}" for i in range(users)}
    (tmp / "tokens").write_text("".join(f"{u}:{t}\n" for u, t in tokens.items()))
    port = _port()
    env = {**os.environ, "SILOD_ADMIN_TOKEN": ADMIN}
    cmd = [sys.executable, "-c", "from scheduler.cli import main; main()", "serve", "--listen", f"127.0.0.1:{port}",
           "--db", f"sqlite:///{tmp / 'bench.db'}", "--backend", "null", "--gpus", "256", "--gpus-per-node", "8",
           "--cache", "20TB", "--remote-io", "10GB/s", "--policy", "fifo", "--tokens", str(tmp / "tokens"),
           "--round", "360", "--state-dir", str(tmp / "state"), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc)
    return proc, url, tokens


def _start_bare(list_len: int) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-c", BARE_APP, str(port), str(list_len)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc)
    return proc, url


def bench_submit(url: str, tokens: list[str], n: int) -> float:
    clients = [httpx.Client(base_url=url, headers={"Authorization": f"Bearer {t}"}, timeout=60) for t in tokens]
    try:
        t0 = time.perf_counter()
        for i in range(n):
            r = clients[i % len(clients)].post(
                "/v1/jobs",
                json={"name": f"job-{i}", "gpus": 1 + i % 8, "dataset": f"ds{i % 20}", "epochs": 1 + i % 5,
                      "ideal_throughput": "114MB/s"},
            )
            if r.status_code != 201:
                raise SystemExit(f"submission {i} failed: {r.status_code} {r.text}")
        return time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()


async def _get_load(url: str, token: str, clients: int, per_client: int, path: str) -> list[float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120, limits=limits) as c:
        await c.get(path)  # warm-up

        async def one_client() -> None:
            for _ in range(per_client):
                t0 = time.perf_counter()
                r = await c.get(path)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise SystemExit(f"GET {path}: {r.status_code}")

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return latencies


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def bench_round(tmp: Path, n: int, policy: str) -> dict[str, float]:
    """In-process: a service on a fresh SQLite file with `n` active jobs; time full rounds."""
    from scheduler.service import NewDataset, NewJob, Principal
    from scheduler.service_cli import build_service

    db = tmp / f"round-{policy}.db"
    svc = build_service(db=f"sqlite:///{db}", backend="null", policy=policy, round_s=360, gpus="256",
                        gpus_per_node="8", cache="20TB", remote_io="10GB/s", state_dir=tmp / "state")
    user = Principal("bench")
    for d in range(20):
        svc.register_dataset(user, NewDataset(f"ds{d}", f"s3://bench/ds{d}", (50 + 70 * d) * 1e9))
    for i in range(n):
        svc.submit_job(user, NewJob(f"job-{i}", 1 + i % 8, f"ds{i % 20}", epochs=1 + i % 5, ideal_throughput=(20 + i % 100) * 1e6 * (1 + i % 8)))
    try:
        first = svc.run_round("bench")  # every allocation is new: the most rows to write
        steady = svc.run_round("bench")  # the usual case: few or no changes
        snapshot = svc.build_snapshot()
        t0 = time.perf_counter()
        svc.core.plan(snapshot)
        plan_only = time.perf_counter() - t0
        t0 = time.perf_counter()
        svc.build_snapshot()
        snap_only = time.perf_counter() - t0
        return {"first_round_s": first.duration_s, "first_round_changes": first.changes,
                "steady_round_s": steady.duration_s, "steady_round_changes": steady.changes,
                "snapshot_s": snap_only, "policy_plan_s": plan_only,
                "ratio_first_round_to_plan": first.duration_s / plan_only}
    finally:
        svc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--requests-per-client", type=int, default=10)
    ap.add_argument("--users", type=int, default=10, help="jobs are spread over this many users")
    ap.add_argument("--policies", default="fifo,sjf,gavel")
    ap.add_argument("--out", type=Path, default=Path("bench_api.json"))
    args = ap.parse_args()
    results: dict[str, object] = {"jobs": args.jobs, "clients": args.clients, "cpu_count": os.cpu_count()}

    with tempfile.TemporaryDirectory(prefix="silod-bench-") as tmpdir:
        tmp = Path(tmpdir)
        proc, url, tokens = _start_silod(tmp, args.users)
        bare, bare_url = _start_bare(args.jobs // args.users)
        try:
            admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"})
            for d in range(20):
                admin.post("/v1/datasets", json={"name": f"ds{d}", "uri": f"s3://bench/ds{d}", "size": f"{50 + 70 * d}GB"})
            admin.close()
            t_submit = bench_submit(url, list(tokens.values()), args.jobs)
            t_bare = bench_submit(bare_url, ["x"], args.jobs)
            results["submit"] = {"seconds": t_submit, "per_request_ms": 1e3 * t_submit / args.jobs,
                                 "bare_fastapi_seconds": t_bare, "ratio_to_bare": t_submit / t_bare, "target_s": 10}
            print(f"[1] {args.jobs} submissions: {t_submit:.2f} s ({1e3 * t_submit / args.jobs:.2f} ms each); "
                  f"bare FastAPI {t_bare:.2f} s; ratio {t_submit / t_bare:.2f}x  (target <= 10 s)")

            user_token = next(iter(tokens.values()))
            per_user = args.jobs // args.users
            for label, token, target_url in (("silod", user_token, url), ("bare", "x", bare_url)):
                lat = asyncio.run(_get_load(target_url, token, args.clients, args.requests_per_client, "/v1/jobs"))
                results[f"get_jobs_{label}"] = {"requests": len(lat), "p50_ms": 1e3 * _pct(lat, 50),
                                                "p99_ms": 1e3 * _pct(lat, 99), "max_ms": 1e3 * max(lat)}
            s, b = results["get_jobs_silod"], results["get_jobs_bare"]
            s["ratio_p99_to_bare"] = s["p99_ms"] / b["p99_ms"]  # type: ignore[index]
            s["jobs_per_response"] = per_user  # type: ignore[index]
            s["target_p99_ms"] = 100  # type: ignore[index]
            print(f"[2] GET /v1/jobs ({per_user} jobs per response), {args.clients} concurrent clients x "
                  f"{args.requests_per_client}: p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms; "  # type: ignore[index]
                  f"bare FastAPI p99 {b['p99_ms']:.1f} ms; ratio {s['ratio_p99_to_bare']:.2f}x  (target p99 <= 100 ms)")  # type: ignore[index]
        finally:
            for p in (proc, bare):
                p.terminate()
                p.wait(timeout=30)

        rounds = {}
        for policy in args.policies.split(","):
            r = bench_round(tmp, args.jobs, policy)
            rounds[policy] = r
            print(f"[3] round, {args.jobs} active jobs, {policy}: first {r['first_round_s']:.3f} s "
                  f"({r['first_round_changes']} audit rows), steady {r['steady_round_s']:.3f} s; "
                  f"snapshot {r['snapshot_s']:.3f} s, policy alone {r['policy_plan_s']:.3f} s; "
                  f"ratio round/policy {r['ratio_first_round_to_plan']:.2f}x  (target <= 1 s)")
        results["round"] = rounds

    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
