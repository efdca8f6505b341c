"""The data manager over real HTTP (a `silod datamanager` process): Table 3 API, status, metrics,
persistence across a restart, and bad input."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest

from datamanager.client import DataManagerClient, DataManagerError
from datamanager.state import StateStore

from dataplane_helpers import free_port, silod_cmd, start_datamanager
from full_disk import fill_to_the_last_block, tiny_tmpfs


@pytest.fixture(scope="module")
def dm(tmp_path_factory):
    # One server for the module: tests use distinct names, and bad-input tests compare the
    # whole status and state file before and after, so sharing cannot hide a change.
    proc = start_datamanager(tmp_path_factory.mktemp("dm") / "state")
    yield proc
    proc.kill()


def test_table3_allocations_through_the_typed_client(dm):
    with DataManagerClient(dm.url) as client:
        ds = client.allocate_cache_size("imagenet", 143e9)
        assert ds.cache_bytes == 143_000_000_000
        job = client.allocate_remote_io("job-1", 200e6, workers=4)
        assert (job.bytes_per_s, job.workers) == (200e6, 4)
        client.declare_job("job-1", dataset="imagenet")
        status = client.status()
    assert status["datasets"]["imagenet"]["allocated_bytes"] == 143_000_000_000
    assert status["datasets"]["imagenet"]["jobs"] == ["job-1"]
    assert status["jobs"]["job-1"]["remote_io_bytes_per_s"] == 200e6


def test_units_are_accepted_in_bodies(dm):
    httpx.put(dm.url + "/v1/datasets/d1", json={}).raise_for_status()
    r = httpx.put(dm.url + "/v1/datasets/d1/cache", json={"bytes": "2GiB"})
    assert r.status_code == 200 and r.json()["cache_bytes"] == 2**31
    httpx.put(dm.url + "/v1/jobs/j1", json={}).raise_for_status()
    r = httpx.put(dm.url + "/v1/jobs/j1/remote-io", json={"bytes_per_s": "1Gbps"})
    assert r.status_code == 200 and r.json()["bytes_per_s"] == 125e6


def test_a_control_character_in_the_path_is_refused(dm):
    """The scheduler's guard let /metrics%0a reach /metrics (tests/test_api_security.py); the data
    manager refuses such paths the same way."""
    for path in ("/metrics%0a", "/healthz%0a", "/v1/status%00"):
        r = httpx.get(dm.url + path)
        assert r.status_code == 400 and "control character" in r.json()["detail"], (path, r.text)
    assert httpx.get(dm.url + "/metrics").status_code == 200


def test_client_registration_splits_remote_io_among_workers(dm):
    with DataManagerClient(dm.url) as client:
        client.allocate_remote_io("train", 100e6, workers=2)
        client.allocate_cache_size("coco", 5e9)
    reg = {"client_id": "n1-train-1", "node": "n1", "dataset": "coco", "job": "train"}
    r = httpx.post(dm.url + "/v1/clients", json=reg)
    assert r.status_code == 200
    assert r.json()["allocation"] == {"cache_bytes": 5_000_000_000, "remote_io_bytes_per_s": 50e6}
    # Three mounts of a job declared with two workers: never exceed the job's allocation.
    for i in (2, 3):
        httpx.post(dm.url + "/v1/clients", json={**reg, "client_id": f"n1-train-{i}"}).raise_for_status()
    hb = httpx.put(dm.url + "/v1/clients/n1-train-1/heartbeat", json={"stats": {"cached_bytes": 123, "items_cached": 4}})
    assert hb.json()["allocation"]["remote_io_bytes_per_s"] == pytest.approx(100e6 / 3)
    status = httpx.get(dm.url + "/v1/status").json()
    assert status["nodes"]["n1"]["datasets"]["coco"]["cached_bytes"] == 123
    assert status["jobs"]["train"]["live_clients"] == 3
    assert {c["client_id"] for c in status["clients"]} == {"n1-train-1", "n1-train-2", "n1-train-3"}
    assert httpx.put(dm.url + "/v1/clients/nobody/heartbeat", json={"stats": {}}).status_code == 404


def test_metrics_are_prometheus_text(dm):
    with DataManagerClient(dm.url) as client:
        client.allocate_cache_size("ds-m", 1000)
        client.allocate_remote_io("job-m", 5e6)
    r = httpx.get(dm.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'silod_dataset_cache_allocated_bytes{dataset="ds-m"} 1000.0' in r.text
    assert 'silod_job_remote_io_allocated_bytes_per_second{job="job-m"} 5e+06' in r.text


def test_allocations_survive_a_kill9_restart(tmp_path):
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as client:
            client.allocate_cache_size("persist", 7e9)
            client.allocate_remote_io("job-p", 3e6, workers=3)
        httpx.post(dm.url + "/v1/clients", json={"client_id": "c1", "node": "n", "dataset": "persist", "job": "job-p"}).raise_for_status()
        dm.kill()
        dm.start()
        with DataManagerClient(dm.url) as client:
            status = client.status()
        assert status["datasets"]["persist"]["allocated_bytes"] == 7_000_000_000
        assert status["jobs"]["job-p"] == {"dataset": "persist", "remote_io_bytes_per_s": 3e6, "workers": 3, "live_clients": 0}
        assert [c["client_id"] for c in status["clients"]] == ["c1"]
        # The registered client's heartbeat is accepted after the restart (no re-registration needed).
        assert httpx.put(dm.url + "/v1/clients/c1/heartbeat", json={"stats": {}}).json()["allocation"]["remote_io_bytes_per_s"] == 1e6
    finally:
        dm.kill()


BAD_REQUESTS = [
    ("PUT", "/v1/datasets/unknown-ds/cache", {"bytes": 10}, 404, "unknown dataset 'unknown-ds'"),
    ("PUT", "/v1/jobs/unknown-job/remote-io", {"bytes_per_s": 10}, 404, "unknown job 'unknown-job'"),
    ("GET", "/v1/datasets/unknown-ds", None, 404, "unknown dataset"),
    ("DELETE", "/v1/jobs/unknown-job", None, 404, "unknown job"),
    ("PUT", "/v1/datasets/known/cache", {"bytes": -1}, 400, "negative"),
    ("PUT", "/v1/datasets/known/cache", {"bytes": "lots"}, 400, "'lots' is not a size"),
    ("PUT", "/v1/datasets/known/cache", {"bytes": "5GB/s"}, 400, "rate, not a size"),
    ("PUT", "/v1/datasets/known/cache", {"bytes": True}, 400, "not a size"),
    ("PUT", "/v1/datasets/known/cache", {}, 422, "bytes"),
    ("PUT", "/v1/datasets/known/cache", {"bytes": 1, "extra": 2}, 422, "extra"),
    ("PUT", "/v1/jobs/known-job/remote-io", {"bytes_per_s": "-3MB/s"}, 400, "negative"),
    ("PUT", "/v1/jobs/known-job/remote-io", {"bytes_per_s": "quick"}, 400, "'quick' is not a rate"),
    ("PUT", "/v1/jobs/known-job/remote-io", {"bytes_per_s": 5, "workers": 0}, 400, "workers"),
    ("PUT", "/v1/datasets/a..b/cache", {"bytes": 1}, 400, "dataset 'a..b' is not a valid name"),
    ("PUT", "/v1/jobs/..hidden/remote-io", {"bytes_per_s": 1}, 400, "not a valid name"),
    ("PUT", "/v1/datasets/a%2Fb/cache", {"bytes": 1}, 404, ""),
    ("POST", "/v1/clients", {"client_id": "x", "node": "n", "dataset": "../etc", "job": "j"}, 400, "dataset '../etc'"),
    # A job on a dataset never declared: 404 naming the declare call, not an implicitly created dataset.
    ("PUT", "/v1/jobs/new-job", {"dataset": "never-declared"}, 404, "declare it first with PUT /v1/datasets/never-declared"),
    ("PUT", "/v1/jobs/known-job", {"dataset": "typo-ds"}, 404, "PUT /v1/datasets/typo-ds"),
    # Bounds from estimator.units: sizes <= 1 EB, rates <= 10 TB/s, workers <= 1,000,000.
    ("PUT", "/v1/datasets/known/cache", {"bytes": 1e30}, 400, "1EB"),
    ("PUT", "/v1/datasets/known/cache", {"bytes": "2EB"}, 400, "1EB"),
    ("PUT", "/v1/jobs/known-job/remote-io", {"bytes_per_s": "11TB/s"}, 400, "10TB/s"),
    ("PUT", "/v1/jobs/known-job/remote-io", {"bytes_per_s": 5, "workers": 10**9}, 400, "1,000,000"),
    # A lone surrogate passed JSON parsing, then failed every later save of the state (every
    # write a 500 until a restart); names that are no path segment, control characters, huge pids.
    ("POST", "/v1/clients", {"client_id": "x\ud800", "node": "n", "dataset": "known", "job": "j"}, 400, "client_id"),
    ("POST", "/v1/clients", {"client_id": "..", "node": "n", "dataset": "known", "job": "j"}, 400, "client_id"),
    ("POST", "/v1/clients", {"client_id": "c\u0000\n", "node": "n", "dataset": "known", "job": "j"}, 400, "client_id"),
    ("POST", "/v1/clients", {"client_id": "c" * 10_000, "node": "n", "dataset": "known", "job": "j"}, 400, "client_id"),
    ("POST", "/v1/clients", {"client_id": "x", "node": "../../etc", "dataset": "known", "job": "j"}, 400, "not a host name"),
    ("POST", "/v1/clients", {"client_id": "x", "node": "n\u00f6de\n}x", "dataset": "known", "job": "j"}, 400, "not a host name"),
    ("POST", "/v1/clients", {"client_id": "x", "node": "n", "dataset": "known", "job": "j", "pid": 10**26}, 400, "pid"),
    ("POST", "/v1/clients", {"client_id": "x", "node": "n", "dataset": "known", "job": "j", "source": "s3://x/\ud800"}, 400,
     "source"),
    ("PUT", "/v1/datasets/known", {"uri": "s3://x/\ud800"}, 400, "uri"),
]


def _allocations(dm) -> dict:
    """The allocation part of /v1/status (client liveness ages with time, so it is left out)."""
    status = httpx.get(dm.url + "/v1/status").json()
    jobs = {k: {f: v for f, v in j.items() if f != "live_clients"} for k, j in status["jobs"].items()}
    return {"datasets": status["datasets"], "jobs": jobs, "clients": sorted(c["client_id"] for c in status["clients"])}


@pytest.mark.parametrize("method, path, body, code, message", BAD_REQUESTS)
def test_bad_requests_are_4xx_with_a_clear_message_and_change_nothing(dm, method, path, body, code, message):
    with DataManagerClient(dm.url) as client:
        client.allocate_cache_size("known", 1000)
        client.allocate_remote_io("known-job", 1000)
    before = _allocations(dm)
    state_before = (dm.state_dir / "state.json").read_text()
    # json.dumps escapes a lone surrogate as \\ud800 (httpx's own encoder cannot send one)
    r = httpx.request(method, dm.url + path, content=None if body is None else json.dumps(body),
                      headers={"Content-Type": "application/json"})
    assert r.status_code == code, r.text
    assert message in r.json()["detail"]
    assert _allocations(dm) == before
    assert (dm.state_dir / "state.json").read_text() == state_before


def test_typed_client_raises_with_the_managers_detail(dm):
    with DataManagerClient(dm.url) as client:
        with pytest.raises(DataManagerError) as info:
            client.allocate_cache_size("x", -5)
    assert info.value.status_code == 400 and "negative" in info.value.detail


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:99999", ":80"])
def test_bad_listen_address_exits_2(tmp_path, listen):
    r = subprocess.run([*silod_cmd(), "datamanager", "--listen", listen, "--state", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--listen" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s").exists()


def test_corrupt_state_file_is_a_clear_error(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    (state / "state.json").write_text("{not json")
    port = free_port()
    r = subprocess.run([*silod_cmd(), "datamanager", "--listen", f"127.0.0.1:{port}", "--state", str(state)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "state.json" in r.stderr
    assert (state / "state.json").read_text() == "{not json"


def test_state_store_writes_atomically(tmp_path):
    store = StateStore(tmp_path)
    store.declare_dataset("d")
    store.allocate_cache_size("d", 10)
    assert json.loads((tmp_path / "state.json").read_text())["datasets"]["d"]["cache_bytes"] == 10
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert (tmp_path / "state.json").stat().st_mode & 0o777 == 0o600  # was 0644 (issue 20 review)


def test_bad_heartbeat_stats_never_break_status_or_metrics(dm):
    """A heartbeat's stats are the client's word: a NaN in them is refused, and a figure that is
    not a number is left out of /v1/status and /metrics (it made both answer 500 for as long as
    the client kept sending it)."""
    with DataManagerClient(dm.url) as client:
        client.allocate_cache_size("hb-ds", 1000)
    reg = {"client_id": "n1-hb-1", "node": "n1", "dataset": "hb-ds", "job": "hb-job"}
    httpx.post(dm.url + "/v1/clients", json=reg).raise_for_status()
    url = dm.url + "/v1/clients/n1-hb-1/heartbeat"
    for raw in (b'{"stats": {"items_cached": NaN}}', b'{"stats": {"pods": {"p": {"read_bytes": Infinity}}}}'):
        r = httpx.put(url, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "finite" in r.json()["detail"], r.text
    # Integers past +-2^63 (legal JSON; 400 digits made float() raise in /v1/status and /metrics).
    for key in ("remote_rate_bytes_per_s", "throughput_bytes_per_s", "hit_bytes", "remote_errors", "items_cached",
                "cached_bytes"):
        r = httpx.put(url, content=b'{"stats": {"%s": %s}}' % (key.encode(), b"9" * 400),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "2^63" in r.json()["detail"] and key in r.json()["detail"], r.text
    r = httpx.put(url, content=b'{"stats": {"latency": {"buckets": [[%s, 1], ["+Inf", 1]], "sum_s": 1}}}' % (b"9" * 400),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    r = httpx.put(url, json={"stats": {"items_cached": "lots", "effective_cached_bytes": "x", "throughput_bytes_per_s": "y",
                                       "hit_bytes": "z", "cached_bytes": 2**62}})
    assert r.status_code == 200, r.text
    status = httpx.get(dm.url + "/v1/status")
    assert status.status_code == 200, status.text
    node = status.json()["nodes"]["n1"]["datasets"]["hb-ds"]
    assert node["items_cached"] == 0 and node["cached_bytes"] == 1000  # capped at the allocation
    job = node["jobs"]["hb-job"]
    assert job["effective_cached_bytes"] == 0 and job["throughput_bytes_per_s"] is None and job["hit_bytes"] == 0
    assert httpx.get(dm.url + "/metrics").status_code == 200


@pytest.fixture
def tiny_disk(tmp_path):
    with tiny_tmpfs(tmp_path / "tiny") as mnt:
        yield mnt


def test_a_change_the_disk_cannot_hold_is_a_503_and_changes_nothing(tiny_disk):
    """A write whose save fails (disk full) used to stay in memory: the manager answered 500 but
    served the new allocation until a restart, which then lost it. Now the change is undone, the
    answer is a 503 that says so, and once there is room the same write works."""
    state = tiny_disk / "state"
    dm = start_datamanager(state)
    try:
        with DataManagerClient(dm.url) as client:
            client.allocate_cache_size("d", 1000)
            client.allocate_remote_io("j", 5e6)
        before = _allocations(dm)
        saved = (state / "state.json").read_text()
        filler = tiny_disk / "filler"
        fill_to_the_last_block(filler)
        for method, path, body in [("PUT", "/v1/datasets/d/cache", {"bytes": 2000}),
                                   ("PUT", "/v1/datasets/new", {}),
                                   ("PUT", "/v1/jobs/j/remote-io", {"bytes_per_s": 9e6}),
                                   ("POST", "/v1/clients", {"client_id": "c1", "node": "n1", "dataset": "d", "job": "j"})]:
            r = httpx.request(method, dm.url + path, json=body)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert "nothing was changed" in r.json()["detail"] and "state.json" in r.json()["detail"]
            assert _allocations(dm) == before, path
        assert (state / "state.json").read_text() == saved
        assert sorted(p.name for p in state.iterdir()) == ["state.json"]  # no temporary file left
        filler.unlink()
        r = httpx.put(dm.url + "/v1/datasets/d/cache", json={"bytes": 2000})
        assert r.status_code == 200 and r.json()["cache_bytes"] == 2000
    finally:
        dm.kill()
    restarted = start_datamanager(state)
    try:
        assert httpx.get(restarted.url + "/v1/status").json()["datasets"]["d"]["allocated_bytes"] == 2000
    finally:
        restarted.kill()


def test_a_body_not_sent_as_json_is_a_415_and_changes_nothing(dm):
    httpx.put(dm.url + "/v1/datasets/typed", json={}).raise_for_status()
    before = _allocations(dm)
    r = httpx.put(dm.url + "/v1/datasets/typed/cache", content=b'{"bytes": 5}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["detail"]
    assert _allocations(dm) == before


def test_a_node_cannot_register_clients_without_bound(tmp_path, monkeypatch):
    """Issue 20 review: one agent registered 1,500 clients; every save (the whole state file)
    went from 8 to 81 ms for every node. At the bound (4 here, 512 in production) a node's clients
    that are not live are dropped to make room; if all are live, a 429. Other nodes are unaffected."""
    import datamanager.state as state
    from fastapi.testclient import TestClient

    from datamanager.app import create_app
    from datamanager.auth import DataManagerAuth

    assert 64 <= state.MAX_CLIENTS_PER_NODE <= 4096
    monkeypatch.setattr(state, "MAX_CLIENTS_PER_NODE", 4)
    monkeypatch.setattr(state, "LIVE_TIMEOUT_S", 0.5)
    (tmp_path / "s").mkdir()
    with TestClient(create_app(tmp_path / "s", DataManagerAuth.from_tokens(None, None))) as c:
        def register(node: str, i: int):
            return c.post("/v1/clients", json={"client_id": f"{node}-c{i}", "node": node, "dataset": "d", "job": f"j{i}"})

        assert [register("n1", i).status_code for i in range(4)] == [200] * 4
        assert register("n1", 0).status_code == 200  # re-registering a known client takes no room
        refused = register("n1", 4)
        assert refused.status_code == 429 and "4 live clients" in refused.json()["detail"], refused.text
        assert register("n2", 0).status_code == 200
        before = (tmp_path / "s" / "state.json").read_text()
        assert register("n1", 5).status_code == 429 and (tmp_path / "s" / "state.json").read_text() == before
        time.sleep(0.6)  # n1's clients stop being live; one of them keeps heartbeating
        assert c.put("/v1/clients/n1-c2/heartbeat", json={"stats": {}}).status_code == 200
        assert register("n1", 4).status_code == 200
        clients = {x["client_id"] for x in c.get("/v1/status").json()["clients"]}
        assert clients == {"n1-c2", "n1-c4", "n2-c0"}
        assert c.put("/v1/clients/n1-c0/heartbeat", json={"stats": {}}).status_code == 404  # it registers again
