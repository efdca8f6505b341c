"""The benchmark scripts refuse bad arguments before they start any server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", ["0", "-5", "nan", "1e9", "ten"])
def test_bench_api_fairness_refuses_bad_seconds(value):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_api_fairness.py"), "--seconds", value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--seconds" in out.stderr


@pytest.mark.parametrize("args, flag", [(["--base", "no-such-revision"], "--base"),
                                        (["--base", "HEAD", "--cells", "fifo/lru"], "--cells"),
                                        (["--base", "HEAD", "--cells", "fifo"], "--cells"),
                                        (["--base", "HEAD", "--out", "/no/such/dir/ab.json"], "--out")])
def test_bench_sim_ab_refuses_a_bad_revision_or_cell(args, flag):
    """Refused before any worktree is made or engine runs."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sim_ab.py"), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert flag in out.stderr


@pytest.mark.parametrize("args, flag", [(["--requests", "0"], "--requests"), (["--requests", "ten"], "--requests"),
                                        (["--carol", "-1"], "--carol"), (["--carol", "1e9"], "--carol")])
def test_bench_api_tenant_cost_refuses_bad_counts(args, flag):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_api_tenant_cost.py"), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert flag in out.stderr


@pytest.mark.parametrize("args, flag", [(["--requests", "0"], "--requests"), (["--blocks", "-1"], "--blocks"),
                                        (["--active", "1"], "--active"), (["--active", "many"], "--active")])
def test_bench_api_cpu_refuses_bad_counts(args, flag):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_api_cpu.py"), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert flag in out.stderr


@pytest.mark.slow
def test_bench_api_measures_silod_once_its_scheduling_process_is_ready(tmp_path):
    """bench_api's first cells (POST at 16 and 64 clients, the ones that missed their target in
    some runs) started at /healthz, while the scheduling process was still compiling its policy
    kernels beside the API workers (a CPU profile of the cell: over half of that process's
    samples). The benchmark now starts at /readyz."""
    import os
    import signal

    import httpx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_api
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    bench_api.prepare_db(tmp_path / "s.db", 10)
    proc, url = bench_api.start_silod(tmp_path, tmp_path / "s.db", 1)
    try:
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
