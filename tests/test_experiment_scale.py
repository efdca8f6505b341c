"""Experiments past one machine: `--shard I/N` + `--merge DIR...`, the `--dask ADDRESS` executor
on a real local Dask cluster (scheduler and two worker processes on 127.0.0.1), and
`silod trace export` read back by `silod simulate` to the same simulation.

Every command runs the real console entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.sim.shards import TIMING_FIELDS
from test_simulate_cli import _shared_traces  # noqa: E402 - shared/ beside this clone or its origin

pytestmark = [pytest.mark.slow]  # subprocesses running whole (small) experiments, a Dask cluster

SILOD = [sys.executable, "-m", "scheduler"]
SMALL_MATRIX = ["matrix", "--max-jobs", "12", "--gpus", "16", "--cache", "3TB", "--remote-io", "300MB/s", "--quiet", "--workers", "1"]
SHARED = _shared_traces()
REPO = Path(__file__).resolve().parents[1]


def silod(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([*SILOD, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, stdin=subprocess.DEVNULL)


def ok(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = silod(*args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc


def without_timing(value):
    """The JSON with each run's measured wall and CPU time removed (they differ run to run)."""
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if k not in TIMING_FIELDS}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def assert_same_outputs(a: Path, b: Path, stem: str) -> None:
    ja, jb = json.loads((a / f"{stem}.json").read_text()), json.loads((b / f"{stem}.json").read_text())
    timed = [r for r in ja.get("runs", {}).values() if "sim_wall_s" in r]
    assert timed or stem != "matrix", "the matrix JSON carries each run's timing; the comparison must skip only that"
    assert without_timing(ja) == without_timing(jb)
    assert (a / f"{stem}.png").read_bytes() == (b / f"{stem}.png").read_bytes()


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unsharded")
    ok("experiment", *SMALL_MATRIX, "--out", str(out))
    return out


