"""Real mounts driven by a real data manager: allocations pulled within a second, eviction on
shrink, worker split, and enforcement of the last allocation while the manager is down."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from contract.names import node_mount_job
from datamanager.client import DataManagerClient

from dataplane_helpers import make_dataset, mounted, read_epoch, start_datamanager, wait_until

pytestmark = pytest.mark.fuse


def test_manager_allocations_drive_cache_and_eviction(tmp_path):
    ds = make_dataset(tmp_path / "remote", n_files=200, seed=7)
    d = ds.total
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as sched, \
             mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--manager", dm.url) as m:
            sched.allocate_cache_size("ds", int(0.6 * d))
            sched.allocate_remote_io("job1", 50e6, workers=2)
            s = wait_until(lambda: (st := m.stats())["cache_allocation_bytes"] == int(0.6 * d) and st, 2.0, message="cache allocation pulled")
            assert s["io_rate_bytes_per_s"] == 25e6  # split across the job's two workers
            assert s["manager_connected"] is True
            read_epoch(m.mountpoint, ds, seed=1)
            assert int(0.6 * d) - 32_000 < m.fresh_stats()["cached_bytes"] <= int(0.6 * d)

            t0 = time.monotonic()
            sched.allocate_cache_size("ds", int(0.25 * d))
            wait_until(lambda: m.stats()["cached_bytes"] <= int(0.25 * d), 2.0, message="eviction after shrink")
            assert time.monotonic() - t0 < 2.0
            before = m.fresh_stats()
            read_epoch(m.mountpoint, ds, seed=2)
            after = m.fresh_stats()
            hit_ratio = (after["hit_bytes"] - before["hit_bytes"]) / d
            assert abs(hit_ratio - before["cached_bytes"] / d) < 1e-9
            assert abs(hit_ratio - 0.25) <= 0.02

            status = sched.status()
            node = next(iter(status["nodes"].values()))
            entry = node["datasets"]["ds"]
            assert entry["allocated_bytes"] == int(0.25 * d)
            assert abs(entry["cached_bytes"] - 0.25 * d) <= 32_000
            assert entry["jobs"]["job1"]["live"] is True
            assert entry["jobs"]["job1"]["effective_cached_bytes"] is not None
    finally:
        dm.kill()


def test_rate_changes_apply_within_a_second_and_survive_a_manager_outage(tmp_path):
    big = make_dataset(tmp_path / "remote", n_files=3, min_size=3_000_000, max_size=3_000_000, seed=8)
    files = sorted(big.sizes)
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as sched:
            sched.allocate_cache_size("big", 0)
            sched.allocate_remote_io("job1", 100e3)  # 100 KB/s: a 3 MB item would take 30 s
        with mounted(tmp_path / "mnt", str(big.root), "big", "job1", tmp_path / "cache", "--manager", dm.url) as m:
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 100e3, 2.0, message="rate pulled")
            done = threading.Event()
            threading.Thread(target=lambda: ((m.mountpoint / files[0]).read_bytes(), done.set()), daemon=True).start()
            time.sleep(0.5)
            assert not done.is_set()
            t0 = time.monotonic()
            with DataManagerClient(dm.url) as sched:
                sched.allocate_remote_io("job1", 20e6)
            # 3 MB at 20 MB/s is 0.15 s; the rest is the <= 1 s for the new rate to take effect.
            assert done.wait(2.0), "new rate did not take effect"
            assert time.monotonic() - t0 < 1.5

            with DataManagerClient(dm.url) as sched:
                sched.allocate_remote_io("job1", 1e6)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 1e6, 2.0, message="1 MB/s pulled")
            dm.kill()  # the manager goes away: the mount keeps enforcing 1 MB/s
            wait_until(lambda: m.stats()["manager_connected"] is False, 3.0, message="outage noticed")
            t0 = time.monotonic()
            assert (m.mountpoint / files[1]).read_bytes() == (big.root / files[1]).read_bytes()
            assert time.monotonic() - t0 >= 2.7  # 3 MB at 1 MB/s, minus one 0.1 s burst
            assert m.stats()["io_rate_bytes_per_s"] == 1e6

            dm.start()  # same state dir: allocations and the registration come back
            wait_until(lambda: m.stats()["manager_connected"] is True, 3.0, message="reconnected")
            status = httpx.get(dm.url + "/v1/status").json()
            assert status["jobs"]["job1"]["remote_io_bytes_per_s"] == 1e6
            assert [c["live"] for c in status["clients"]] == [True]
            with DataManagerClient(dm.url) as sched:
                sched.allocate_remote_io("job1", 30e6)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 30e6, 2.0, message="rate after restart")
    finally:
        dm.kill()


def test_metrics_show_per_job_bytes_open_latency_and_breaker_state(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    ds = make_dataset(tmp_path / "remote", n_files=30, seed=9)
    dm = start_datamanager(tmp_path / "state")
    try:
        with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--manager", dm.url) as m:
            read_epoch(m.mountpoint, ds, seed=1)  # misses
            read_epoch(m.mountpoint, ds, seed=2)  # hits
            s = m.fresh_stats()
            assert s["open_latency_miss"]["count"] == 30 and s["open_latency_hit"]["count"] == 30

            def scraped():
                fams = {f.name: f for f in text_string_to_metric_families(httpx.get(dm.url + "/metrics").text)}
                samples = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in fams.values() for x in f.samples}
                key = (("dataset", "ds"), ("job", "job1"), ("node", s["node"] if "node" in s else next(iter(
                    httpx.get(dm.url + "/v1/status").json()["nodes"]))))
                hit = samples.get(("silod_job_read_bytes_total", tuple(sorted((*key, ("source", "hit"))))))
                return (hit == ds.total) and (samples, key)

            samples, key = wait_until(scraped, 3.0, message="metrics carry the mount's stats")
            lab = lambda *extra: tuple(sorted((*key, *extra)))
            assert samples[("silod_job_read_bytes_total", lab(("source", "miss")))] == ds.total
            assert samples[("silod_job_remote_fetched_bytes_total", lab())] == ds.total
            assert samples[("silod_remote_breaker_open", lab())] == 0
            assert samples[("silod_job_remote_errors_total", lab())] == 0
            # The cache disk is named apart from the remote (issue 45: a full disk is not a remote error).
            assert samples[("silod_job_cache_disk_errors_total", lab(("cache_dir", str(tmp_path / "cache"))))] == 0
            assert samples[("silod_job_open_latency_seconds_count", lab(("result", "hit")))] == 30
            assert samples[("silod_job_open_latency_seconds_count", lab(("result", "miss")))] == 30
            assert samples[("silod_job_open_latency_seconds_bucket", lab(("le", "+Inf"), ("result", "hit")))] == 30
            # How the kernel served them, as the stats file says (passthrough on this kernel, as root).
            s = m.fresh_stats()
            modes = {mode: samples.get(("silod_job_opens_total", lab(("mode", mode)))) for mode in ("passthrough", "kernel_cache", "daemon")}
            assert modes == {mode: s[f"{mode}_opens"] for mode in modes} and sum(modes.values()) == 60
            assert samples[("silod_job_fuse_read_requests_total", lab())] == s["read_requests"]
            info = lab(("fuse_backend", s["fuse_backend"]), ("passthrough", str(s["passthrough"]).lower()))
            assert samples[("silod_mount_info", info)] == 1
    finally:
        dm.kill()


def test_a_client_reporting_garbage_stats_cannot_break_metrics(tmp_path):
    """Stats come from FUSE clients, i.e. from the nodes: the exposition validates every value."""
    dm = start_datamanager(tmp_path / "state")
    try:
        reg = {"client_id": "evil", "node": "n1", "dataset": "ds", "job": "j", "source": "/x", "mountpoint": "/m", "pid": 1}
        assert httpx.post(dm.url + "/v1/clients", json=reg).status_code == 200
        garbage = {"hit_bytes": "lots", "miss_bytes": -5, "remote_bytes": "inf", "remote_errors": True,
                   "remote_breaker_state": "<script>", "open_latency_hit": {"buckets": [[1, 9], [2, 3], ["+Inf", 1]], "sum_s": 1},
                   "open_latency_miss": {"buckets": [["+Inf", 1]] * 1000, "sum_s": "x"},
                   "passthrough_opens": "many", "daemon_opens": -1, "read_requests": [1], "fuse_backend": "x\"}", "passthrough": "yes"}
        assert httpx.put(dm.url + "/v1/clients/evil/heartbeat", json={"stats": garbage}).status_code == 200
        r = httpx.get(dm.url + "/metrics")
        assert r.status_code == 200
        assert 'job="j"' not in r.text.split("silod_job_read_bytes")[1].split("# HELP")[0]
        assert "silod_job_open_latency_seconds_bucket" not in r.text
        assert 'job="j"' not in r.text  # nor any other family: every value was refused
    finally:
        dm.kill()


@pytest.mark.parametrize("how", ["token-file", "token"])
def test_a_mount_with_a_node_bound_token_registers_and_pulls_its_allocation(tmp_path, how):
    """A mount that authenticates to the data manager (the node-bound agent tokens of issue 20):
    `silod mount --manager` exited 1 at start with httpx's TypeError "Invalid 'auth' argument",
    so every CSI publish with --manager failed. The token file is re-read at every request."""
    n1, n2 = "node-n1-agent-token-0001", "node-n2-agent-token-0002"
    (tmp_path / "agents").write_text(f"n1:{n1}\nn2:{n2}\n")
    sched_token = "scheduler-dm-token-0001"
    dm = start_datamanager(tmp_path / "state", env={"SILOD_DM_AGENT_TOKENS_FILE": str(tmp_path / "agents"),
                                                   "SILOD_DM_SCHEDULER_TOKEN": sched_token})
    ds = make_dataset(tmp_path / "remote", n_files=20, seed=3)
    token_file = tmp_path / "token"
    token_file.write_text(n1 + "\n")
    env = {"SILOD_DM_TOKEN_FILE": str(token_file)} if how == "token-file" else {"SILOD_DM_TOKEN": n1}
    job = node_mount_job("n1", "ds")  # what a node's agent may register (datamanager/app.py, _own_mount)
    try:
        with DataManagerClient(dm.url, token=sched_token) as sched:
            sched.allocate_cache_size("ds", 123_456)
            sched.set_placements({"n1": ["ds"]})  # as the scheduler does: node n1 runs a job reading ds
            with mounted(tmp_path / "mnt", str(ds.root), "ds", job, tmp_path / "cache", "--manager", dm.url, "--node", "n1",
                         env=env) as m:
                s = wait_until(lambda: (st := m.stats())["manager_connected"] and st["cache_allocation_bytes"] == 123_456 and st,
                               5.0, message="registered with the token and allocation pulled")
                assert s["manager_connected"] is True
                assert job in sched.status()["nodes"]["n1"]["datasets"]["ds"]["jobs"]
                if how == "token-file":
                    # Another node's token in the file (re-read): this node's heartbeats are refused.
                    token_file.write_text(n2 + "\n")
                    wait_until(lambda: not m.stats()["manager_connected"], 5.0, message="refused with node n2's token")
    finally:
        dm.kill()


def test_a_mount_restarted_while_the_manager_is_down_keeps_the_last_io_rate(tmp_path):
    """Issue 45: the IO rate is kept beside the cache allocation, so a mount restarted during a
    manager outage throttles at the manager's last rate (before: it ran unthrottled)."""
    ds = make_dataset(tmp_path / "remote", n_files=5, seed=4)
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as sched:
            sched.allocate_remote_io("job1", 250e3)
        with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--manager", dm.url) as m:
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 250e3, 3.0, message="rate pulled")
        dm.kill()
        with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--manager", dm.url) as m:
            s = m.fresh_stats()
            assert s["manager_connected"] is False and s["io_rate_bytes_per_s"] == 250e3, s
        # Another job of the same dataset has no saved rate of its own.
        with mounted(tmp_path / "mnt", str(ds.root), "ds", "job2", tmp_path / "cache", "--manager", dm.url) as m:
            assert m.fresh_stats()["io_rate_bytes_per_s"] is None
    finally:
        dm.kill()


