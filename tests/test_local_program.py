"""The local backend runs a job's own program (JobIn.program) on its real FUSE mount: the program
sees SILOD_DATA, SILOD_JOB_ID, SILOD_SERVER and its report token (never in the job's files), its
progress is what the mount served, exit 0 finishes the job and another code fails it with the
program's last lines; a stop ends the program and leaves no mount."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from policies.types import ClusterCapacity
from scheduler.backends.base import BackendConfig, JobAllocation
from scheduler.backends.local import LocalBackend
from scheduler.service.types import JobProgram

try:
    from test_local_backend import _fuse, collect, make_dataset, mounts_under, spec  # noqa: F401 (the fixture)
except ImportError:
    from tests.test_local_backend import _fuse, collect, make_dataset, mounts_under, spec  # noqa: F401

READ_ALL = """
import json, os, sys
root = os.environ["SILOD_DATA"]
total = 0
for _ in range(int(sys.argv[1])):
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name), "rb") as f:
            total += len(f.read())
env = {k: os.environ.get(k) for k in ("SILOD_DATA", "SILOD_JOB_ID", "SILOD_SERVER", "SILOD_TOKEN", "MY_SETTING")}
json.dump({"read": total, "env": env}, open("out.json", "w"))
sys.exit(int(sys.argv[2]))
"""


def backend(tmp: Path) -> LocalBackend:
    return LocalBackend(BackendConfig(capacity=ClusterCapacity(gpus=2, cache=1e9, remote_io=1e9), state_dir=tmp / "state",
                                      options={"api_url": "http://127.0.0.1:9"}))


def program_spec(tmp: Path, job_id: str, epochs: int, code: int) -> object:
    d = make_dataset(tmp / "remote" / "ds", n=12)
    s = spec(job_id, f"ds-{job_id}", tmp / "remote" / "ds", d, 1e9, epochs)
    return dataclasses.replace(s, program=JobProgram((sys.executable, "-c", READ_ALL, str(epochs), str(code)),
                                                     (("MY_SETTING", "x"),)), report_token="job-token-123"), d


def test_program_runs_on_the_mount_and_finishes(tmp_path: Path) -> None:
    b = backend(tmp_path)
    s, d = program_spec(tmp_path, "7", 2, 0)
    b.start(s, JobAllocation("7", 1, 1.0, 1e9, None))
    events = collect(b, {"7"}, 90)
    assert [e.kind for e in events if e.kind != "progress"] == ["finished"]
    jdir = tmp_path / "state" / "local" / "jobs" / "7"
    out = json.loads((jdir / "out.json").read_text())
    assert out["read"] == 2 * d
    assert out["env"] == {"SILOD_DATA": str(jdir / "mnt"), "SILOD_JOB_ID": "7", "SILOD_SERVER": "http://127.0.0.1:9",
                          "SILOD_TOKEN": "job-token-123", "MY_SETTING": "x"}
    status = json.loads((jdir / "status.json").read_text())
    assert status["consumed_bytes"] == 2 * d and status["mount"]["read_bytes"] >= 2 * d
    assert "job-token-123" not in "".join(p.read_text(errors="replace") for p in jdir.glob("*.json") if p.name != "out.json")
    assert mounts_under(tmp_path) == []


def test_program_failure_fails_the_job_with_its_output(tmp_path: Path) -> None:
    b = backend(tmp_path)
    s, _d = program_spec(tmp_path, "8", 1, 3)
    b.start(s, JobAllocation("8", 1, 1.0, 1e9, None))
    events = collect(b, {"8"}, 90)
    failed = [e for e in events if e.kind == "failed"]
    assert len(failed) == 1 and "exited with code 3" in failed[0].message
    assert mounts_under(tmp_path) == []


def test_stopping_ends_the_program(tmp_path: Path) -> None:
    b = backend(tmp_path)
    s, _d = program_spec(tmp_path, "9", 1, 0)
    s = dataclasses.replace(s, program=JobProgram((sys.executable, "-c", "import time; time.sleep(600)"), ()))
    b.start(s, JobAllocation("9", 1, 1.0, 1e9, None))
    deadline = time.time() + 60
    while time.time() < deadline and (b.job_status("9") or {}).get("state") != "running":
        time.sleep(0.2)
    assert (b.job_status("9") or {}).get("state") == "running"
    t0 = time.time()
    b.stop("9")
    assert time.time() - t0 < 20 and "9" not in b.running_jobs()
    assert [e.kind for e in b.poll() if e.kind != "progress"] == []  # stopped on request: not a failure
    assert mounts_under(tmp_path) == []
