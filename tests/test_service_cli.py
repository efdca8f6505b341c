"""`silod serve` as a real process, driven by `silod dataset-add|submit|jobs|cancel`; state
survives a restart of the server; startup mistakes exit 2 with one clear line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SILOD = [sys.executable, "-c", "from scheduler.cli import main; main()"]
ADMIN_TOKEN = "cli-admin-token-123"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update(extra)
    return env


def _serve(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    cmd = [*SILOD, "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path / 'cli.db'}",
           "--backend", "null", "--gpus", "8", "--gpus-per-node", "4", "--cache", "200GB", "--remote-io", "1GB/s",
           "--tokens", str(tmp_path / "tokens"), "--round", "1s", "--state-dir", str(tmp_path / "state"), *extra]
    proc = subprocess.Popen(cmd, env=_env(SILOD_ADMIN_TOKEN=ADMIN_TOKEN), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"silod serve exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("silod serve did not become healthy")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def _cli(*args: str, token: str, port: int) -> subprocess.CompletedProcess:
    return subprocess.run([*SILOD, *args], env=_env(SILOD_SERVER=f"http://127.0.0.1:{port}", SILOD_TOKEN=token),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_cli_round_trip_and_restart(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("alice:alice-cli-token\nbob:bob-cli-token1\n")
    port = _port()
    proc = _serve(tmp_path, port, "--policy", "sjf")
    try:
        r = _cli("dataset-add", "imagenet", "--uri", "s3://d/imagenet", "--size", "143GB", token="alice-cli-token", port=port)
        assert r.returncode == 0, r.stderr
        r = _cli("submit", "--name", "r50", "--gpus", "4", "--dataset", "imagenet", "--epochs", "2",
                 "--model", "resnet50", token="alice-cli-token", port=port)
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.strip()
        r = _cli("submit", "--name", "big", "--gpus", "64", "--dataset", "imagenet", "--epochs", "1",
                 "--ideal-throughput", "1GB/s", token="alice-cli-token", port=port)
        assert r.returncode == 2 and r.stderr.startswith("error:") and "gpus" in r.stderr and "Traceback" not in r.stderr
        deadline = time.monotonic() + 20  # the submit event triggers a round
        while True:
            jobs = json.loads(_cli("jobs", "--json", token="alice-cli-token", port=port).stdout)
            if jobs[0]["state"] == "running" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [(j["id"], j["state"], j["allocated_gpus"]) for j in jobs] == [(job_id, "running", 4)]
        assert json.loads(_cli("jobs", "--json", token="bob-cli-token1", port=port).stdout) == []
        r = _cli("cancel", job_id, token="bob-cli-token1", port=port)
        assert r.returncode == 2 and "404" in r.stderr
        r = _cli("jobs", token="wrong-token-000", port=port)
        assert r.returncode == 2 and "401" in r.stderr
    finally:
        _stop(proc)

    proc = _serve(tmp_path, port)  # restart: same database, no --policy
    try:
        policy = httpx.get(f"http://127.0.0.1:{port}/v1/policy", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        assert policy["name"] == "sjf"
        jobs = json.loads(_cli("jobs", "--json", token=ADMIN_TOKEN, port=port).stdout)
        assert [j["id"] for j in jobs] == [job_id] and jobs[0]["total_bytes"] == 286e9
        r = _cli("cancel", job_id, token="alice-cli-token", port=port)
        assert r.returncode == 0 and r.stdout.strip() == f"{job_id} cancelled"
    finally:
        _stop(proc)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "nonesuch"], "unknown backend"),
        (["--policy", "lottery"], "unknown policy"),
        (["--listen", "nowhere"], "--listen"),
        (["--round", "soon"], "--round"),
        (["--db", "mysql://x/y"], "unsupported database"),
        (["--cache", "-5GB"], "negative"),
    ],
)
def test_serve_startup_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "tokens").write_text("alice:alice-cli-token\n")
    base = ["serve", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--backend", "null", "--gpus", "8", "--cache", "1TB",
            "--remote-io", "1GB/s", "--tokens", str(tmp_path / "tokens"), "--state-dir", str(tmp_path / "s")]
    r = subprocess.run([*SILOD, *base, *args], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error:") and message in r.stderr and "Traceback" not in r.stderr


ALICE = "alice-cancel-token-123"


@pytest.mark.slow
def test_cancel_sends_the_job_id_as_one_path_segment(tmp_path: Path) -> None:
    """`silod cancel` put the id into the URL as it was: "1/../2" cancelled job 2, and with the
    admin token "../tokens/3" revoked a token. The id is one percent-encoded path segment now."""
    (tmp_path / "tokens").write_text(f"alice:{ALICE}\n")
    port = _port()
    proc = _serve(tmp_path, port)
    try:
        assert _cli("dataset-add", "d1", "--uri", "s3://d/d1", "--size", "1GB", token=ALICE, port=port).returncode == 0
        ids = []
        for name in ("first", "second"):  # 8 GPUs each on an 8-GPU cluster: the second one waits
            r = _cli("submit", "--name", name, "--gpus", "8", "--dataset", "d1", "--epochs", "1",
                     "--ideal-throughput", "1GB/s", token=ALICE, port=port)
            assert r.returncode == 0, r.stderr
            ids.append(r.stdout.strip())
        victim = ids[1]

        for bad in (f"{ids[0]}/../{victim}", "..", f"../jobs/{victim}"):
            r = _cli("cancel", bad, token=ALICE, port=port)
            assert r.returncode == 2, r.stderr
            assert f"no job with id {bad!r}" in r.stderr and "Traceback" not in r.stderr, r.stderr
        # The admin token reaches every route: '../tokens/1' must not become DELETE /v1/tokens/1.
        r = _cli("cancel", "../tokens/1", token=ADMIN_TOKEN, port=port)
        assert r.returncode == 2 and "no job with id '../tokens/1'" in r.stderr, r.stderr
        r = _cli("cancel", "", token=ALICE, port=port)
        assert r.returncode == 2 and r.stderr.startswith("error: JOB_ID is empty"), r.stderr

        r = _cli("jobs", "--json", token=ALICE, port=port)  # alice's token was not revoked
        assert r.returncode == 0, r.stderr
        states = {j["id"]: j["state"] for j in json.loads(r.stdout)}
        assert states[victim] == "queued", states
        assert all(s != "cancelled" for s in states.values()), states
        r = _cli("cancel", victim, token=ALICE, port=port)  # the plain id still works
        assert r.returncode == 0 and r.stdout.strip() == f"{victim} cancelled", r.stderr
    finally:
        _stop(proc)
