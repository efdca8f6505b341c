"""benchmarks/bench_cold_vs_rclone.py's set-up: the A-B-B-A order, the fresh journaled file
system each run's cache gets (a real loop mount; root), and its bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_cold_vs_rclone as bench  # noqa: E402


def test_runs_alternate_a_b_b_a():
    assert bench.abba(["silod", "rclone"], 2) == [("silod", 0), ("rclone", 0), ("rclone", 1), ("silod", 1)]
    assert bench.abba(["silod"], 3) == [("silod", 0), ("silod", 1), ("silod", 2)]


def test_each_run_gets_a_fresh_journaled_ext4_removed_after(tmp_path):
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("loop mounts need root")
        pytest.skip("loop mounts need root")
    fs = bench.CacheFs("loop", tmp_path / "cache-silod-0", 64 << 20)
    try:
        mounts = Path("/proc/self/mounts").read_text()
        line = next(m for m in mounts.splitlines() if m.split()[1] == str(fs.path))
        assert line.split()[2] == "ext4"
        features = subprocess.run(["dumpe2fs", "-h", str(fs.image)], capture_output=True, text=True).stdout
        assert "has_journal" in features
        assert os.listdir(fs.path) == ["lost+found"]  # nothing of an earlier run
    finally:
        fs.close()
    assert str(fs.path) not in Path("/proc/self/mounts").read_text()
    assert not fs.image.exists() and not fs.path.exists()


def test_root_keeps_a_plain_directory(tmp_path):
    fs = bench.CacheFs("root", tmp_path / "cache-rclone-0", 1 << 30)
    assert fs.path.is_dir() and not fs.image.exists()
    fs.close()
    assert not fs.path.exists()


@pytest.mark.parametrize("args, word", [(["--runs", "0"], "--runs"), (["--cache-fs", "tmpfs"], "--cache-fs")])
def test_bad_options_exit_2_naming_the_option(args, word):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_cold_vs_rclone.py"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and word in r.stderr, r.stderr
