"""The local backend with real FUSE mounts: jobs run, report progress, stop cleanly, share caches,
and survive a kill -9 of the backend's process (re-adoption) and of `silod serve`."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policies.types import ClusterCapacity
from scheduler.backends.base import BackendConfig, DatasetInfo, JobAllocation, JobSpec
from scheduler.backends.local import LocalBackend, fuse_problems, silod_cmd

REPO = Path(__file__).resolve().parent.parent


def require_fuse() -> None:
    problems = fuse_problems()
    if problems:
        msg = "real FUSE mounts unavailable: " + "; ".join(problems)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def make_dataset(root: Path, n: int = 40, lo: int = 50_000, hi: int = 120_000, seed: int = 0) -> int:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(n):
        size = rng.randint(lo, hi)
        (root / f"item{i:04d}.bin").write_bytes(rng.randbytes(size))
        total += size
    return total


def backend_for(tmp: Path, gpus: int = 4, cache: float = 1e9, io: float = 1e9) -> LocalBackend:
    return LocalBackend(BackendConfig(capacity=ClusterCapacity(gpus=gpus, cache=cache, remote_io=io), state_dir=tmp / "state",
                                      options={"batch_bytes": "256KB"}))


def spec(job_id: str, ds: str, root: Path, d: int, ideal: float, epochs: float, consumed: float = 0.0) -> JobSpec:
    return JobSpec(job_id, job_id, "t", 1, DatasetInfo(ds, root.as_uri(), float(d)), ideal_throughput=ideal,
                   total_bytes=epochs * d, consumed_bytes=consumed)


def collect(backend: LocalBackend, until: set[str], timeout: float) -> list:
    """Poll until every job in `until` has a terminal event."""
    events, ended = [], set()
    deadline = time.time() + timeout
    while time.time() < deadline and not until <= ended:
        for ev in backend.poll():
            events.append(ev)
            if ev.kind != "progress":
                ended.add(ev.job_id)
        time.sleep(0.2)
    assert until <= ended, f"jobs {until - ended} did not end within {timeout}s: {[backend.job_status(j) for j in until - ended]}"
    return events


def mounts_under(path: Path) -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(path))]


@pytest.fixture(autouse=True)
def _fuse():
    require_fuse()


def test_job_runs_to_completion_and_reports_progress(tmp_path):
    d = make_dataset(tmp_path / "remote" / "ds")
    be = backend_for(tmp_path)
    be.start(spec("1", "ds", tmp_path / "remote" / "ds", d, ideal=8e6, epochs=2), JobAllocation("1", 1, 1.0, d / 2, 6e6))
    events = collect(be, {"1"}, timeout=40)
    progress = [e.consumed_bytes for e in events if e.kind == "progress"]
    assert len(progress) >= 2, events
    assert progress == sorted(progress), "progress must be cumulative and monotone"
    assert 0 < progress[0] < 2 * d
    finished = [e for e in events if e.kind == "finished"]
    assert len(finished) == 1 and finished[0].consumed_bytes == pytest.approx(2 * d)
    st = be.job_status("1")
    assert st["state"] == "finished" and [e["epoch"] for e in st["epochs"]] == [0, 1]
    # Uniform caching through the real mount: the second epoch hits about c/d of the bytes.
    assert st["mount"]["cached_bytes"] <= d / 2 + 1
    assert st["mount"]["hit_bytes"] > 0.3 * d
    assert mounts_under(tmp_path) == []


def test_stop_leaves_no_mount_and_progress_survives_a_restart(tmp_path):
    d = make_dataset(tmp_path / "remote" / "ds")
    be = backend_for(tmp_path)
    be.start(spec("7", "ds", tmp_path / "remote" / "ds", d, ideal=4e6, epochs=20), JobAllocation("7", 1, 1.0, 0.0, 4e6))
    deadline = time.time() + 30
    while time.time() < deadline and not ((be.job_status("7") or {}).get("consumed_bytes", 0) > 0):
        time.sleep(0.2)
    assert os.path.ismount(be.mountpoint("7"))
    pid = json.loads((be.jobs_dir / "7" / "worker.pid").read_text())["pid"]
    t0 = time.time()
    be.stop("7")
    assert time.time() - t0 < 15
    assert mounts_under(tmp_path) == [], "stop() must unmount"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    events = be.poll()
    assert all(e.kind == "progress" for e in events), "a requested stop is not a failure"
    consumed = max(e.consumed_bytes for e in events)
    assert consumed > 0
    be.stop("7")  # idempotent
    be.stop("unknown")
    # Restarting resumes from the recorded progress (attempt 2).
    be.start(spec("7", "ds", tmp_path / "remote" / "ds", d, ideal=4e6, epochs=20, consumed=consumed), JobAllocation("7", 1, 1.0, 0.0, 4e6))
    deadline = time.time() + 30
    while time.time() < deadline and (be.job_status("7") or {}).get("state") != "running":
        time.sleep(0.2)
    st = be.job_status("7")
    assert st["attempt"] == 2 and st["start_consumed_bytes"] == consumed
    be.stop("7")
    assert mounts_under(tmp_path) == []


def test_two_jobs_on_one_dataset_share_its_cache(tmp_path):
    d = make_dataset(tmp_path / "remote" / "ds", n=30)
    be = backend_for(tmp_path)
    src = tmp_path / "remote" / "ds"
    # The whole dataset fits: job 1 fills the shared cache in its first epoch, job 2 reads it.
    be.start(spec("1", "ds", src, d, ideal=20e6, epochs=1), JobAllocation("1", 1, 1.0, 2 * d, 20e6))
    collect(be, {"1"}, timeout=30)
    be.start(spec("2", "ds", src, d, ideal=20e6, epochs=1), JobAllocation("2", 1, 1.0, 2 * d, 20e6))
    collect(be, {"2"}, timeout=30)
    s1, s2 = be.job_status("1"), be.job_status("2")
    assert s1["mount"]["remote_bytes"] >= d * 0.99
    assert s2["mount"]["hit_bytes"] == pytest.approx(d, rel=0.01), "job 2 must hit the cache job 1 filled"
    assert s2["mount"]["remote_bytes"] < 0.01 * d
    assert len(list((be.cache_dir / "ds").glob("items/*/*"))) == 30  # one shared cache dir per dataset


_ADOPT_SCRIPT = """
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.test_local_backend import backend_for, spec
from scheduler.backends.base import JobAllocation
tmp = Path({tmp!r})
be = backend_for(tmp)
be.start(spec("5", "ds", tmp / "remote" / "ds", {d}, ideal=3e6, epochs=3), JobAllocation("5", 1, 1.0, 0.0, 1e9))
print("started", flush=True)
time.sleep(600)
"""


def test_workers_survive_kill_9_of_the_backend_process_and_are_readopted(tmp_path):
    d = make_dataset(tmp_path / "remote" / "ds", n=30)
    proc = subprocess.Popen([sys.executable, "-c", _ADOPT_SCRIPT.format(repo=str(REPO), tmp=str(tmp_path), d=d)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        status = tmp_path / "state" / "local" / "jobs" / "5" / "status.json"
        deadline = time.time() + 30
        while time.time() < deadline and not (status.exists() and json.loads(status.read_text()).get("consumed_bytes", 0) > 0):
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    be = backend_for(tmp_path)  # a new service process: re-adopts the live worker
    assert be.adopted == ("5",) and be.running_jobs() == {"5"}
    events = collect(be, {"5"}, timeout=40)
    assert events[-1].kind == "finished" and events[-1].consumed_bytes == pytest.approx(3 * d)
    assert mounts_under(tmp_path) == []
    # Another restart after the end: nothing runs, and the end is not reported again.
    be2 = backend_for(tmp_path)
    assert be2.adopted == () and be2.poll() == []


def test_a_worker_that_dies_is_reported_failed_and_unmounted(tmp_path):
    d = make_dataset(tmp_path / "remote" / "ds", n=20)
    be = backend_for(tmp_path)
    be.start(spec("3", "ds", tmp_path / "remote" / "ds", d, ideal=1e6, epochs=10), JobAllocation("3", 1, 1.0, 0.0, 1e6))
    deadline = time.time() + 30
    while time.time() < deadline and (be.job_status("3") or {}).get("state") != "running":
        time.sleep(0.2)
    pid = json.loads((be.jobs_dir / "3" / "worker.pid").read_text())["pid"]
    os.killpg(pid, signal.SIGKILL)
    events = collect(be, {"3"}, timeout=15)
    assert events[-1].kind == "failed" and "worker.log" in events[-1].message
    assert mounts_under(tmp_path) == []


def test_missing_source_fails_the_job_with_the_reason(tmp_path):
    be = backend_for(tmp_path)
    be.start(spec("9", "nope", tmp_path / "does-not-exist", 1000, ideal=1e6, epochs=1), JobAllocation("9", 1, 1.0, None, None))
    events = collect(be, {"9"}, timeout=30)
    assert events[-1].kind == "failed" and "silod mount exited" in events[-1].message
    assert mounts_under(tmp_path) == []


# --------------------------------------------------------------------------- silod serve, kill -9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp: Path, port: int, cache: str = "2MB", extra: tuple[str, ...] = ()) -> subprocess.Popen:
    log = open(tmp / "serve.log", "ab")
    return subprocess.Popen(
        [*silod_cmd(), "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp / 'silod.db'}", "--backend", "local",
         "--gpus", "2", "--gpus-per-node", "2", "--cache", cache, "--remote-io", "8MB/s", "--policy", "fifo", "--round", "2s",
         "--state-dir", str(tmp / "state"), "--backend-opt", "batch_bytes=256KB",
         "--allow-uri", (tmp / "remote").as_uri() + "/", *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SILOD_ADMIN_TOKEN": "admintoken123"}, start_new_session=True,
    )


def test_kill_9_of_silod_serve_loses_no_job(tmp_path):
    import httpx

    d = make_dataset(tmp_path / "remote" / "ds", n=30)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    h = {"Authorization": "Bearer admintoken123"}
    serve = _serve(tmp_path, port)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(f"{url}/v1/datasets", headers=h, json={"name": "ds", "uri": (tmp_path / "remote" / "ds").as_uri(), "size": d})
        assert r.status_code == 201, r.text
        # 12 epochs of 2.5 MB at about 4 MB/s each: ~7 s, so neither job can finish between the
        # poll that sees both running and the status check (with 4 epochs, ~3 s, the check once
        # found a job no longer running in CI on a 2-core VM).
        epochs = 12
        ids = [httpx.post(f"{url}/v1/jobs", headers=h, json={"name": f"j{i}", "gpus": 1, "dataset": "ds", "epochs": epochs,
                                                              "ideal_throughput": 3e6}).json()["id"] for i in range(2)]
        deadline = time.time() + 40
        while time.time() < deadline:
            jobs = httpx.get(f"{url}/v1/jobs", headers=h).json()
            if all(j["state"] == "running" and j["consumed_bytes"] > 0 for j in jobs):
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"jobs did not start: {jobs}")
        serve.send_signal(signal.SIGKILL)
        serve.wait()
        time.sleep(1.0)
        jobs_dir = tmp_path / "state" / "local" / "jobs"
        statuses = {i: json.loads((jobs_dir / i / "status.json").read_text()) for i in ids}
        assert all(s["state"] == "running" for s in statuses.values()), f"workers keep running without the service: {statuses}"
        serve = _serve(tmp_path, port)
        deadline = time.time() + 90
        jobs = []
        while time.time() < deadline:
            try:
                jobs = httpx.get(f"{url}/v1/jobs", headers=h, timeout=2).json()
                if all(j["state"] == "finished" for j in jobs):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert [j["state"] for j in jobs] == ["finished", "finished"], jobs
        assert all(j["consumed_bytes"] == pytest.approx(epochs * d) for j in jobs)
        for i in ids:  # the restarted attempt resumed from recorded progress, not from zero
            st = json.loads((jobs_dir / i / "status.json").read_text())
            assert st["attempt"] == 1 or st["start_consumed_bytes"] > 0
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(20)
        for jdir in (tmp_path / "state" / "local" / "jobs").glob("*"):
            pidf = jdir / "worker.pid"
            if pidf.exists():
                try:
                    os.killpg(json.loads(pidf.read_text())["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for m in mounts_under(tmp_path):
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
    assert mounts_under(tmp_path) == []


def test_kill_9_of_silod_serve_keeps_workers_running(tmp_path):
    """A restarted service keeps the re-adopted worker processes running (attempt 1): recover()
    neither stops nor restarts the jobs the backend still runs."""
    test_kill_9_of_silod_serve_loses_no_job(tmp_path)
    jobs_dir = tmp_path / "state" / "local" / "jobs"
    attempts = [json.loads((p / "status.json").read_text())["attempt"] for p in jobs_dir.iterdir()]
    assert attempts == [1, 1]


def test_serve_with_data_manager_feeds_a_cold_fully_allocated_cache(tmp_path):
    """`silod serve --backend local --datamanager URL --policy fifo` with a cache larger than the
    dataset: the policy gives the dataset all of it, the cache starts cold, and the job must
    still read (remote IO is planned on the measured cached bytes, not on the allocation)."""
    import httpx

    from scheduler.demo import DataManager

    d = make_dataset(tmp_path / "remote" / "ds", n=30)
    dm = DataManager(tmp_path / "dm-state", tmp_path / "dm.log")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    h = {"Authorization": "Bearer admintoken123"}
    serve = _serve(tmp_path, port, cache="20MB", extra=("--datamanager", dm.url))
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(f"{url}/v1/datasets", headers=h, json={"name": "ds", "uri": (tmp_path / "remote" / "ds").as_uri(), "size": d})
        assert r.status_code == 201, r.text
        jid = httpx.post(f"{url}/v1/jobs", headers=h, json={"name": "j", "gpus": 1, "dataset": "ds", "epochs": 2,
                                                             "ideal_throughput": 4e6}).json()["id"]
        deadline = time.time() + 60
        job: dict = {}
        while time.time() < deadline:
            job = httpx.get(f"{url}/v1/jobs/{jid}", headers=h, timeout=2).json()
            if job["state"] in ("finished", "failed"):
                break
            time.sleep(0.5)
        assert job["state"] == "finished", (job, (tmp_path / "serve.log").read_text()[-3000:])
        # The whole dataset was allocated (read from the audit trail: a round after the finish
        # may already have given the cache back).
        hist = httpx.get(f"{url}/v1/allocations/history", params={"subject": r.json()["key"]}, headers=h).json()
        assert max(c["new_value"] or 0 for c in hist if c["resource"] == "cache") == pytest.approx(d)
        st = json.loads((tmp_path / "state" / "local" / "jobs" / jid / "status.json").read_text())
        assert st["mount"]["remote_bytes"] >= 0.99 * d and st["mount"]["hit_bytes"] > 0.9 * d  # epoch 2 hit the cache
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(20)
        for jdir in (tmp_path / "state" / "local" / "jobs").glob("*"):
            pidf = jdir / "worker.pid"
            if pidf.exists():
                try:
                    os.killpg(json.loads(pidf.read_text())["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for m in mounts_under(tmp_path):
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
        dm.close()
    assert mounts_under(tmp_path) == []


def test_mounts_started_by_the_backend_hold_the_operators_allow_list(tmp_path):
    """The service's allow-list reaches the mounts it starts (SILOD_ALLOWED_URIS). Without it a
    mount trusted its own --source, so a registered name that resolves to an internal address
    (here `localhost`, standing for DNS rebinding after registration) was read by the job."""
    import http.server
    import threading

    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            body = b'[{"name": "a.bin", "type": "file", "size": 5}]' if self.path == "/ds/" else b"12345"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        be = LocalBackend(BackendConfig(capacity=ClusterCapacity(gpus=4, cache=1e9, remote_io=1e9), state_dir=tmp_path / "state",
                                        options={"batch_bytes": "256KB"}, allowed_uris=("s3", "https")))
        uri = f"http://localhost:{server.server_address[1]}/ds/"
        be.start(JobSpec("7", "7", "t", 1, DatasetInfo("web", uri, 5.0), ideal_throughput=1e6, total_bytes=5.0,
                          consumed_bytes=0.0),
                 JobAllocation("7", 1, 1.0, None, None))
        events = collect(be, {"7"}, timeout=30)
        assert events[-1].kind == "failed", events
        log = (be.jobs_dir / "7" / "mount.log").read_text()
        assert "loopback" in log, log
        assert hits == []  # the mount refused before it listed: not one request reached the server
        assert mounts_under(tmp_path) == []
    finally:
        server.shutdown()
        server.server_close()
