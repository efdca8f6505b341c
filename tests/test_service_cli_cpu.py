"""`silod serve --cpus-per-node` and `silod submit --cpu-rate` as real processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

try:
    from test_service_cli import _cli, _port, _serve, _stop
except ImportError:  # tests/ imported as a package
    from tests.test_service_cli import _cli, _port, _serve, _stop


@pytest.mark.slow
def test_cores_over_the_cli(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("alice:alice-cli-token\n")
    port = _port()
    proc = _serve(tmp_path, port, "--cpus-per-node", "4")
    try:
        assert _cli("dataset-add", "imagenet", "--uri", "s3://d/imagenet", "--size", "143GB", token="alice-cli-token", port=port).returncode == 0
        r = _cli("submit", "--name", "r50", "--gpus", "4", "--dataset", "imagenet", "--epochs", "2", "--ideal-throughput", "400MB/s",
                 "--cpu-rate", "35MB/s", token="alice-cli-token", port=port)
        assert r.returncode == 0, r.stderr
        r = _cli("submit", "--name", "x", "--gpus", "1", "--dataset", "imagenet", "--epochs", "2", "--ideal-throughput", "1MB/s",
                 "--cpu-rate", "fast", token="alice-cli-token", port=port)
        assert r.returncode == 2 and "--cpu-rate" in r.stderr and "Traceback" not in r.stderr
        # The first round waits for the policy kernels' compile, which a fresh venv on a loaded
        # machine has taken 54 s for.
        deadline = time.monotonic() + 150
        while True:
            jobs = json.loads(_cli("jobs", "--json", token="alice-cli-token", port=port).stdout)
            if jobs[0]["state"] == "running" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert jobs[0]["cpu_rate"] == 35e6
        assert jobs[0]["allocated_cpus"] == pytest.approx(4.0)  # needs 11.4, its node has 4
        wide = _cli("jobs", "--wide", token="alice-cli-token", port=port).stdout
        assert "cores" in wide and "4.0" in wide
        # The default table (80 columns) names what bounds each running job and its f*.
        plain = _cli("jobs", token="alice-cli-token", port=port).stdout
        assert "bound" in plain and "cpu" in plain, plain
        assert "f* (measured)" in plain and "400MB/s" in plain, plain  # a rate says /s
        assert max(len(line) for line in plain.splitlines()) <= 80, plain
    finally:
        _stop(proc)