def test_sharded_and_merged_equals_unsharded(unsharded, tmp_path):
    # 12 runs in 3 shards (round robin: 4 each), two parts in one directory, one in another.
    for i, d in ((1, "a"), (2, "b"), (3, "b")):
        proc = ok("experiment", *SMALL_MATRIX, "--shard", f"{i}/3", "--out", str(tmp_path / d))
        assert "4 of 12 simulations" in proc.stdout
        assert not (tmp_path / d / "matrix.json").exists()  # a shard does not plot
    parts = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/matrix.part-*-of-3.json"))]
    assert sorted(r["index"] for p in parts for r in p["results"]) == list(range(12))
    proc = ok("experiment", "matrix", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m"), "--quiet")
    assert "merged 3 part(s), 12 simulations" in proc.stdout
    assert_same_outputs(tmp_path / "m", unsharded, "matrix")


def test_merge_refuses_incomplete_overlapping_or_mixed_parts(tmp_path):
    micro = ["micro", "--quiet", "--workers", "1"]
    ok("experiment", *micro, "--shard", "1/2", "--out", str(tmp_path / "a"))
    ok("experiment", *micro, "--shard", "2/2", "--out", str(tmp_path / "b"))
    ok("experiment", *micro, "--shard", "2/2", "--out", str(tmp_path / "b2"))
    ok("experiment", *micro, "--shard", "2/3", "--out", str(tmp_path / "c"))
    ok("experiment", *micro, "--shard", "2/2", "--round", "600", "--out", str(tmp_path / "d"))

    def refused(*dirs: str, expect: str) -> None:
        proc = silod("experiment", "micro", "--merge", *(str(tmp_path / d) for d in dirs), "--out", str(tmp_path / "m"))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "m" / "micro.json").exists()

    refused("a", expect="shard(s) 2/2 missing")
    refused("a", "b", "b2", expect="shard 2/2 of micro is given twice")
    refused("a", "b", "b", expect="names the directory")  # not "shard 2/2 given twice"
    refused("a", "b", "a/../b", expect="names the directory")
    refused("a", "c", expect="different N")
    refused("a", "d", expect="parts of different runs of micro")
    (tmp_path / "empty").mkdir()
    refused("empty", expect="no part of experiment micro")
    proc = silod("experiment", "micro", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--seed", "3", "--out", str(tmp_path / "m"))
    assert proc.returncode == 2 and "drop --seed" in proc.stderr
    for bad in ("0/2", "3/2", "x", "1/0"):
        proc = silod("experiment", *micro, "--shard", bad, "--out", str(tmp_path / "s"))
        assert proc.returncode == 2 and "--shard" in proc.stderr, (bad, proc.stderr)
    ok("experiment", "micro", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m"), "--quiet")


@pytest.fixture
def dask_cluster(tmp_path):
    """A Dask scheduler and two single-threaded worker processes, on 127.0.0.1 only, started in a
    directory of their own (so a relative trace path of the client does not resolve there)."""
    pytest.importorskip("distributed")
    home = tmp_path / "cluster"
    home.mkdir()
    sched_file = home / "scheduler.json"
    procs = [subprocess.Popen([sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(sched_file)], cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sched_file.exists(), "the Dask scheduler did not start"
        procs.append(subprocess.Popen([sys.executable, "-m", "dask", "worker", "--scheduler-file", str(sched_file), "--nworkers", "2",
                                       "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"], cwd=home,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client

        address = json.loads(sched_file.read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=60)
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_dask_cluster_runs_an_experiment_like_the_local_run(dask_cluster, tmp_path):
    # The trace is a CSV the client names by a relative path: the workers (started elsewhere)
    # cannot open it, so the run only works because the parsed trace is shipped to them.
    client_dir = tmp_path / "client"
    client_dir.mkdir()
    ok("trace", "export", "--experiment", "matrix", "--max-jobs", "12", "--out", "t.csv", cwd=client_dir)
    args = ["matrix", "--trace", "t.csv", "--gpus", "16", "--cache", "3TB", "--remote-io", "300MB/s", "--quiet"]
    ok("experiment", *args, "--workers", "1", "--out", "local", cwd=client_dir)
    ok("experiment", *args, "--dask", dask_cluster, "--out", "dask", cwd=client_dir)
    assert_same_outputs(client_dir / "dask", client_dir / "local", "matrix")
    # A shard can run on the cluster too; its part merges with a local one.
    ok("experiment", *args, "--dask", dask_cluster, "--shard", "1/2", "--out", "p1", cwd=client_dir)
    ok("experiment", *args, "--workers", "1", "--shard", "2/2", "--out", "p2", cwd=client_dir)
    ok("experiment", "matrix", "--merge", "p1", "p2", "--out", "merged", "--quiet", cwd=client_dir)
    assert_same_outputs(client_dir / "merged", client_dir / "local", "matrix")


def test_dask_unreachable_scheduler_is_one_line(tmp_path):
    pytest.importorskip("distributed")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = silod("experiment", "micro", "--quiet", "--dask", f"tcp://127.0.0.1:{port}", "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 1 and "cannot reach the Dask scheduler" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def simulate_outputs(tmp: Path, name: str, *args: str) -> tuple[dict, bytes, bytes]:
    out = tmp / name
    ok("simulate", *args, "--quiet", "--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    for k in (*TIMING_FIELDS, "trace"):
        summary.pop(k)
    return summary, (out / "jobs.csv").read_bytes(), (out / "timeline.csv").read_bytes()


@pytest.mark.parametrize("source, fmt, extra, runs", [
    ("gavel-msr/0e4a51.trace", "gavel", ["--max-jobs", "60", "--dataset-sharing", "0.5"], [("gavel", "silod"), ("fifo", "alluxio")]),
    # openb jobs run for weeks (many epochs): 15 jobs and one run keep this under 10 CPU s
    ("alibaba-openb", "alibaba-openb", ["--max-jobs", "15", "--dataset-sharing", "0.3"], [("sjf", "silod")]),
])
def test_exported_trace_simulates_identically(tmp_path, source, fmt, extra, runs):
    # The msr VCs ship with silod (traces/gavel-msr); the openb trace is fetched (shared/ here).
    path = REPO / "traces" / source if fmt == "gavel" else SHARED / source
    if fmt != "gavel" and not path.exists():
        pytest.skip(f"{path} is not on this machine")
    common = ["--seed", "3"]
    ok("trace", "export", "--trace", str(path), "--format", fmt, *extra, *common, "--out", str(tmp_path / "t.csv"))
    for policy, system in runs:
        run = ["--policy", policy, "--cache-system", system, "--gpus", "32", "--cache", "4TB", "--remote-io", "500MB/s", *common]
        original = simulate_outputs(tmp_path, f"orig-{policy}", "--trace", str(path), "--format", fmt, *extra, *run)
        exported = simulate_outputs(tmp_path, f"exp-{policy}", "--trace", str(tmp_path / "t.csv"), *run)
        assert original == exported


def test_exported_experiment_trace_is_what_the_experiment_simulates(monkeypatch):
    """For every experiment with a trace of the user's, `experiment_trace` (what `silod trace
    export --experiment` writes) is the trace the experiment hands its first run."""
    from scheduler.sim import experiments as ex
    from scheduler.sim.shards import trace_digest

    class Captured(Exception):
        pass

    seen = {}

    def capture(self, jobs, source, executor):
        seen["runs"], seen["source"] = [run for _, run in jobs], source
        raise Captured

    monkeypatch.setattr(ex.ExperimentRunner, "_execute", capture)
    cap = ex._capacity()
    checked = []
    for name, fn in ex.EXPERIMENTS.items():
        if name in ex.OWN_TRACE_EXPERIMENTS:
            continue
        # experiment alibaba reads the openb trace (shared/ beside this clone or its origin)
        trace = SHARED / "alibaba-openb" if name == "alibaba" else None
        runner = ex.ExperimentRunner(trace, None, 5, 360.0, 128, show_progress=False, workers=1)
        with pytest.raises(Captured):
            fn(runner, Path("/nonexistent-out"), cap)
        points = {(r.dataset_sharing, r.irregular, r.catalog_pipelines, r.autocache_points): r for r in seen["runs"]}
        for point, run in points.items():  # every point of a sweep
            src, _ = ex.run_trace_source(run, seen["source"])
            exported = ex.experiment_trace(name, trace, None, 5, *point)
            assert trace_digest(exported) == trace_digest(ex.build_trace(src)), (name, point)
        checked.append(name)
    assert set(ex.SWEEP_EXPERIMENTS) <= set(checked)


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (from /proc; Ray's workers are children of its raylet)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _in_session(sid: int) -> list[str]:
    """Command lines of the live processes of session `sid`."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                left.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return left


def _listeners(pids: set[int]) -> list[str]:
    """Local addresses of the TCP/UDP sockets these processes listen on (`ss`)."""
    out = subprocess.run(["ss", "-H", "-l", "-t", "-u", "-n", "-p"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.append(line.split()[4])
    return found


@pytest.fixture
def ray_cluster(tmp_path):
    """A Ray head with two CPUs, listening on 127.0.0.1 only, started in a directory of its own
    and in a session of its own: teardown ends that session's processes (never `ray stop`, which
    would stop every Ray cluster of this machine's user)."""
    pytest.importorskip("ray")
    import socket
    import signal
    import tempfile

    home = tmp_path / "cluster"
    home.mkdir()
    # Ray's Unix sockets live under --temp-dir, whose path must stay short (sun_path is 108 bytes).
    temp = tempfile.mkdtemp(prefix="silod-ray-", dir="/tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Without this variable Ray on Linux swaps 127.0.0.1 for the machine's outward IP and listens on every interface.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp}"], cwd=home, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert head.poll() is None, "ray start --head exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the Ray head did not listen in 120 s")
        yield f"127.0.0.1:{port}", head.pid
    finally:
        head.terminate()  # `ray start --block` ends the processes it started on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        deadline = time.monotonic() + 30
        while _in_session(head.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _in_session(head.pid)
        if left:
            os.killpg(head.pid, signal.SIGKILL)
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"the Ray cluster left processes behind: {left}"


def test_ray_cluster_runs_an_experiment_like_the_local_run(ray_cluster, tmp_path):
    address, head_pid = ray_cluster
    client_dir = tmp_path / "client"  # not the cluster's directory: the trace must be shipped (see the Dask test)
    client_dir.mkdir()
    ok("trace", "export", "--experiment", "matrix", "--max-jobs", "12", "--out", "t.csv", cwd=client_dir)
    args = ["matrix", "--trace", "t.csv", "--gpus", "16", "--cache", "3TB", "--remote-io", "300MB/s", "--quiet"]
    ok("experiment", *args, "--workers", "1", "--out", "local", cwd=client_dir)
    ok("experiment", *args, "--ray", address, "--out", "ray", cwd=client_dir)
    assert_same_outputs(client_dir / "ray", client_dir / "local", "matrix")
    # Every socket of the cluster (GCS, raylet, agents, the workers that ran the simulations) is on loopback.
    listening = _listeners(_descendants(head_pid))
    assert listening, "found no listener of the Ray cluster; the check would pass vacuously"
    loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")
    assert all(a.startswith(loopback) for a in listening), f"the Ray cluster listens beyond loopback: {listening}"


def test_ray_unreachable_or_doubled_executor_is_one_line(tmp_path):
    pytest.importorskip("ray")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = silod("experiment", "micro", "--quiet", "--ray", f"127.0.0.1:{port}", "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 1 and "cannot reach the Ray cluster" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = silod("experiment", "micro", "--quiet", "--ray", "nonsense", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "--ray 'nonsense' is not HOST:PORT" in proc.stderr, proc.stderr
    proc = silod("experiment", "micro", "--quiet", "--ray", f"127.0.0.1:{port}", "--dask", f"tcp://127.0.0.1:{port}",
                 "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "give one of them" in proc.stderr, proc.stderr


def test_workers_get_the_costliest_runs_first():
    """Longest processing time first: the LRU cells, then the time-sharing policy's, each group
    in the experiment's own order (a run's result is still filed under its index)."""
    from scheduler.sim.experiments import CACHE_SYSTEMS, Run, _capacity, longest_first

    jobs = list(enumerate(Run(f"{p}/{c}", p, c, _capacity()) for p in ("fifo", "sjf", "gavel") for c in CACHE_SYSTEMS))
    order = [run.label for _, run in longest_first(jobs)]
    assert order[:3] == ["gavel/alluxio", "fifo/alluxio", "sjf/alluxio"]
    assert order[3:6] == ["gavel/silod", "gavel/coordl", "gavel/quiver"]
    assert sorted(longest_first(jobs)) == sorted(jobs, key=lambda j: j[0])  # the same runs, indices kept