@pytest.mark.parametrize("backend", ["raw", "libfuse"])
def test_the_mount_measures_each_miss_from_its_open_to_its_last_byte(tmp_path, backend):
    """The loader term's L (estimator.loader_miss_rate) is how long a miss holds its reader. On
    libfuse a miss's bytes are read through this process after the open: a reader that waits
    0.3 s between the open and its reads shows it (the open latency does not), and an item
    released before its last byte is no whole miss. On the raw front end with passthrough the
    item is whole at the open reply and the kernel serves its reads: the service time is the
    open's. The figures reach the data manager's status, which the scheduler reads."""
    ds = make_dataset(tmp_path / "remote", n_files=12, seed=11)
    dm = start_datamanager(tmp_path / "state")
    try:
        with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--manager", dm.url,
                     "--fuse-backend", backend) as m:
            files = sorted(ds.sizes)
            slow, partial, rest = files[0], files[1], files[2:]
            with open(m.mountpoint / slow, "rb") as f:
                time.sleep(0.3)
                assert len(f.read()) == ds.sizes[slow]
            with open(m.mountpoint / partial, "rb") as f:
                f.read(10)
            for rel in rest:
                assert len((m.mountpoint / rel).read_bytes()) == ds.sizes[rel]
            s = m.fresh_stats()
            service, opened = s["miss_service"], s["open_latency_miss"]
            assert opened["count"] == len(files)
            # The raw front end serves reads here only where the kernel has no FUSE passthrough.
            if backend == "libfuse" or s["fuse_requests"].get("READ", 0) > 0:
                # the held open and its bytes count; the half-read item does not
                assert service["count"] == len(files) - 1
                assert service["bytes"] == sum(ds.sizes[r] for r in files if r != partial)
                assert service["sum_s"] >= 0.3 > opened["sum_s"]
            else:
                assert service["count"] == len(files) and service["bytes"] == ds.total
                # from the request's arrival, so at least as long as the open itself took
                assert opened["sum_s"] <= service["sum_s"] < 0.3

            def in_status():
                job = next(iter(httpx.get(dm.url + "/v1/status").json()["nodes"].values()))["datasets"]["ds"]["jobs"]["job1"]
                return job["miss_service_count"] == service["count"] and job
            job = wait_until(in_status, 3.0, message="the data manager's status carries the per-miss service time")
            assert job["miss_service_bytes"] == service["bytes"]
            assert abs(job["miss_service_s"] - service["sum_s"]) < 1e-6
    finally:
        dm.kill()


