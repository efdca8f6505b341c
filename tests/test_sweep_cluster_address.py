"""Sweeps on Dask or Ray are not open doors (issue 47, Build 3).

Dask and Ray run any Python a client sends, and the silod client unpickles what the scheduler
sends back: a cluster reachable from the network without TLS is remote code execution for
anyone who reaches its port (and a hostile scheduler runs code in the client). `silod experiment
--dask/--ray ADDRESS` refuses such an address before connecting, unless the operator says
--insecure-cluster. On main, 10.0.0.1 was dialled as given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.errors import UserError
from scheduler.sim.experiments import Executor, check_cluster_address


@pytest.mark.parametrize("address", ["tcp://10.0.0.1:8786", "10.0.0.1:8786", "tcp://scheduler.example:8786",
                                     "ws://192.168.1.5:8786", "tcp://[2001:db8::1]:8786", "tcp://0.0.0.0:8786"])
def test_a_plain_dask_address_off_this_machine_is_refused(address):
    with pytest.raises(UserError, match="not a loopback address and not tls://.*--insecure-cluster"):
        Executor("dask", address)
    Executor("dask", address, insecure=True)  # the operator vouches for the network


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:8786", "127.0.0.1:8786", "tcp://localhost:8786",
                                     "tcp://[::1]:8786", "tls://10.0.0.1:8786", "tls://scheduler.example:8786",
                                     "inproc://x"])
def test_loopback_or_tls_dask_addresses_are_accepted(address):
    check_cluster_address("dask", address)


def test_ray_needs_loopback_or_its_tls(monkeypatch):
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    with pytest.raises(UserError, match="Ray has no authentication of its own"):
        Executor("ray", "10.0.0.1:6379")
    check_cluster_address("ray", "127.0.0.1:6379")
    Executor("ray", "10.0.0.1:6379", insecure=True)
    monkeypatch.setenv("RAY_USE_TLS", "1")
    check_cluster_address("ray", "10.0.0.1:6379")


def test_the_cli_refuses_before_connecting(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("RAY_USE_TLS", None)
    cmd = [sys.executable, "-c", "from scheduler.cli import main; main()", "experiment", "micro", "--quiet"]
    for flag, address in (("--dask", "tcp://10.0.0.1:8786"), ("--ray", "10.0.0.1:6379")):
        proc = subprocess.run([*cmd, flag, address, "--out", str(tmp_path / "o")], capture_output=True, text=True,
                              timeout=120, env=env, stdin=subprocess.DEVNULL)
        assert proc.returncode != 0 and "--insecure-cluster" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert "cannot reach" not in proc.stderr  # refused, not dialled
