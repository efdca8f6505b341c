"""Benchmark of the scheduler service under load (issue 11).

What is measured, each against a reference in the same run (these machines are shared and
noisy, so only ratios mean much):

1. POST /v1/jobs and GET /v1/jobs/{id}, p50/p99 latency and throughput, at 16, 64 and 256
   concurrent clients, with 10,000 active jobs in the database: `silod serve` (real process,
   null backend, its API workers plus its scheduling process) against a bare FastAPI app with
   the same number of uvicorn workers that writes the same rows to the same kind of database
   (a copy of the same SQLite file, same engine settings) and reads them back by id, on the
   same HTTP protocol (h11) with Nagle off as silod has it.
   Targets (issue 20): p99 within 1.5x of the bare app's, p50 within 1.25x, throughput >= 0.8x.
2. GET p99 at 64 clients while scheduling rounds over those 10,000+ active jobs run back to
   back (forced through POST /v1/rounds), against the same GET p99 with no round running.
   Target: at most +20%.

Load generator: wrk (C, event-driven, one thread per core; Debian package `wrk`). A Python
client (httpx/asyncio) costs about as much CPU per request as the server it measures, so on
a 2-core machine it, not the server, would set the latency at 256 clients. wrk measures a
closed loop (each connection sends its next request when the answer arrives), which is what
"N concurrent clients" means here.

    .venv/bin/python benchmarks/bench_api.py [--active 10000] [--seconds 8] [--workers 2] [--out bench_api.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx

ADMIN = "bench-admin-token-0000"
USER_TOKEN = "bench-user-token-0000"
JOB_BODY = {"name": "bench", "gpus": 1, "dataset": "ds0", "epochs": 1, "ideal_throughput": 100e6}

BARE_APP = textwrap.dedent(
    """
    # The reference: FastAPI + pydantic + SQLAlchemy doing the same database work as silod's
    # POST /v1/jobs (one row in `jobs`) and GET /v1/jobs/{id} (that row by id), nothing else.
    import os, socket, time
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel
    from sqlalchemy import insert, select
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from scheduler.service.db.engine import make_engine
    from scheduler.service.db.models import Job, JobState

    class NoDelayH11(H11Protocol):
        # uvicorn's sockets for --workers N leave Nagle on (asyncio sets TCP_NODELAY only when
        # the socket's proto is IPPROTO_TCP; theirs is 0), so each response's body waited ~40 ms
        # for the client's delayed ACK. silod turns it off (http_guard/timeouts.py); the
        # reference does the same, or every low-concurrency cell would compare against 40 ms.
        def connection_made(self, transport):
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)

    engine = make_engine(os.environ["BARE_DB"])
    app = FastAPI()
    jobs = Job.__table__

    class JobIn(BaseModel):
        name: str
        gpus: int
        dataset: str
        epochs: float
        ideal_throughput: float

    @app.post("/v1/jobs", status_code=201)
    def post(body: JobIn) -> dict:
        row = dict(name=body.name, owner="bench", gpus=body.gpus, dataset_id=1, model=None,
                   ideal_throughput=body.ideal_throughput, epochs=body.epochs, steps=None, step_bytes=None,
                   total_bytes=body.epochs * 50e9, consumed_bytes=0.0, priority=0, state=JobState.QUEUED,
                   submit_time=time.time(), start_time=None, finish_time=None, message="")
        with engine.begin() as c:
            jid = c.execute(insert(jobs).values(**row)).inserted_primary_key[0]
        return {"id": str(jid), **row, "state": "queued"}

    @app.get("/v1/jobs/{job_id}")
    def get(job_id: int) -> dict:
        with engine.connect() as c:
            r = c.execute(select(jobs).where(jobs.c.id == job_id)).mappings().first()
        if r is None:
            raise HTTPException(404)
        return {**r, "id": str(r["id"])}

    @app.get("/healthz")
    def health() -> dict:
        return {"status": "ok"}

    def make_app():
        return app
    """
)

WRK_POST = """
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {token}"
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, probe: str = "/healthz", limit_s: float = 90) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}{probe}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url}{probe} did not answer 200 in {limit_s:.0f} s")


def prepare_db(path: Path, active: int) -> None:
    """A migrated SQLite file with 20 datasets and `active` queued jobs of tenant `bench`
    (bulk-inserted: the benchmark measures requests, not the preload)."""
    from sqlalchemy import insert

    from scheduler.service.db import open_database
    from scheduler.service.db.models import Dataset, Job, JobState

    engine = open_database(f"sqlite:///{path}")
    now = time.time()
    with engine.begin() as c:
        c.execute(insert(Dataset), [dict(name=f"ds{d}", uri=f"s3://bench/ds{d}", size=(50 + 70 * d) * 1e9, item_count=None,
                                         owner="bench", created_at=now, credential_id=None) for d in range(20)])
        rows = [dict(name=f"pre-{i}", owner="bench", gpus=1 + i % 8, dataset_id=1 + i % 20, model=None,
                     ideal_throughput=(20 + i % 100) * 1e6 * (1 + i % 8), epochs=1 + i % 5, steps=None, step_bytes=None,
                     total_bytes=(1 + i % 5) * 50e9, consumed_bytes=0.0, priority=0, state=JobState.QUEUED,
                     submit_time=now + i * 1e-3, start_time=None, finish_time=None, message="") for i in range(active)]
        for i in range(0, len(rows), 2000):
            c.execute(insert(Job), rows[i:i + 2000])
    engine.dispose()


