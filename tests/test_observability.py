"""Watching the cluster: GET /v1/overview, the web view at /ui (in a real headless Chromium),
`silod top --once`, the per-job and per-dataset gauges of /metrics, and the Grafana dashboard in
deploy/ checked against the metrics a running `silod serve` really exports.

The server is the real `silod serve` (API worker + scheduling process, SQLite) with the null
backend, which starts jobs without running anything: the allocations, positions and reasons are
the scheduler's own. Two tenants share it; each must see only its own jobs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from scheduler.service.overview import QUOTA_REASON, wait_reason
from sdk_helpers import Served

ROOT = Path(__file__).resolve().parent.parent
SILOD = [sys.executable, "-m", "scheduler"]
ADMIN = "obs-admin-token-0123456789"
ALICE = "obs-alice-token-0123456789"
BOB = "obs-bob-token-0123456789ab"
DASHBOARD = ROOT / "deploy" / "grafana" / "silod-dashboard.json"


# ---------------------------------------------------------------- pure parts


def test_wait_reason_names_what_is_missing():
    assert wait_reason(8, 2, False, 0, "fifo") == "needs 8 GPUs, 2 free"
    assert "3 later job(s) started on free GPUs (backfilling)" in wait_reason(8, 2, False, 3, "fifo")
    assert "quota" in wait_reason(1, 8, True, 0, "fifo")
    assert "next round" in wait_reason(1, 8, False, 0, "gavel")
    # A job the backend holds back because no node can take it says why (it is no quota's doing).
    why = "unschedulable: kube-scheduler cannot bind its pods (0/1 nodes are available: 1 Insufficient memory.)"
    assert wait_reason(1, 8, True, 0, "gavel", message=why) == why
    assert wait_reason(1, 8, True, 0, "gavel", message="preempted") == QUOTA_REASON


def diagnosis(ideal, gpus, remote_io, cache, size, cores, cpu_rate, link):
    """(predicted throughput, bound) by the one diagnosis every view reads, nothing measured."""
    from scheduler.service.diagnosis import diagnose_jobs, diagnosis_input

    i = diagnosis_input(ideal, cpu_rate, gpus, remote_io, cores, cache, size, None, None, None, None, None, None, None, None, None, None, None, None, 0.0)
    b = diagnose_jobs([i], link)[0]
    return b.throughput, b.bound


def test_diagnosis_follows_silodperf():
    GB, MB, inf = 1e9, 1e6, float("inf")
    # f* 100 MB/s; half the dataset cached and 40 MB/s of remote IO: b/(1-c/d) = 80 MB/s < f*
    perf, bound = diagnosis(100 * MB, 1, 40 * MB, 50 * GB, 100 * GB, None, None, link=1 * GB)
    assert perf == pytest.approx(80 * MB) and bound in ("cache", "remote_io")
    assert diagnosis(100 * MB, 1, 60 * MB, 50 * GB, 100 * GB, None, None, link=1 * GB) == (pytest.approx(100 * MB), "gpu")
    assert diagnosis(100 * MB, 1, 0.0, 100 * GB, 100 * GB, None, None, link=1 * GB)[1] == "gpu"  # all cached
    # unmanaged IO is the whole link; 2 cores at 20 MB/s each bound it at 40 MB/s
    assert diagnosis(100 * MB, 1, None, 0.0, 100 * GB, 2.0, 20 * MB, link=1 * GB) == (pytest.approx(40 * MB), "cpu")
    assert diagnosis(100 * MB, 1, None, 0.0, 100 * GB, inf, None, link=1 * GB)[1] == "gpu"


def test_top_render_fits_80_columns():
    from rich.console import Console

    from scheduler.service.top import render

    long = "a-very-long-name-" * 5
    o = {"policy": "gavel", "running_total": 1, "queued_total": 1, "time": 0.0, "gpus_used": 4, "gpus_total": 16,
         "cache_allocated": 1.5e12, "cache_total": 2e12, "remote_io_allocated": 9.9e8, "remote_io_total": 1e9,
         "history": [{"time": float(t), "gpus_used": float(t % 17)} for t in range(200)],
         "running": [{"id": "123456", "name": long, "gpus": 8, "cache_bytes": 1.36e12, "remote_io": 4.5e8,
                      "hit_ratio": 0.4567, "throughput": 8.1e8, "ideal_throughput": 9.12e8, "progress": 0.5,
                      "bound": "remote_io"}],
         "queue": [{"position": 1, "id": "123457", "name": long, "gpus": 16,
                    "reason": wait_reason(16, 8, False, 12, "gavel")}],
         "datasets": [{"name": long, "owner": long, "size": 1.36e12, "allocated": 1e12, "cached": 5e11}]}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(render(o))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    row = next(line.split() for line in lines if line.strip().startswith("123456"))
    assert row[-1] == "IO" and "46%" in row and "912MB/s" in row and "1.36TB" in row, row
    assert "needs 16 GPUs, 8 free; 12 later job(s) started on free GPUs" in " ".join(text.split())
    # the link: what was allocated (a cap) apart from what the jobs were measured reading
    flat = " ".join(text.split())
    assert "remote IO allocated 990MB/s of 1GB/s" in flat and "measured read 810MB/s" in flat, flat
    assert "IO alloc" in flat and "IO cap" not in flat


def test_top_says_why_nothing_schedules():
    from rich.console import Console

    from scheduler.service.top import render

    o = {"policy": "gavel", "running_total": 0, "queued_total": 1, "time": 0.0, "gpus_used": 0, "gpus_total": 8,
         "cache_allocated": 0.0, "cache_total": 2e12, "remote_io_allocated": 0.0, "remote_io_total": 1e9, "history": [],
         "running": [], "datasets": [], "scheduling": "scheduler starting: compiling policy kernels, 12 s",
         "queue": [{"position": 1, "id": "1", "name": "j", "gpus": 1,
                    "reason": wait_reason(1, 8, False, 0, "gavel", "scheduler starting: compiling policy kernels, 12 s")}]}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(render(o))
    flat = " ".join(console.export_text().split())
    assert "scheduler starting: compiling policy kernels, 12 s" in flat
    assert "gave it no share" not in flat and "measured read -" in flat


# ---------------------------------------------------------------- a real server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`silod serve` with two tenants: alice has a running 6-GPU job and a waiting 8-GPU job,
    bob a running 1-GPU job (it starts after alice's 8-GPU job waits: backfilling)."""
    root = tmp_path_factory.mktemp("obs")
    serve = Served(root, "--gpus", "8", "--gpus-per-node", "8", "--cache", "1TB", "--remote-io", "1GB/s",
                   "--policy", "fifo", "--round", "1h", tokens={"alice": ALICE, "bob": BOB}, admin=ADMIN,
                   env={"XDG_STATE_HOME": str(root / "xdg")})
    base = serve.url
    try:
        def post(token, path, body):
            r = httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert r.status_code in (200, 201), r.text
            return r.json()

        post(ALICE, "/v1/datasets", {"name": "imagenet", "uri": "s3://b/imagenet", "size": "100GB"})
        post(BOB, "/v1/datasets", {"name": "bobs-data", "uri": "s3://b/bob", "size": "10GB"})
        big = post(ALICE, "/v1/jobs", {"name": "alice-r50", "gpus": 6, "dataset": "imagenet", "epochs": 2,
                                       "ideal_throughput": "100MB/s"})
        _wait_for(base, ADMIN, lambda o: any(j["id"] == big["id"] for j in o["running"]))
        waiting = post(ALICE, "/v1/jobs", {"name": "alice-gang", "gpus": 8, "dataset": "imagenet", "epochs": 1,
                                           "ideal_throughput": "100MB/s"})
        small = post(BOB, "/v1/jobs", {"name": "bob-small", "gpus": 1, "dataset": "bobs-data", "epochs": 1,
                                       "ideal_throughput": "50MB/s"})
        _wait_for(base, ADMIN, lambda o: any(j["id"] == small["id"] for j in o["running"])
                  and any(q["id"] == waiting["id"] for q in o["queue"]) and len(o["history"]) >= 2)
        yield {"base": base, "running": big["id"], "waiting": waiting["id"], "bob": small["id"], "root": root}
    finally:
        serve.stop()


