"""One answer to "what bounds my job" (issue 48, Build item 3), on a live `silod serve`.

GET /v1/jobs/{id} (`bottleneck`), /metrics (`silod_job_bound`, the predicted throughput and
`silod_running_jobs_bound`), the web view /ui (rendered by a real headless Chromium) and
`silod top --once` must name the same resource for every running job, from the parameters
planning uses. The case that split them: a job declares f* 500 MB/s, which its IO (a 10 GB cache
of a 100 GB dataset, a 50 MB/s link) cannot feed, and then reports a step time that says its
GPUs consume 20 MB/s: planning (and the job view) used 20 MB/s, so the job was GPU-bound there,
while /metrics' per-job gauge, /ui and `silod top` diagnosed the declared 500 MB/s and said IO.

The server is the real `silod serve` (API worker + scheduling process, SQLite) with the null
backend (jobs start without running anything), as tests/test_observability.py runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from sdk_helpers import Served
from test_observability import _chromium  # noqa: E402 - the same browser

SILOD = [sys.executable, "-m", "scheduler"]
ADMIN = "diag-admin-token-0123456789"
ALICE = "diag-alice-token-0123456789"
MB = 1e6


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag")
    serve = Served(root, "--gpus", "8", "--gpus-per-node", "8", "--cache", "10GB", "--remote-io", "50MB/s",
                   "--policy", "fifo", "--round", "1h", tokens={"alice": ALICE}, admin=ADMIN,
                   env={"XDG_STATE_HOME": str(root / "xdg")}, ready="/readyz")
    base = serve.url
    h = {"Authorization": f"Bearer {ALICE}"}
    try:
        def post(path, body, status=(200, 201)):
            r = httpx.post(f"{base}{path}", json=body, headers=h, timeout=30)
            assert r.status_code in status, r.text
            return r.json()

        post("/v1/datasets", {"name": "big", "uri": "s3://b/big", "size": "100GB"})
        post("/v1/datasets", {"name": "small", "uri": "s3://b/small", "size": "1GB"})
        fast = post("/v1/jobs", {"name": "declared-fast", "gpus": 2, "dataset": "big", "epochs": 5,
                                 "ideal_throughput": "500MB/s"})
        light = post("/v1/jobs", {"name": "light", "gpus": 1, "dataset": "small", "epochs": 5,
                                  "ideal_throughput": "5MB/s"})
        ids = [fast["id"], light["id"]]
        deadline = time.monotonic() + 60
        while not all(httpx.get(f"{base}/v1/jobs/{i}", headers=h, timeout=30).json()["state"] == "running" for i in ids):
            assert time.monotonic() < deadline, serve.log_tail()
            time.sleep(0.3)
        yield {"base": base, "root": root, "fast": fast["id"], "light": light["id"], "post": post}
    finally:
        serve.stop()


def _api(demo) -> dict[str, tuple[str, float]]:
    r = httpx.get(f"{demo['base']}/v1/jobs", params={"state": "running"},
                  headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
    assert r.status_code == 200, r.text
    out = {}
    for j in r.json():
        one = httpx.get(f"{demo['base']}/v1/jobs/{j['id']}", headers={"Authorization": f"Bearer {ALICE}"}, timeout=30).json()
        assert one["bottleneck"] == j["bottleneck"]  # the list and the job agree
        out[j["id"]] = (one["bottleneck"]["bound"], one["bottleneck"]["throughput"])
    return out


def _metrics(demo) -> tuple[dict[str, tuple[str, float]], dict[str, int]]:
    text = httpx.get(f"{demo['base']}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    bound = {m.group(1): m.group(2) for m in re.finditer(
        r'^silod_job_bound\{[^}]*job="(\d+)"[^}]*resource="([a-z_]+)"[^}]*\} 1\.0$', text, re.M)}
    predicted = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^silod_job_predicted_throughput_bytes_per_second\{[^}]*job="(\d+)"[^}]*\} (\S+)$', text, re.M)}
    counts = {m.group(1): int(float(m.group(2))) for m in re.finditer(
        r'^silod_running_jobs_bound\{resource="([a-z_]+)"\} (\S+)$', text, re.M)}
    return {j: (bound[j], predicted[j]) for j in bound}, counts


def _ui(demo) -> dict[str, str]:
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={demo['root'] / 'chromium'}", "--virtual-time-budget=10000",
         "--dump-dom", f"{demo['base']}/ui#token={ALICE}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = {}
    for jid in (demo["fast"], demo["light"]):
        row = re.search(rf'<tr data-job-id="{jid}"[^>]*>(.*?)</tr>', proc.stdout, re.S)
        assert row, proc.stdout[-3000:]
        out[jid] = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1))[11]  # the bound column
    return out


def _top(demo) -> dict[str, str]:
    from scheduler.service.top import BOUND_WORDS

    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update(SILOD_SERVER=demo["base"], SILOD_TOKEN=ALICE)
    proc = subprocess.run([*SILOD, "top", "--once"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    words = {w: k for k, w in BOUND_WORDS.items()}
    lines = [line.rstrip() for line in proc.stdout.splitlines()]
    start = lines.index("running") + 2  # the table's title, then its header
    table = lines[start:lines.index("", start)]
    out = {}
    for jid in (demo["fast"], demo["light"]):
        line = next(line for line in table if line.split()[0] == jid)
        out[jid] = words[line.split()[-1]]
    return out


def _four(demo):
    api = _api(demo)
    metrics, counts = _metrics(demo)
    ui, top = _ui(demo), _top(demo)
    for jid, (bound, throughput) in api.items():
        assert (metrics[jid][0], ui[jid], top[jid]) == (bound, bound, bound), (jid, api, metrics, ui, top)
        assert metrics[jid][1] == pytest.approx(throughput, rel=1e-9)
    expected = {r: sum(1 for b, _ in api.values() if b == r) for r in counts}
    assert counts == expected, (counts, api)
    return api


def test_all_four_views_name_the_same_bound_before_and_after_a_step_time_report(demo):
    before = _four(demo)
    assert before[demo["fast"]][0] in ("cache", "remote_io")  # 500 MB/s declared, at most ~56 MB/s of IO
    # The job's own step time: 20 MB per 1 s step; planning now uses f* = 20 MB/s.
    measured = demo["post"](f"/v1/jobs/{demo['fast']}/report", {"step_seconds": 1.0, "batch_bytes": 20 * MB}, status=(202,))
    assert measured["ideal_throughput"] == pytest.approx(20 * MB)
    after = _four(demo)
    assert after[demo["fast"]] == ("gpu", pytest.approx(20 * MB))


def test_piped_job_tables_print_every_cell_whole(demo):
    """Issue 48: piped (not a terminal), rich squeezed tables into 80 columns: names cut to
    'resnet-…', cells wrapped, narrow columns shrunk to nothing so borders glued. Piped output is
    now printed at the table's own width (scheduler/console.py); here `silod jobs` and
    `silod jobs --wide` write to a pipe (capture_output)."""
    name = "a-job-name-long-enough-to-overflow-eighty-columns-on-its-own"
    demo["post"]("/v1/jobs", {"name": name, "gpus": 1, "dataset": "small", "epochs": 1, "ideal_throughput": "5MB/s"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_") and k != "COLUMNS"}
    env.update(SILOD_SERVER=demo["base"], SILOD_TOKEN=ALICE)
    for wide in ([], ["--wide"]):
        proc = subprocess.run([*SILOD, "jobs", *wide], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert "…" not in proc.stdout, proc.stdout
        headers = [h.strip() for h in lines[1].strip("┃").split("┃")]
        assert all(headers) and "f* (measured)" in headers and "bound" in headers, lines[1]
        row = next(line for line in lines if name in line)  # the whole name, on one line
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert len(cells) == len(headers) and all(cells), row  # no column shrunk to nothing
        assert cells[headers.index("progress")].endswith("of 1GB"), row  # not wrapped onto a second line
