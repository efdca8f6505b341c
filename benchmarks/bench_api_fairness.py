"""Benchmark: one tenant's requests against another's load (issue 20, outside review).

Against `silod serve --workers 2` (null backend, 10,000 active jobs of tenant `bench`), tenant
`bob` reads his one job (`GET /v1/jobs/{id}`, one request every 0.2 s):

1. idle: the reference, measured in the same run;
2. while 32 wrk connections of `bench` list 10,000 jobs each (`GET /v1/jobs?limit=10000`);
3. once the listings are worked off, while 8 submissions of `bench` wait on a write transaction
   another process holds on the SQLite file for 10 s (4 GETs of bob's, started 1.5 s into it).

It prints bob's median and worst latency in each, and the ratios of 2 and 3 to 1. Before the
hot routes' threads were shared fairly (scheduler/service/api/fair_pool.py), 2 was a median of
4.9 s and 3 lasted until the lock's release (docs/benchmarks.md).

    .venv/bin/python benchmarks/bench_api_fairness.py [--seconds 18] [--out bench_api_fairness.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_api as b  # noqa: E402


def _bob_reads(url: str, job: int, headers: dict, seconds: float) -> list[float]:
    lat: list[float] = []
    with httpx.Client(timeout=120) as c:
        end = time.monotonic() + seconds
        while True:  # at least one read
            t0 = time.perf_counter()
            r = c.get(f"{url}/v1/jobs/{job}", headers=headers)
            assert r.status_code == 200, r.text
            lat.append(time.perf_counter() - t0)
            if time.monotonic() >= end:
                return lat
            time.sleep(0.2)


def _summary(lat: list[float]) -> dict:
    return {"n": len(lat), "median_s": statistics.median(lat), "max_s": max(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=18.0, help="bob's reads in the idle and listing phases")
    ap.add_argument("--out", type=Path, default=Path("out/bench_api_fairness.json"))
    args = ap.parse_args()
    if not 1.0 <= args.seconds <= 3600.0:  # wrk takes whole seconds; nan fails too
        ap.error(f"--seconds {args.seconds:g}: give the seconds of each phase, 1 to 3600 (e.g. 18)")
    if shutil.which("wrk") is None:
        raise SystemExit("benchmarks/bench_api_fairness.py needs wrk (apt-get install wrk)")
    with tempfile.TemporaryDirectory(prefix="silod-fair-") as tmpdir:
        tmp = Path(tmpdir)
        db = tmp / "silod.db"
        b.prepare_db(db, 10_000)
        proc, url = b.start_silod(tmp, db, 2)
        try:
            admin = {"Authorization": f"Bearer {b.ADMIN}"}
            bob = {"Authorization": "Bearer " + httpx.post(f"{url}/v1/tokens", json={"owner": "bob"}, headers=admin).json()["token"]}
            httpx.post(f"{url}/v1/datasets", json={"name": "d", "uri": "s3://b/d", "size": "1GB"}, headers=bob).raise_for_status()
            job = httpx.post(f"{url}/v1/jobs", json={**b.JOB_BODY, "dataset": "d"}, headers=bob).json()["id"]

            idle = _summary(_bob_reads(url, job, bob, args.seconds))

            lua = tmp / "auth.lua"
            lua.write_text(f'wrk.headers["Authorization"] = "Bearer {b.USER_TOKEN}"\n')
            wrk = subprocess.Popen(["wrk", "-t", "1", "-c", "32", "-d", f"{args.seconds + 7:.0f}s", "-s", str(lua),
                                    f"{url}/v1/jobs?limit=10000"], stdout=subprocess.PIPE, text=True)
            time.sleep(3)
            listing = _summary(_bob_reads(url, job, bob, args.seconds))
            wrk_out = wrk.communicate()[0]
            lists_per_s = next((float(line.split()[1]) for line in wrk_out.splitlines() if "Requests/sec" in line), None)
            # wrk has stopped, but the server still works off the listings it had accepted: wait
            # until bob's read is near idle again, so phase 3 measures the lock alone.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and _bob_reads(url, job, bob, 0)[0] > 5 * idle["median_s"] + 0.02:
                time.sleep(0.5)

            holder = sqlite3.connect(db, timeout=30)
            holder.execute("BEGIN IMMEDIATE")  # another process's write transaction
            codes: list[int] = []

            def submit(i: int) -> None:
                with httpx.Client(timeout=120) as c:
                    codes.append(c.post(f"{url}/v1/jobs", json={**b.JOB_BODY, "name": f"w{i}"},
                                        headers={"Authorization": f"Bearer {b.USER_TOKEN}"}).status_code)

            reads: list[float] = []

            def read() -> None:
                t0 = time.perf_counter()
                httpx.get(f"{url}/v1/jobs/{job}", headers=bob, timeout=120).raise_for_status()
                reads.append(time.perf_counter() - t0)

            writers = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
            readers = [threading.Thread(target=read) for _ in range(4)]
            for t in writers:
                t.start()
            time.sleep(1.5)
            for t in readers:
                t.start()
            time.sleep(8.5)
            holder.rollback()
            holder.close()
            for t in writers + readers:
                t.join(120)
            locked = _summary(reads)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    results = {"idle": idle, "during_listings": listing, "listings_per_s": lists_per_s,
               "while_submissions_wait_on_a_held_lock": locked, "submissions": codes,
               "ratio_listings_median": listing["median_s"] / idle["median_s"],
               "ratio_lock_median": locked["median_s"] / idle["median_s"]}
    for name in ("idle", "during_listings", "while_submissions_wait_on_a_held_lock"):
        r = results[name]
        print(f"bob's GET {name:40s} median {r['median_s'] * 1e3:8.1f} ms  max {r['max_s'] * 1e3:8.1f} ms  (n={r['n']})")
    print(f"ratios to idle (median): during listings {results['ratio_listings_median']:.1f}x, "
          f"behind the held lock {results['ratio_lock_median']:.1f}x; listings served {lists_per_s} /s; "
          f"submissions {codes}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