def _overview(base: str, token: str) -> dict:
    r = httpx.get(f"{base}/v1/overview", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(base: str, token: str, check, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        o = _overview(base, token)
        if check(o):
            return o
        assert time.monotonic() < deadline, json.dumps(o, indent=1)
        time.sleep(0.3)


def test_overview_needs_a_token(server):
    assert httpx.get(f"{server['base']}/v1/overview", timeout=30).status_code == 401


def test_overview_shows_position_reason_and_allocation_to_the_owner_only(server):
    alice = _overview(server["base"], ALICE)
    assert [q["id"] for q in alice["queue"]] == [server["waiting"]]
    q = alice["queue"][0]
    assert q["position"] == 1
    assert q["reason"] == "needs 8 GPUs, 1 free; 1 later job(s) started on free GPUs (backfilling)"
    (run,) = alice["running"]
    assert run["id"] == server["running"] and run["gpus"] == 6
    assert run["cache_bytes"] == pytest.approx(100e9) and run["bound"] in ("gpu", "cpu", "cache", "remote_io")
    assert [d["name"] for d in alice["datasets"]] == ["imagenet"]
    assert alice["gpus_used"] == 7 and alice["running_total"] == 2  # cluster totals are everyone's
    bob = _overview(server["base"], BOB)
    assert [j["id"] for j in bob["running"]] == [server["bob"]] and bob["queue"] == []
    assert "alice" not in json.dumps(bob)
    admin = _overview(server["base"], ADMIN)
    assert {j["id"] for j in admin["running"]} == {server["running"], server["bob"]}


def test_metrics_export_per_job_and_per_dataset_gauges(server):
    assert "alice" not in httpx.get(f"{server['base']}/metrics", timeout=30).text  # anonymous: the totals only
    text = httpx.get(f"{server['base']}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    job = server["running"]
    assert re.search(rf'silod_job_gpus{{[^}}]*job="{job}"[^}}]*}} 6\.0', text)
    assert re.search(rf'silod_job_queue_position{{[^}}]*job="{server["waiting"]}"[^}}]*}} 1\.0', text)
    assert re.search(r'silod_job_cache_allocated_bytes{[^}]*name="alice-r50"[^}]*} 1e\+11', text)
    assert re.search(r'silod_dataset_cache_allocated_bytes{[^}]*dataset="imagenet"[^}]*} 1e\+11', text)
    assert re.search(r'silod_job_bound{[^}]*resource="(gpu|cpu|cache|remote_io)"', text)
    assert "silod_queue_length 1.0" in text
    assert re.search(r"silod_jobs_admitted_total 2\.0", text)


def _exported_names(text: str) -> set[str]:
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:{| )", text, re.MULTILINE))
    return names


def test_grafana_dashboard_uses_only_exported_metrics(server):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bsilod_[a-z0-9_]+", e)}
    exported = _exported_names(httpx.get(f"{server['base']}/metrics", headers={"Authorization": f"Bearer {ADMIN}"},
                                         timeout=30).text)
    assert used - exported == set(), f"the dashboard queries metrics /metrics does not export: {sorted(used - exported)}"
    # and it covers what the issue asks for: queue, admissions, per-job allocation and hit ratio, link, cache
    for needed in ("silod_queue_length", "silod_jobs_admitted_total", "silod_job_gpus", "silod_job_hit_ratio",
                   "silod_job_remote_io_allocated_bytes_per_second", "silod_remote_io_bytes_per_second_allocated",
                   "silod_cache_bytes_allocated", "silod_dataset_cached_bytes"):
        assert needed in used, needed


def test_grafana_panels_have_ids_and_tables_are_instant_one_row_per_job(server):
    """Grafana keys a panel by its id (links, alerts, reports), and a table panel over a range
    query shows one row per sample, not per job. Each table's query is evaluated, as an instant
    query is, on the real /metrics: one series per running (or waiting) job."""
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p.get("id") for p in dashboard["panels"]]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), ids
    text = httpx.get(f"{server['base']}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    admin = _overview(server["base"], ADMIN)
    tables = [p for p in dashboard["panels"] if p["type"] == "table"]
    assert {p["title"] for p in tables} == {"Per job: what bounds it", "Queue positions"}
    for panel in tables:
        (target,) = panel["targets"]
        assert target.get("instant") is True and target.get("range") is False and target.get("format") == "table", panel["title"]
        assert re.fullmatch(r"silod_[a-z_]+", target["expr"]), target["expr"]  # a bare selector: evaluated below
        jobs = [m.group(1) for m in re.finditer(rf'^{target["expr"]}{{[^}}]*\bjob="([^"]+)"', text, re.M)]
        want = admin["running"] if "bound" in target["expr"] else admin["queue"]
        assert sorted(jobs) == sorted(j["id"] for j in want) and len(jobs) == len(set(jobs)), (panel["title"], jobs)


def test_observability_doc_lists_every_gauge():
    from scheduler.service.api.metrics import BOUND_GAUGE, DATASET_GAUGES, JOB_GAUGES

    doc = (ROOT / "docs" / "observability.md").read_text()
    missing = [n for n in [*JOB_GAUGES, *DATASET_GAUGES, BOUND_GAUGE] if f"`{n}`" not in doc]
    assert not missing, missing


def test_top_once_shows_the_tenants_jobs_in_80_columns(server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update(SILOD_SERVER=server["base"], SILOD_TOKEN=ALICE)
    proc = subprocess.run([*SILOD, "top", "--once"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, proc.stdout
    assert "alice-r50" in proc.stdout and "needs 8 GPUs, 1 free" in proc.stdout
    assert "bob-small" not in proc.stdout


def test_top_with_a_bad_token_is_one_line(server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update(SILOD_SERVER=server["base"], SILOD_TOKEN="not-a-token")
    proc = subprocess.run([*SILOD, "top", "--once"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1


def test_ui_is_served_without_cdn(server):
    page = httpx.get(f"{server['base']}/ui", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    script = httpx.get(f"{server['base']}/ui/ui.js", timeout=30)
    assert script.status_code == 200 and "/v1/overview" in script.text
    for body in (page.text, script.text):  # nothing from elsewhere: the only absolute URL is SVG's namespace
        assert set(re.findall(r"https?://[^\s\"')]+", body)) <= {"http://www.w3.org/2000/svg"}


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def _browser_dom(server, token: str) -> str:
    """The page as a real browser renders it: headless Chromium loads /ui with the token in the
    URL fragment (never sent to the server), runs ui.js, which fetches /v1/overview; the DOM is
    dumped once the page is idle."""
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={server['root'] / ('chromium-' + token[:8])}", "--virtual-time-budget=10000",
         "--dump-dom", f"{server['base']}/ui#token={token}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_web_view_in_a_real_browser_shows_only_the_tenants_jobs(server):
    dom = _browser_dom(server, ALICE)
    running = re.search(rf'<tr data-job-id="{server["running"]}">(.*?)</tr>', dom)
    assert running, dom[-3000:]
    cells = re.findall(r"<td>(.*?)</td>", running.group(1))
    assert cells[:5] == [server["running"], "alice-r50", "alice", "6", "imagenet"]
    assert cells[5] == "100.0 GB"  # the dataset's cache allocation
    waiting = re.search(rf'<tr data-job-id="{server["waiting"]}">(.*?)</tr>', dom)
    assert waiting and "needs 8 GPUs, 1 free" in waiting.group(1)
    assert "bob-small" not in dom and f'data-job-id="{server["bob"]}"' not in dom
    assert 'data-series="gpu"' in dom  # the utilisation chart has its lines


def test_web_view_rejects_a_bad_token(server):
    dom = _browser_dom(server, "not-a-valid-token")
    assert "the server did not accept that token" in dom
    assert "data-job-id" not in dom


def test_overview_measurements_from_the_data_manager_and_the_node_agents(tmp_path):
    """Hit ratio and throughput come from the data manager's status (summed over a job's mounts
    on every node); a job it does not know gets its hit ratio from the node agents' per-pod
    counters (Kubernetes), and one with neither shows none (not 0)."""
    from sqlalchemy.orm import sessionmaker

    from policies.types import ClusterCapacity
    from scheduler.service.db import open_database
    from scheduler.service.db.models import Dataset, Job, JobState, PodConsumption
    from scheduler.service.overview import build_overview, measurements_from_datamanager
    from scheduler.service.types import Principal

    sessions = sessionmaker(open_database(f"sqlite:///{tmp_path / 'o.db'}"), expire_on_commit=False)
    with sessions.begin() as s:
        d = Dataset(name="d", uri="s3://b/d", size=100e9, owner="alice", created_at=0.0)
        s.add(d)
        s.flush()
        for i in (1, 2, 3):
            s.add(Job(id=i, name=f"j{i}", owner="alice", gpus=1, dataset_id=d.id, ideal_throughput=1e8, epochs=1.0,
                      total_bytes=100e9, consumed_bytes=0.0, state=JobState.RUNNING, submit_time=float(i), message=""))
        s.flush()
        s.add(PodConsumption(node="n1", pod_uid="p3", job_id=3, agent="agent-n1", read_bytes=100, hit_bytes=25,
                             miss_bytes=75, hits=1, misses=3, first_at=0.0, updated_at=1.0))
    dm_status = {"nodes": {
        "n1": {"datasets": {"d": {"jobs": {"1": {"hit_bytes": 30, "miss_bytes": 10, "throughput_bytes_per_s": 5e7}}}}},
        "n2": {"datasets": {"d": {"jobs": {"1": {"hit_bytes": 10, "miss_bytes": 30, "throughput_bytes_per_s": 2e7}}}}},
    }}
    status = {"measured": {"time": 1.0, "jobs": measurements_from_datamanager(dm_status), "cached": {}}}
    o = build_overview(sessions, Principal("alice"), capacity=ClusterCapacity(gpus=8, cache=1e12, remote_io=1e9),
                       policy="fifo", status=status)
    by_id = {j.id: j for j in o.running}
    assert by_id["1"].hit_ratio == pytest.approx(0.5) and by_id["1"].throughput == pytest.approx(7e7)
    assert by_id["3"].hit_ratio == pytest.approx(0.25) and by_id["3"].throughput is None
    assert by_id["2"].hit_ratio is None and by_id["2"].throughput is None


def test_metrics_cap_the_series_of_a_deep_queue():
    from scheduler.service.api.metrics import MAX_WAITING_SERIES, overview_metrics
    from scheduler.service.overview import Overview, QueuedJob

    queue = tuple(QueuedJob(str(i), f"j{i}", "t", 1, "d", 0, float(i), i, "needs 1 GPUs, 0 free")
                  for i in range(1, MAX_WAITING_SERIES + 101))
    o = Overview(time=0.0, policy="fifo", gpus_total=1, gpus_used=1, cache_total=1.0, cache_allocated=0.0,
                 remote_io_total=1.0, remote_io_allocated=0.0, queued_total=len(queue), running_total=0,
                 queue=queue, running=(), datasets=())
    families = {m.name: m for m in overview_metrics(o)}
    positions = families["silod_job_queue_position"].samples
    assert len(positions) == MAX_WAITING_SERIES and max(s.value for s in positions) == MAX_WAITING_SERIES
    assert families["silod_queue_length"].samples[0].value == MAX_WAITING_SERIES + 100
