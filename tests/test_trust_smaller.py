"""The smaller findings of issue 47's outside review (Build 4), one test each; each finding's test
fails on 19aec68 (test_an_ipv6_host_is_not_a_chain guards the '::' rule itself). Real service over a real SQLite file and the REST API
(TestClient); the agent's state directory and the mount's stats file are real files; the web
view's fragment handling runs in a real browser (headless Chromium)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from estimator.errors import UserError

try:
    from test_api import H_ALICE, IMAGENET, make_app
except ImportError:  # tests/ imported as a package
    from tests.test_api import H_ALICE, IMAGENET, make_app


# --- names with a trailing newline ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["imagenet\n", "a\n", "x" * 10 + "\n"])
def test_a_name_with_a_trailing_newline_is_refused(name):
    from contract.names import validate_name
    from scheduler.service.api.auth import check_tenant
    from scheduler.service.types import ServiceError, check_name

    with pytest.raises(UserError):
        validate_name(name, "dataset")
    with pytest.raises(ServiceError):
        check_name(name, "name")
    with pytest.raises(ServiceError):
        check_tenant(name)
    validate_name(name.rstrip("\n"), "dataset")


def test_a_tokens_file_owner_with_a_trailing_newline_is_refused():
    from scheduler.service.api.auth import TENANT_RE

    assert TENANT_RE.match("alice") and not TENANT_RE.match("alice\n")


# --- the API refuses what the mount refuses (one URI policy) ---------------------------------------

@pytest.fixture
def files_api(tmp_path):
    allowed = tmp_path / "datasets"
    (allowed / "ok").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", allowed / "link")  # inside the prefix by name, outside once followed
    app, service = make_app(f"sqlite:///{tmp_path / 'uri.db'}", tmp_path, run_loop=False,
                            allowed_uris=["s3", "https", f"file://{allowed}/"])
    with TestClient(app) as c:
        yield c, allowed
    service.close()


@pytest.mark.parametrize("uri, says", [
    ("s3://bucket/imagenet\u202e", "U+202E"),
    ("s3://bucket/imagenet\u200b", "U+200B"),
    ("s3://bucket/x::file:///etc", "'::'"),
    ("LINK", "symbolic link"),
])
def test_the_api_refuses_uris_the_mount_refuses(files_api, uri, says):
    c, allowed = files_api
    uri = f"file://{allowed}/link" if uri == "LINK" else uri
    r = c.post("/v1/datasets", json={**IMAGENET, "name": "x", "uri": uri}, headers=H_ALICE)
    assert r.status_code == 400 and says in r.json()["detail"], r.text
    ok = c.post("/v1/datasets", json={**IMAGENET, "name": "ok", "uri": f"file://{allowed}/ok"}, headers=H_ALICE)
    assert ok.status_code in (200, 201), ok.text


def test_an_ipv6_host_is_not_a_chain():
    from contract.uri_policy import UriPolicy

    assert UriPolicy(("https://[2001:db8::1]/data/",)).check("https://[2001:db8::1]/data/x")


# --- a JSON index's sizes -------------------------------------------------------------------------------

def test_a_json_index_size_beyond_what_stat_carries_is_refused():
    from fuse_client.http_index import MAX_FILE_SIZE, parse_json_index

    with pytest.raises(UserError, match="the most a file's size can be"):
        parse_json_index(b'[{"name": "big", "type": "file", "size": 9223372036854775808}]', "http://h/", "http://h/")
    (entry,) = parse_json_index(f'[{{"name": "b", "type": "file", "size": {MAX_FILE_SIZE}}}]'.encode(), "u", "s")
    assert entry.size == 2**63 - 1


# --- /docs without CDN scripts ----------------------------------------------------------------------------

def test_docs_load_nothing_from_elsewhere_and_openapi_stays(tmp_path):
    app, service = make_app(f"sqlite:///{tmp_path / 'docs.db'}", tmp_path, run_loop=False)
    with TestClient(app) as c:
        page = c.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "<script" not in page.text and not re.findall(r"https?://", page.text)
        assert "/v1/jobs" in page.text and 'href="/openapi.json"' in page.text
        assert c.get("/redoc").status_code in (401, 404)  # gone (and no longer public)
        assert c.get("/openapi.json").json()["paths"]["/v1/jobs"]
    service.close()


# --- failed tokens are rate-limited --------------------------------------------------------------------

def test_token_guessing_is_slowed_and_a_guess_past_the_limit_is_not_checked(tmp_path):
    app, service = make_app(f"sqlite:///{tmp_path / 'rl.db'}", tmp_path, run_loop=False)
    with TestClient(app) as c:
        codes = [c.get("/v1/jobs", headers={"Authorization": f"Bearer guess-{i:04d}-xxxxxxxx"}).status_code
                 for i in range(60)]
        assert codes.count(401) <= 25 and codes[-1] == 429, codes  # on main: 60 x 401, ~430 guesses/s
        r = c.get("/v1/jobs", headers=H_ALICE)  # right or wrong, not checked now
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    service.close()


def test_the_limiter_is_per_network_and_refills():
    from http_guard.auth_limit import FailedAuthLimiter, client_network

    now = [0.0]
    lim = FailedAuthLimiter(burst=3, rate=1.0, clock=lambda: now[0])
    for _ in range(3):
        assert lim.retry_after("10.0.0.1") == 0
        lim.failed("10.0.0.1")
    assert lim.retry_after("10.0.0.1") == pytest.approx(1.0)
    assert lim.retry_after("10.0.0.2") == 0  # another client
    now[0] = 1.0
    assert lim.retry_after("10.0.0.1") == 0
    # One host holds a whole IPv6 /64: its addresses share a bucket.
    assert client_network("2001:db8::1") == client_network("2001:db8::ffff") != client_network("2001:db8:0:1::1")
    assert client_network("::ffff:10.0.0.1") == "10.0.0.1"


# --- the agent's files and the mount's stats are private ------------------------------------------------

def test_the_agents_mounts_and_records_are_private(tmp_path):
    from fuse_client.agent.volumes import VolumeManager, VolumeRecord

    vm = VolumeManager(tmp_path / "state", "node-a", silod=["silod"], kubelet_dir=tmp_path / "kubelet")
    assert stat.S_IMODE((tmp_path / "state" / "mounts").stat().st_mode) == 0o700
    vm.volumes[("v1", "/t")] = VolumeRecord("v1", "/t", "alice", "imagenet", "s3://b/i", None, "ns", "pod")
    vm._save()
    assert stat.S_IMODE((tmp_path / "state" / "volumes.json").stat().st_mode) == 0o600


def test_the_agents_mount_log_is_private(tmp_path):
    """A mount's log names the tenant's dataset and its errors: the agent's only (on 19aec68 it was
    opened 0644). The agent starts a real process as its `silod mount`, which fails at once."""
    import sys

    from fuse_client.agent.datasets import DatasetSource
    from fuse_client.agent.volumes import MountError, VolumeManager

    vm = VolumeManager(tmp_path / "state", "node-a", kubelet_dir=tmp_path / "kubelet",
                       silod=[sys.executable, "-c", "import sys; print('no such bucket'); sys.exit(3)"])
    with pytest.raises(MountError, match="no such bucket"):
        vm._dataset_mount(DatasetSource("alice", "imagenet", "s3://b/imagenet", key="d1-imagenet"))
    log = tmp_path / "state" / "mounts" / "alice" / "imagenet.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_the_mounts_stats_file_is_private(tmp_path):
    from fuse_client.mount import ControlLoop

    path = tmp_path / "stats.json"
    ControlLoop.write_stats(SimpleNamespace(cfg=SimpleNamespace(stats_file=path), stats=lambda: {"read_bytes": 1}))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip().startswith("{")


# --- the service's secret keys stay in the service ----------------------------------------------------

def test_secret_keys_do_not_reach_local_workers_or_mounts(monkeypatch, tmp_path):
    from contract.credentials import SourceCredential
    from fuse_client.agent.datasets import DatasetSource
    from fuse_client.agent.volumes import mount_env
    from policies.types import ClusterCapacity
    from scheduler.backends.base import BackendConfig, DatasetInfo, JobSpec
    from scheduler.backends.local import LocalBackend

    monkeypatch.setenv("SILOD_SECRET_KEYS", "a-fernet-key")
    monkeypatch.setenv("SILOD_TOKEN_KEY", "an-hmac-key")
    # The environment the local backend starts a job's worker (its mount, its program) with.
    backend = LocalBackend(BackendConfig(capacity=ClusterCapacity(gpus=1, cache=1e9, remote_io=1e9),
                                         state_dir=tmp_path / "state"))
    worker = backend.worker_env(JobSpec("1", "j", "alice", 1, DatasetInfo("d", "s3://b/d", 1e9), 1e8, 1e9, 0.0))
    assert not worker.get("SILOD_SECRET_KEYS") and not worker.get("SILOD_TOKEN_KEY")
    assert worker["PYTHONUNBUFFERED"] == "1"  # the rest of the service's environment is kept
    agent_mount = mount_env(DatasetSource("alice", "d", "s3://b/d", None, key="d1-d",
                                          credential=SourceCredential("AK", "SK")))
    assert "SILOD_SECRET_KEYS" not in agent_mount


# --- /ui#token=T does not replace the tab's token ---------------------------------------------------------

def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_a_link_with_another_token_does_not_replace_the_tabs(tmp_path):
    """ui.js's own fragment rule, run by a real browser: with no token the link's is taken;
    with one, the tab keeps it and says so (on main the link's silently replaced it)."""
    from importlib import resources

    script = resources.files("scheduler.service.api").joinpath("ui", "ui.js").read_text()
    cases = [("#token=T", None), ("#token=T", "T"), ("#token=OTHER", "MINE"), ("", "MINE"), ("#token=%E0%A4%A", "MINE")]
    probe = "".join(f"r = tokenFromFragment({h!r}, {('null' if t is None else repr(t))});"
                    f"out.push([r.token, r.notice ? 'notice' : '']);" for h, t in cases)
    page = tmp_path / "probe.html"
    page.write_text(f"<!doctype html><html><body><pre id=out></pre><script>{script}</script>"
                    f"<script>let r, out = []; {probe} document.getElementById('out').textContent ="
                    f" JSON.stringify(out);</script></body></html>")
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="out">(.*?)</pre>', proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    import json

    assert json.loads(m.group(1).replace("&quot;", '"')) == [
        ["T", ""], ["T", ""], ["MINE", "notice"], ["MINE", ""], ["MINE", "notice"]]
