"""`silod demo --quick` end to end: real datasets, data manager, service core, local backend,
FUSE mounts; both runs finish and SiloD's average JCT is not worse than storage-unaware."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scheduler.backends.local import fuse_problems


def _silod_demo_cmd() -> list[str]:
    # `silod demo` once scheduler/cli.py registers scheduler.demo; the same app with it otherwise.
    code = ("import sys; from scheduler.cli import app, main; import scheduler.demo as d; "
            "names = {c.name for c in app.registered_commands}; "
            "'demo' in names or d.register(app); sys.argv[0] = 'silod'; main()")
    return [sys.executable, "-c", code, "demo"]


def test_demo_quick_end_to_end(tmp_path):
    problems = fuse_problems()
    if problems:
        msg = "real FUSE mounts unavailable: " + "; ".join(problems)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    out = tmp_path / "demo.json"
    r = subprocess.run([*_silod_demo_cmd(), "--quick", "--workdir", str(tmp_path / "w"), "--json", str(out)],
                       capture_output=True, text=True, timeout=150, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(out.read_text())
    runs = summary["runs"]
    assert set(runs) == {"silod", "storage-unaware"}
    for run in runs.values():
        assert set(run["states"].values()) == {"finished"}
        assert all(v > 0 for v in run["jct_s"].values())
    assert "Job completion times" in r.stdout and "average JCT" in r.stdout
    # The cache is smaller than the data and the link cannot feed everyone: managing both must pay.
    assert runs["silod"]["avg_jct_s"] < runs["storage-unaware"]["avg_jct_s"]
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read(), "the demo must unmount everything"


def test_demo_without_fuse_fails_clearly(tmp_path, monkeypatch):
    import scheduler.backends.local as local
    from estimator.errors import UserError
    from scheduler.demo import run_demo

    monkeypatch.setattr(local, "fuse_problems", lambda: ["/dev/fuse is missing"])
    with pytest.raises(UserError, match="/dev/fuse is missing"):
        run_demo(tmp_path, quick=True)
