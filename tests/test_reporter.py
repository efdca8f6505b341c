"""The training-loop reporter (silod_client.reporter): standard library only, bounded rate, the
step time it measures is the loop's own (not the loader's), and it never fails or slows the loop
when the service is down, slow or answering 500s; against a real `silod serve` its reports reach
the job's measured parameters."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from silod_client.reporter import StepReporter

try:
    from sdk_helpers import Misbehaving, Served, free_port, jbody
except ImportError:
    from tests.sdk_helpers import Misbehaving, Served, free_port, jbody


def _loop(reporter: StepReporter, steps: int, step_s: float = 0.002) -> float:
    """A training loop of `steps` steps; returns the longest time one step() call took."""
    worst = 0.0
    for _ in range(steps):
        time.sleep(step_s)
        t0 = time.perf_counter()
        reporter.step(step_s, 1e6)
        worst = max(worst, time.perf_counter() - t0)
    return worst


def test_standard_library_only() -> None:
    code = ("import sys; import silod_client.reporter; "
            "bad = [m for m in ('httpx', 'pydantic', 'numpy') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_service_down_does_not_fail_the_loop() -> None:
    r = StepReporter("7", f"http://127.0.0.1:{free_port()}", "t", interval=0.05, timeout=0.5)
    worst = _loop(r, 100)
    r.close()
    assert r.failed >= 1 and r.sent == 0 and worst < 0.05
    assert "Connection" in (r.last_error or "") or "URLError" in (r.last_error or "")


def test_slow_service_does_not_slow_the_loop() -> None:
    srv = Misbehaving(lambda *_: (202, {}, jbody({}), 3.0))
    try:
        r = StepReporter("7", srv.url, "t", interval=0.05, timeout=1.0)
        t0 = time.perf_counter()
        worst = _loop(r, 150)
        loop_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        r.close(timeout=0.2)
        assert time.perf_counter() - t1 < 1.0 and worst < 0.05
        assert loop_s < 150 * 0.002 + 1.5  # the loop never waited for a 3 s answer
        # In flight one at a time: a slow service gets no pile-up of requests.
        assert 1 <= len(srv.requests) <= 3
    finally:
        srv.close()


def test_500s_do_not_fail_the_loop_and_back_off() -> None:
    srv = Misbehaving(lambda *_: (500, {}, jbody({"detail": "internal error"}), 0.0))
    try:
        r = StepReporter("7", srv.url, "t", interval=0.05, timeout=1.0)
        _loop(r, 200)  # about 0.5 s: 10 intervals, but the failures double the wait each time
        r.close()
        assert r.failed >= 2 and r.sent == 0 and r.last_error == "HTTP 500"
        assert len(srv.requests) <= 8
    finally:
        srv.close()


def test_bounded_rate_means_and_wrap_time_the_loop_not_the_loader() -> None:
    srv = Misbehaving(lambda *_: (202, {}, jbody({}), 0.0))
    try:
        r = StepReporter("a/b", srv.url, "tok", interval=0.3)

        def loader():  # type: ignore[no-untyped-def]
            for i in range(40):
                time.sleep(0.03)  # input wait: not step time
                yield bytes(1000 + i % 2)

        for batch in r.wrap(loader(), batch_bytes=len):
            time.sleep(0.01)  # the step
        r.close()
        sent = [json.loads(b) for _m, _p, _h, b in srv.requests]
        # 40 x 40 ms = 1.6 s at one report per 0.3 s at most, plus the final one
        assert 2 <= len(sent) <= 7, sent
        assert all(0.008 < s["step_seconds"] < 0.02 for s in sent), sent
        assert all(1000 <= s["batch_bytes"] <= 1001 for s in sent)
        method, path, headers, _ = srv.requests[0]
        assert method == "POST" and path == "/v1/jobs/a%2Fb/report" and headers["authorization"] == "Bearer tok"
    finally:
        srv.close()


def test_without_the_environment_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SILOD_JOB_ID", "SILOD_SERVER", "SILOD_TOKEN", "SILOD_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    r = StepReporter(interval=0.05)
    assert not r.enabled
    assert list(r.wrap([1, 2, 3], batch_bytes=10)) == [1, 2, 3]
    r.close()
    assert r.sent == r.failed == 0


def test_reports_reach_a_real_service(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from silod_client import Client

    served = Served(tmp_path)
    try:
        with Client(served.url, served.tokens["alice"]) as alice:
            alice.datasets.register("d", "s3://b/d", "10GB")
            job = alice.jobs.submit("j", gpus=1, dataset="d", epochs=1, ideal_throughput="400MB/s")
            alice.jobs.wait(job.id, {"running"}, timeout=30, interval=0.2)
            token_file = tmp_path / "token"
            token_file.write_text(served.tokens["alice"] + "\n")
            monkeypatch.setenv("SILOD_JOB_ID", job.id)
            monkeypatch.setenv("SILOD_SERVER", served.url)
            monkeypatch.delenv("SILOD_TOKEN", raising=False)
            monkeypatch.setenv("SILOD_TOKEN_FILE", str(token_file))
            r = StepReporter(interval=0.1)
            for _ in range(30):
                time.sleep(0.01)
                r.step(0.25, 50e6)  # f* = 200 MB/s, half what it declared
            r.close()
            assert r.sent >= 1 and r.failed == 0
            got = alice.jobs.get(job.id).measured_parameters
            assert got is not None and got.client_ideal_throughput == pytest.approx(200e6)
            assert got.ideal_throughput == pytest.approx(200e6)  # a client's f* lowers the one planning uses
            # A wrong token: refused, reporting stops, the loop goes on.
            bad = StepReporter(job.id, served.url, "wrong-token-000000", interval=0.05)
            _loop(bad, 60)
            bad.close()
            assert not bad.enabled and bad.failed == 1 and bad.last_error == "HTTP 401"
    finally:
        served.stop()
