"""A fresh `silod serve` schedules from its first second (issue 48, item 1): the policies'
kernels are compiled before the lease is taken, the lease is renewed by a thread a long round
cannot starve, numba's cache is shared by every checkout of the same sources, and `/readyz`,
the wait reasons and `silod top` say what the scheduler is doing. Real SQLite, real processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from scheduler.service import control
from scheduler.service.db import open_database
from scheduler.service.overview import wait_reason

from dataplane_helpers import silod_cmd  # noqa: I001 - sibling test helper

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "admin-token-startup-0123"
H = {"Authorization": f"Bearer {ADMIN}"}


def _sessions(tmp_path):  # type: ignore[no-untyped-def]
    engine = open_database(f"sqlite:///{tmp_path / 's.db'}")
    return engine, sa.orm.sessionmaker(engine)


def _holder() -> str:
    from scheduler.service.lifeline import pid_namespace

    return f"{socket.gethostname()}:{os.getpid()}:test:{pid_namespace()}"


def test_readyz_says_the_scheduler_is_compiling_not_that_nothing_holds_the_lease(tmp_path) -> None:
    engine, sessions = _sessions(tmp_path)
    try:
        now = time.time()
        control.write_activity(sessions, {"holder": _holder(), "phase": "compiling policy kernels",
                                          "since": now - 12, "updated": now - 1})
        why = control.lease_status(sessions, now)
        assert why == "scheduler starting: compiling policy kernels, 12 s"
        assert control.scheduling_note(sessions, now) == why
        # the wait reason names it instead of blaming the policy
        reason = wait_reason(1, 8, False, 0, "gavel", control.scheduling_note(sessions, now))
        assert "compiling policy kernels, 12 s" in reason and "gave it no share" not in reason
        # a stale record (its writer stopped long ago) is not believed
        assert control.lease_status(sessions, now + 60) == "no process holds the scheduling lease"
    finally:
        engine.dispose()


def test_an_expired_lease_of_a_live_holder_says_it_is_alive(tmp_path) -> None:
    engine, sessions = _sessions(tmp_path)
    try:
        assert control.try_lead(sessions, _holder(), 1.0, now=100.0)
        why = control.lease_status(sessions, now=200.0)
        assert f"its holder (pid {os.getpid()}) is alive but has not renewed it" in why
    finally:
        engine.dispose()


class _SlowRounds:
    """A scheduling service whose rounds take `round_s` (the shape of the first Gavel round on
    a busy node): what LoopRunner drives, with a real database."""

    def __init__(self, sessions, round_s: float) -> None:  # type: ignore[no-untyped-def]
        from scheduler.service.types import ServiceConfig
        from policies.types import ClusterCapacity

        self.sessions = sessions
        self.config = ServiceConfig(capacity=ClusterCapacity(gpus=8, cache=1e12, remote_io=1e9), poll_seconds=0.05,
                                    min_event_gap_s=0.05)
        self.policy_name = "fifo"
        self.round_s = round_s
        self.rounds = 0
        self.backend = type("B", (), {"poll": staticmethod(lambda: [])})()

    def recover(self) -> None:
        pass

    def apply_policy(self, name: str) -> None:
        pass

    def apply_events(self, events) -> bool:  # type: ignore[no-untyped-def]
        return False

    def run_round(self, reason: str = "timer"):  # type: ignore[no-untyped-def]
        self.rounds += 1
        time.sleep(self.round_s)
        from scheduler.service.types import RoundResult

        return RoundResult(self.rounds, reason, 0, (), (), (), 0, self.round_s)


def test_the_lease_is_renewed_while_a_round_runs_longer_than_its_ttl(tmp_path, monkeypatch) -> None:
    """The lease was renewed between rounds only: a round longer than the TTL let it expire with
    its holder alive, /readyz said nothing schedules, and another replica could take over."""
    from scheduler.service import loop

    try:
        from scheduler.service import leadership

        monkeypatch.setattr(leadership, "LEASE_TTL_S", 1.0)
    except ImportError:  # (the engine before the keeper thread: the loop renewed the lease itself)
        pass
    monkeypatch.setattr(loop, "LEASE_TTL_S", 1.0, raising=False)
    engine, sessions = _sessions(tmp_path)
    svc = _SlowRounds(sessions, round_s=3.5)
    runner = loop.LoopRunner(svc)
    try:
        runner.start()
        deadline = time.monotonic() + 10
        while svc.rounds == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.rounds == 1, "the first round never started"
        seen = []
        for _ in range(12):  # 3 s inside the round: three TTLs
            time.sleep(0.25)
            seen.append(control.lease_status(sessions))
        assert seen == [None] * 12, seen
        assert not control.try_lead(sessions, "another-replica", 1.0)
    finally:
        runner.stop()
        engine.dispose()


def test_the_kernel_cache_is_shared_by_another_checkout_of_the_same_sources(tmp_path) -> None:
    """numba keyed its cache by the source file's absolute path: every new clone or venv
    compiled every kernel again (a minute for Gavel's at nice +10 on a busy node)."""
    cache = tmp_path / "numba"
    copy = tmp_path / "another-clone"
    for package in ("estimator", "policies", "scheduler/core", "scheduler/sim"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "scheduler" / "__init__.py", copy / "scheduler" / "__init__.py")
    probe = ("import numpy as np\nfrom policies.compiled import pairwise_sum\n"
             "assert pairwise_sum(np.arange(300.0), 300) == np.arange(300.0).sum()\n"
             "print(sum(pairwise_sum.stats.cache_hits.values()), sum(pairwise_sum.stats.cache_misses.values()))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    first = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["0", "1"]  # compiled here
    second = subprocess.run([sys.executable, "-c", probe], cwd=copy, env={**env, "PYTHONPATH": str(copy)},
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["1", "0"], "the other checkout compiled again instead of loading the cache"


def test_warm_up_compiles_every_kernel_a_gavel_round_calls() -> None:
    from policies import gavel_kernel
    from policies.types import ClusterCapacity
    from scheduler.service.warmup import warm_policies

    seconds = warm_policies(ClusterCapacity(gpus=8, cache=2e12, remote_io=1e9, gpus_per_node=4))
    from policies.registry import BUILTIN_POLICIES

    assert set(seconds) == set(BUILTIN_POLICIES) >= {"fifo", "sjf", "gavel", "greedy"}
    for name in ("cache_and_misses", "water_fill_levels", "common_factor"):
        assert getattr(gavel_kernel, name).signatures, f"{name} was not compiled by the warm-up"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path, port: int, log_level: str = "info") -> subprocess.Popen:  # type: ignore[no-untyped-def]
    log = open(tmp_path / "serve.log", "ab")
    return subprocess.Popen(
        [*silod_cmd(), "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path / 'p.db'}",
         "--backend", "null", "--gpus", "8", "--gpus-per-node", "4", "--cache", "200GB", "--remote-io", "1GB/s",
         "--policy", "gavel", "--state-dir", str(tmp_path / "state"), "--log-level", log_level],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SILOD_ADMIN_TOKEN": ADMIN}, start_new_session=True,
    )


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(what)


def test_serve_compiles_before_the_lease_schedules_at_once_and_stops_on_ctrl_c_quietly(tmp_path) -> None:
    port = _port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tmp_path, port)
    try:
        _wait(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 60, "silod serve did not come up")
        assert httpx.post(f"{url}/v1/datasets", headers=H, timeout=10,
                          json={"name": "imagenet", "uri": "s3://datasets/imagenet", "size": "143GB"}).status_code == 201
        _wait(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 240, "/readyz never said ready")
        ready = time.monotonic()
        job = httpx.post(f"{url}/v1/jobs", headers=H, timeout=10,
                         json={"name": "j", "gpus": 1, "dataset": "imagenet", "epochs": 1, "ideal_throughput": "100MB/s"}).json()
        _wait(lambda: httpx.get(f"{url}/v1/jobs/{job['id']}", headers=H, timeout=2).json()["state"] == "running", 10,
              "a Gavel job submitted at ready did not start within 10 s")
        assert time.monotonic() - ready < 10
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
        proc.wait(timeout=60)
    log = (tmp_path / "serve.log").read_text()
    assert log.index("policy kernels ready") < log.index("holds the scheduling lease"), log
    assert "Traceback" not in log and "starting it again" not in log, log
    assert "alembic" not in log, "alembic's INFO lines are noise on every start"


def test_ctrl_c_during_start_up_stops_without_a_traceback(tmp_path) -> None:
    port = _port()
    proc = _serve(tmp_path, port)
    log_file = tmp_path / "serve.log"
    try:
        # while the scheduling process starts (imports, migration check, kernels): the moment a
        # Ctrl-C printed its traceback, and the supervisor started it again
        _wait(lambda: "scheduling process" in log_file.read_text(), 60, "silod serve did not start its scheduler")
        time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    time.sleep(0.5)
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "starting it again" not in log, log
    assert code in (0, 130), (code, log)