def start_silod(tmp: Path, db: Path, workers: int) -> tuple[subprocess.Popen, str]:
    (tmp / "tokens").write_text(f"bench:{USER_TOKEN}\n")
    port = _port()
    cmd = [sys.executable, "-c", "from scheduler.cli import main; main()", "serve", "--listen", f"127.0.0.1:{port}",
           "--db", f"sqlite:///{db}", "--backend", "null", "--gpus", "256", "--gpus-per-node", "8", "--cache", "20TB",
           "--remote-io", "10GB/s", "--policy", "fifo", "--tokens", str(tmp / "tokens"), "--round", "360",
           "--workers", str(workers), "--state-dir", str(tmp / "state"), "--log-level", "warning",
           # One tenant holds `active` jobs and submits more: the default quota (1,000 waiting) and
           # object limit (10,000 active) would refuse them; the benchmark measures requests.
           "--default-quota", "queued=none", "--object-limits", "jobs=10000000"]
    proc = subprocess.Popen(cmd, env={**os.environ, "SILOD_ADMIN_TOKEN": ADMIN}, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "silod.log", "ab"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    # Ready, not only healthy: until its scheduling process has compiled (or loaded) the policies'
    # kernels and taken the lease, it burns a core beside the API workers, and the first cells
    # (POST at 16 and 64 clients) measured silod's start-up instead of its requests.
    _wait_healthy(url, proc, "/readyz", limit_s=300)
    return proc, url


def start_bare(tmp: Path, db: Path, workers: int, listeners: str) -> tuple[subprocess.Popen, str]:
    """The reference app. `listeners`: "per-worker" serves it as `silod serve` serves its API (each
    worker on its own SO_REUSEPORT socket, scheduler/service/api_workers.py), so the ratios compare
    the apps' work; "shared" is plain `uvicorn --workers N` (one socket that the first worker to
    wake drains)."""
    (tmp / "bare_app.py").write_text(BARE_APP)
    port = _port()
    env = {**os.environ, "BARE_DB": f"sqlite:///{db}", "PYTHONPATH": f"{tmp}{os.pathsep}{Path(__file__).resolve().parent.parent}"}
    if listeners == "shared":
        cmd = [sys.executable, "-m", "uvicorn", "bare_app:app", "--host", "127.0.0.1", "--port", str(port),
               "--workers", str(workers), "--log-level", "warning", "--no-access-log", "--http", "bare_app:NoDelayH11"]
    else:
        cmd = [sys.executable, "-c",
               "import sys, bare_app\n"
               "from scheduler.service.api_workers import ApiWorkerPool, WorkerSpec\n"
               f"ApiWorkerPool(WorkerSpec('bare_app:make_app', '127.0.0.1', {port}, 'warning', bare_app.NoDelayH11), {workers}).run()"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "bare.log", "ab"), cwd=tmp,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc)
    return proc, url


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    m = re.match(r"([0-9.]+)(us|ms|s|m)$", text.strip())
    if not m:
        raise ValueError(f"cannot read wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(url: str, path: str, clients: int, seconds: float, token: str, tmp: Path, post: bool) -> dict:
    cmd = ["wrk", "-t", "2", "-c", str(clients), "-d", f"{max(int(seconds), 1)}s", "--timeout", "30s", "--latency"]
    if post:
        script = tmp / "post.lua"
        script.write_text(WRK_POST.format(body=json.dumps(JOB_BODY), token=token))
        cmd += ["-s", str(script)]
    else:
        cmd += ["-H", f"Authorization: Bearer {token}"]
    out = subprocess.run([*cmd, url + path], capture_output=True, text=True, timeout=seconds + 120).stdout
    lat = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)\s*$", out, re.M))
    rps = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: (.*)$", out, re.M)
    if "99" not in lat or rps is None:
        raise SystemExit(f"wrk output not understood:\n{out}")
    return {"p50_ms": _ms(lat["50"]), "p99_ms": _ms(lat["99"]), "requests_per_s": float(rps.group(1)),
            "non_2xx": int(bad.group(1)) if bad else 0, "socket_errors": errors.group(1) if errors else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--active", type=int, default=10_000, help="active jobs in the database before the run")
    ap.add_argument("--clients", default="16,64,256")
    ap.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn workers, for silod and the bare app alike")
    ap.add_argument("--out", type=Path, default=Path("out/bench_api.json"))
    ap.add_argument("--bare-listeners", choices=("per-worker", "shared"), default="per-worker",
                    help="the reference's workers each on their own socket as silod's are (default), or plain "
                         "uvicorn --workers sharing one")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("benchmarks/bench_api.py needs wrk (apt-get install wrk)")
    clients = [int(c) for c in args.clients.split(",")]
    results: dict = {"active_jobs": args.active, "workers": args.workers, "seconds": args.seconds,
                     "bare_listeners": args.bare_listeners,
                     "cpu_count": os.cpu_count(), "load_generator": "wrk 2 threads, closed loop", "load": {}}
    with tempfile.TemporaryDirectory(prefix="silod-bench-") as tmpdir:
        tmp = Path(tmpdir)
        prepare_db(tmp / "silod.db", args.active)
        shutil.copy(tmp / "silod.db", tmp / "bare.db")
        silod, silod_url = start_silod(tmp, tmp / "silod.db", args.workers)
        bare, bare_url = start_bare(tmp, tmp / "bare.db", args.workers, args.bare_listeners)
        try:
            get_path = f"/v1/jobs/{args.active // 2}"
            for what, path, post in (("POST /v1/jobs", "/v1/jobs", True), ("GET /v1/jobs/{id}", get_path, False)):
                for n in clients:
                    s = wrk(silod_url, path, n, args.seconds, USER_TOKEN, tmp, post)
                    b = wrk(bare_url, path, n, args.seconds, "unused", tmp, post)
                    ratio = s["p99_ms"] / b["p99_ms"]
                    p50 = s["p50_ms"] / b["p50_ms"]
                    rate = s["requests_per_s"] / b["requests_per_s"]
                    results["load"][f"{what} c={n}"] = {
                        "silod": s, "bare": b, "ratio_p99": ratio, "target_ratio_p99": 1.5, "ratio_p50": p50,
                        "target_ratio_p50": 1.25, "ratio_throughput": rate, "target_ratio_throughput": 0.8,
                        "load_average": os.getloadavg()[0]}
                    print(f"{what:18s} c={n:3d}: silod p50 {s['p50_ms']:7.1f} ms p99 {s['p99_ms']:7.1f} ms "
                          f"{s['requests_per_s']:7.0f} req/s (non-2xx {s['non_2xx']}) | bare p50 {b['p50_ms']:7.1f} ms "
                          f"p99 {b['p99_ms']:7.1f} ms {b['requests_per_s']:7.0f} req/s | ratios p50 {p50:.2f}x (<= 1.25) "
                          f"p99 {ratio:.2f}x (<= 1.5) throughput {rate:.2f}x (>= 0.8) | load {os.getloadavg()[0]:.1f}",
                          flush=True)
            # 2. A round over every active job, back to back, while GETs run.
            active = httpx.get(f"{silod_url}/v1/cluster", headers={"Authorization": f"Bearer {ADMIN}"}).json()["jobs"]
            idle = wrk(silod_url, get_path, 64, args.seconds, USER_TOKEN, tmp, False)
            stop = threading.Event()
            rounds: list[dict] = []

            def force_rounds() -> None:
                with httpx.Client(base_url=silod_url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300) as c:
                    while not stop.is_set():
                        r = c.post("/v1/rounds")
                        if r.status_code == 200:
                            rounds.append(r.json())

            t = threading.Thread(target=force_rounds, daemon=True)
            t.start()
            time.sleep(0.5)
            busy = wrk(silod_url, get_path, 64, args.seconds, USER_TOKEN, tmp, False)
            stop.set()
            t.join(300)
            ratio = busy["p99_ms"] / idle["p99_ms"]
            durations = [r["duration_s"] for r in rounds]
            results["rounds_under_load"] = {
                "jobs_by_state": active, "rounds_during_measurement": len(rounds),
                "round_duration_s": {"min": min(durations, default=0), "max": max(durations, default=0)},
                "round_active_jobs": max((r["active"] for r in rounds), default=0),
                "get_idle": idle, "get_during_rounds": busy, "ratio_p99": ratio, "target_ratio_p99": 1.2,
            }
            print(f"GET c=64 with rounds back to back ({len(rounds)} rounds over "
                  f"{results['rounds_under_load']['round_active_jobs']} active jobs, "
                  f"{min(durations, default=0):.2f}-{max(durations, default=0):.2f} s each): p99 {busy['p99_ms']:.1f} ms vs "
                  f"{idle['p99_ms']:.1f} ms idle; ratio {ratio:.2f}x (target <= 1.2x)", flush=True)
        finally:
            for p in (silod, bare):
                try:
                    os.killpg(p.pid, 15)
                    p.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, 9)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