@pytest.mark.parametrize("service", [
    {"count": "lots", "sum_s": 1.0, "bytes": 10}, {"count": 3, "sum_s": "inf", "bytes": 10},
    {"count": 3, "sum_s": -1.0, "bytes": 10}, {"count": 3, "sum_s": 1.0}, [3, 1.0, 10], "fast", None,
    {"count": True, "sum_s": 1.0, "bytes": 10},
])
def test_a_malformed_miss_service_figure_is_not_passed_on(tmp_path, service):
    """A node's per-miss service counters feed the scheduler's loader term: a malformed one shows
    as absent (null) in the status, a huge sum is capped at an hour a miss, never a traceback."""
    dm = start_datamanager(tmp_path / "state")
    try:
        reg = {"client_id": "evil", "node": "n1", "dataset": "ds", "job": "j", "source": "/x", "mountpoint": "/m", "pid": 1}
        assert httpx.post(dm.url + "/v1/clients", json=reg).status_code == 200
        for stats in ({"miss_service": service}, {"miss_service": {"count": 2, "sum_s": 1e12, "bytes": 10}}):
            assert httpx.put(dm.url + "/v1/clients/evil/heartbeat", json={"stats": stats}).status_code == 200
            r = httpx.get(dm.url + "/v1/status")
            assert r.status_code == 200
            job = r.json()["nodes"]["n1"]["datasets"]["ds"]["jobs"]["j"]
            if stats["miss_service"] is service:
                assert (job["miss_service_count"], job["miss_service_s"], job["miss_service_bytes"]) == (None, None, None)
            else:
                assert (job["miss_service_count"], job["miss_service_s"]) == (2, 7200.0)
    finally:
        dm.kill()
