"""The web view keeps history and explains itself (issue 48, Build item 5), in a real headless
Chromium as tests/test_observability.py runs it.

- History: the caller's own ended jobs (finished, failed, cancelled), newest first, paged (10 a
  page), with the wait, the JCT and what bound them: the model's diagnosis of the last round they
  ran in (stored by each round, migration 0011), else the last measured; another tenant's never.
- Detail: a job's allocation (now and over time: GET /v1/jobs/{id}/allocations, its owner's
  only), hit ratio, throughput against f* and the diagnosis, opened by a
  click or by a `#job=ID` link (what this test uses: headless --dump-dom cannot click).
- The chart: a time axis and share labels; the GPU line drawn last (on top) so a 100% cache line
  cannot hide it; "0 B/s" of remote IO beside a cached dataset says the job reads from cache.

The server is the real `silod serve` with the null backend (jobs start without running anything,
so nothing is measured: what bound a job that ran is the model's last diagnosis; one that never ran
says "not diagnosed").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sdk_helpers import Served
from test_observability import _chromium  # noqa: E402 - the same browser

ROOT = Path(__file__).resolve().parent.parent
SILOD = [sys.executable, "-m", "scheduler"]
ADMIN = "hist-admin-token-0123456789"
ALICE = "hist-alice-token-0123456789"
BOB = "hist-bob-token-0123456789ab"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hist")
    serve = Served(root, "--gpus", "8", "--gpus-per-node", "8", "--cache", "1TB", "--remote-io", "1GB/s",
                   "--policy", "fifo", "--round", "1h", tokens={"alice": ALICE, "bob": BOB}, admin=ADMIN,
                   env={"XDG_STATE_HOME": str(root / "xdg")}, ready="/readyz")
    base = serve.url
    try:
        def call(method, token, path, body=None):
            r = httpx.request(method, f"{base}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert r.status_code in (200, 201, 202), r.text
            return r.json()

        call("POST", ALICE, "/v1/datasets", {"name": "imagenet", "uri": "s3://b/imagenet", "size": "100GB"})
        call("POST", BOB, "/v1/datasets", {"name": "bobs", "uri": "s3://b/bobs", "size": "10GB"})
        ran = call("POST", ALICE, "/v1/jobs", {"name": "ran-then-cancelled", "gpus": 8, "dataset": "imagenet",
                                                 "epochs": 1, "ideal_throughput": "100MB/s"})
        deadline = time.monotonic() + 60
        while call("GET", ALICE, f"/v1/jobs/{ran['id']}")["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        # 11 jobs that never start (the 8 GPUs are taken), cancelled: 12 ended jobs, two pages.
        waiting = [call("POST", ALICE, "/v1/jobs", {"name": f"never-{i}", "gpus": 8, "dataset": "imagenet", "epochs": 1,
                                                    "ideal_throughput": "100MB/s"})["id"] for i in range(11)]
        bobs = call("POST", BOB, "/v1/jobs", {"name": "bob-secret", "gpus": 8, "dataset": "bobs", "epochs": 1,
                                             "ideal_throughput": "10MB/s"})["id"]
        # A round has seen bob's job (queued: a row with no GPUs) before it is cancelled; the
        # rounds run on submissions, but not necessarily within a fixed sleep on a loaded machine.
        deadline = time.monotonic() + 60
        while not call("GET", BOB, f"/v1/jobs/{bobs}/allocations"):
            assert time.monotonic() < deadline, "no round saw bob's queued job in 60 s"
            time.sleep(0.3)
        time.sleep(1.0)  # the running job's JCT is at least a second
        for jid in [*waiting, ran["id"]]:  # the waiting ones first: none of them ever starts
            call("DELETE", ALICE, f"/v1/jobs/{jid}")
        call("DELETE", BOB, f"/v1/jobs/{bobs}")
        live = call("POST", ALICE, "/v1/jobs", {"name": "live", "gpus": 2, "dataset": "imagenet", "epochs": 1,
                                                "ideal_throughput": "100MB/s"})
        deadline = time.monotonic() + 60
        while call("GET", ALICE, f"/v1/jobs/{live['id']}")["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        yield {"base": base, "root": root, "ran": ran["id"], "waiting": waiting, "bob": bobs, "live": live["id"],
               "call": call}
    finally:
        serve.stop()


def _dom(server, url_fragment: str, profile: str) -> str:
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={server['root'] / profile}", "--virtual-time-budget=10000",
         "--dump-dom", f"{server['base']}/ui#{url_fragment}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _cells(html: str) -> list[str]:
    return re.findall(r"<td[^>]*>(.*?)</td>", html, re.S)


def test_history_lists_the_tenants_ended_jobs_newest_first_paged(server):
    dom = _dom(server, f"token={ALICE}", "alice")
    table = re.search(r'<table id="history">(.*?)</table>', dom, re.S)
    assert table, dom[-3000:]
    rows = re.findall(r'<tr data-job-id="(\d+)"[^>]*>(.*?)</tr>', table.group(1), re.S)
    ended = [server["ran"], *server["waiting"]]
    assert [jid for jid, _ in rows] == sorted(ended, key=int, reverse=True)[:10]  # page 1: the 10 newest
    assert f'data-job-id="{server["bob"]}"' not in dom and "bob-secret" not in dom
    never = dict(rows)[server["waiting"][-1]]
    assert _cells(never)[3:] == ["cancelled", "8", "imagenet", "never started", _cells(never)[7], "not diagnosed", _cells(never)[9]]
    assert re.search(r'<button id="older" type="button">', dom)  # enabled: 12 ended jobs
    # Page 2 (what "older" loads): the oldest two, the one that ran with its wait and JCT.
    older = server["call"]("GET", ALICE, "/v1/jobs?state=ended&limit=11&offset=10")
    assert [j["id"] for j in older] == sorted(ended, key=int, reverse=True)[10:]
    ran = next(j for j in older if j["id"] == server["ran"])
    assert ran["start_time"] is not None and ran["finish_time"] - ran["submit_time"] >= 1.0
    # What bound it: the model's diagnosis of the last round it ran in (8 GPUs at 100 MB/s of f* on
    # a 1 GB/s link: its GPUs), kept after it ended although nothing measured it.
    assert ran["last_bound"] == "gpu" and ran["last_predicted_throughput"] > 0


def _detail(server, job_id: str, profile: str) -> tuple[str, dict[str, str]]:
    """The web view opened on a job's detail (`#job=ID`): the DOM and the detail's fields."""
    dom = _dom(server, f"token={ALICE}&job={job_id}", profile)
    detail = re.search(r'<section id="detail"([^>]*)>(.*?)</section>', dom, re.S)
    assert detail and "hidden" not in detail.group(1), dom[-3000:]
    fields = dict(re.findall(r'<tr data-field="([^"]+)"><td>[^<]*</td><td>(.*?)</td></tr>', detail.group(2)))
    return dom, fields


def test_an_ended_jobs_detail_shows_the_models_last_bound(server):
    dom, fields = _detail(server, server["ran"], "alice-ended")
    assert fields["bound by"] == "gpu (model, last round it ran)"
    assert fields["predicted throughput"] == "100.0 MB/s (last round it ran)"


def test_a_job_link_opens_its_detail(server):
    dom, fields = _detail(server, server["live"], "alice-detail")
    assert fields["GPUs held"] == "2 of 2, share 100%"
    assert fields["f* declared / planned"] == "100.0 MB/s / 100.0 MB/s"
    assert fields["bound by"].endswith("(model, now)")
    assert fields["JCT"] == "running" and fields["hit ratio (measured)"] == "–"
    # Its allocation over time (GET /v1/jobs/{id}/allocations): the round that started it gave it 2 GPUs.
    changes = {r: _cells(html) for r, html in re.findall(
        r'<tr data-resource="([^"]+)">(.*?)</tr>', re.search(r'<table id="detail-allocations">(.*?)</table>', dom, re.S).group(1), re.S)}
    assert changes["gpus"][2:] == ["gpus", "–", "2"], changes
    assert changes["running"][2:] == ["running", "–", "running"], changes


def test_a_jobs_allocation_history_is_its_owners_only(server):
    """GET /v1/jobs/{id}/allocations: alice reads her job's changes, from its start to its release;
    bob cannot read them (404, as for the job itself), nor alice bob's; the admin can."""
    ran = server["call"]("GET", ALICE, f"/v1/jobs/{server['ran']}/allocations")
    assert ran and all(c["subject_kind"] == "job" and c["subject"] == server["ran"] for c in ran)
    gpus = [(c["old_value"], c["new_value"]) for c in ran if c["resource"] == "gpus"]
    assert gpus == [(8.0, 0.0), (None, 8.0)]  # newest first: released when cancelled, given 8 at its start
    assert [c["id"] for c in ran] == sorted((c["id"] for c in ran), reverse=True)
    for token, jid in ((BOB, server["ran"]), (BOB, server["live"]), (ALICE, server["bob"])):
        r = httpx.get(f"{server['base']}/v1/jobs/{jid}/allocations", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 404 and "subject" not in r.text, r.text  # no change of it leaks
    r = httpx.get(f"{server['base']}/v1/jobs/not-a-job/allocations", headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
    assert r.status_code == 404
    assert r.json()  # a JSON error, naming the id
    assert server["call"]("GET", ADMIN, f"/v1/jobs/{server['ran']}/allocations") == ran
    from silod_client import Client
    from silod_client.errors import NotFound

    with Client(server["base"], ALICE) as sdk:  # the SDK's method for the route reads the same
        assert [c.model_dump() for c in sdk.jobs.allocations(server["ran"])] == ran
    with Client(server["base"], BOB) as sdk, pytest.raises(NotFound):
        sdk.jobs.allocations(server["ran"])
    bobs = server["call"]("GET", BOB, f"/v1/jobs/{server['bob']}/allocations")  # his own: held, never running
    assert bobs and {c["subject"] for c in bobs} == {server["bob"]}
    assert all(c["new_value"] in (0.0, None) for c in bobs if c["resource"] in ("gpus", "running"))


def test_the_chart_has_axes_and_the_gpu_line_on_top_and_a_zero_io_cap_reads_as_cached(tmp_path):
    """ui.js's chart and IO-cap wording, run by Chromium on a page that feeds them a made-up
    overview (the server's history has no 100% lines to draw)."""
    ui = ROOT / "scheduler" / "service" / "api" / "ui" / "ui.js"
    page = tmp_path / "chart.html"
    history = [{"time": 1_700_000_000 + 2 * i, "gpus_used": 8, "cache_allocated": 1e12, "remote_io_allocated": 5e8}
               for i in range(5)]
    overview = {"gpus_total": 8, "cache_total": 1e12, "remote_io_total": 1e9}
    jobs = {"cached": {"remote_io": 0, "cache_bytes": 1e11, "dataset_bytes": 1e11},
            "partly": {"remote_io": 0, "cache_bytes": 7e10, "dataset_bytes": 1e11},
            "capped": {"remote_io": 5e7, "cache_bytes": 0, "dataset_bytes": 1e11},
            "unmanaged": {"remote_io": None, "cache_bytes": None, "dataset_bytes": 1e11}}
    page.write_text(f"""<!doctype html><html><body>
<svg id="chart" viewBox="0 0 640 160"></svg><pre id="out"></pre>
<script src="{ui.as_uri()}"></script>
<script>
chart({json.dumps(history)}, {json.dumps(overview)});
const jobs = {json.dumps(jobs)};
document.getElementById("out").textContent = JSON.stringify(Object.fromEntries(Object.entries(jobs).map(([k, j]) => [k, ioCap(j)])));
</script></body></html>""")
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={tmp_path / 'profile'}", "--allow-file-access-from-files",
                           "--virtual-time-budget=2000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    series = re.findall(r'<polyline[^>]*data-series="(\w+)"', dom)
    assert series == ["cache", "io", "gpu"], dom  # the GPU line is drawn last: on top
    cache_line = re.search(r'<polyline[^>]*data-series="cache"[^>]*>', dom).group(0)
    assert 'stroke-dasharray="6 4"' in cache_line  # dashed: the GPU line shows through it
    labels = re.findall(r'<text[^>]*class="axis"[^>]*>([^<]+)</text>', dom)
    assert {"0%", "50%", "100%"} <= set(labels)
    assert sum(1 for t in labels if re.fullmatch(r"\d{1,2}:\d{2}:\d{2}( [AP]M)?", t)) == 3, labels  # a time axis
    out = json.loads(re.search(r'<pre id="out">(.*?)</pre>', dom, re.S).group(1).replace("&quot;", '"'))
    assert out == {"cached": "0 B/s (dataset cached)", "partly": "0 B/s (cached items only)",
                   "capped": "50.0 MB/s", "unmanaged": "not managed"}


@pytest.mark.parametrize("limit", ["0", "-1", "10001", "many", "1e3"])
def test_a_jobs_allocation_history_refuses_a_bad_limit(server, limit):
    r = httpx.get(f"{server['base']}/v1/jobs/{server['live']}/allocations", params={"limit": limit},
                  headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
    assert r.status_code == 422 and "limit" in r.text, r.text
