"""A real PyTorch job end to end (issue 49): the example training script (a CNN on JPEGs decoded
by a DataLoader's worker processes) submitted through the SDK to a real `silod serve --backend
local` with a real data manager, reading its dataset through a real FUSE mount, reporting its
step times through silod_client.reporter; and the service's measured parameters: a job that
declares twice its real f* (and then one that declares half of it) is planned within 15% of the
f* it is measured reading at, within a few of the scheduler's 2 s intervals.

Needs torch (`pip install torch==2.13.0`), /dev/fuse and root: skipped with the reason where they
are missing, except under CI=true, where a missing one fails."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

from scheduler.backends.local import fuse_problems

try:
    from sdk_helpers import Served
except ImportError:
    from tests.sdk_helpers import Served

pytestmark = [pytest.mark.fuse, pytest.mark.slow]


def _need(problem: str | None) -> None:
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true must run the PyTorch job: {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="module", autouse=True)
def _requirements() -> None:
    from scheduler.demo import torch_problem

    _need(torch_problem())
    problems = fuse_problems()
    _need("real FUSE mounts are not possible here: " + "; ".join(problems) if problems else None)


def _alone_fstar(data: Path) -> float:
    """The job's f*: its steady throughput alone on the local copy (no mount, no limit)."""
    from silod_client.examples.train_cnn import parser, train

    args = parser().parse_args(["--data", str(data), "--epochs", "3", "--workers", "2"])
    epochs = train(args)
    later = epochs[1:]
    return sum(e["bytes"] for e in later) / sum(e["seconds"] for e in later)


#: Seconds each job reads for (at the speed it had alone): the 5 s warm-up after its first read and
#: about ten 2 s intervals, whose mean is what the test checks at the end (one interval's rate
#: moves by tens of percent on a loaded machine).
READ_S = 30.0


def _run(alice, tmp_path: Path, data: Path, declared: float, epochs: int) -> dict:
    """Submit the example job, poll it every 0.5 s until it ends; what it did and how it was planned."""
    job = alice.jobs.submit(
        "cnn", gpus=1, dataset="jpegs", epochs=epochs, ideal_throughput=declared,
        program={"command": [sys.executable, "-m", "silod_client.examples.train_cnn", "--epochs", str(epochs),
                             "--workers", "2", "--report-interval", "2", "--stats", "stats.json"],
                 "env": {"OMP_NUM_THREADS": "1"}})
    jdir = tmp_path / "state" / "local" / "jobs" / job.id
    # (evidence s, f* planning uses, f* the client reports, the last interval's read rate, epochs done)
    samples: list[tuple[float, float, float, float, int]] = []
    mount_seen = False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        j = alice.jobs.get(job.id)
        if j.state == "running":
            mount_seen = mount_seen or os.path.ismount(jdir / "mnt")
            mp = j.measured_parameters
            if mp is not None:
                try:
                    done = len(json.loads((jdir / "stats.json").read_text())["epochs"])
                except (OSError, ValueError, KeyError):
                    done = 0
                samples.append((mp.ideal_evidence_s, mp.ideal_throughput, mp.client_ideal_throughput or 0.0,
                                mp.observed_throughput or 0.0, done))
        if j.done:
            break
        time.sleep(0.5)
    final = alice.jobs.get(job.id)
    log = (jdir / "program.log").read_text(errors="replace") if (jdir / "program.log").exists() else ""
    assert final.state == "finished", f"{final.state}: {final.message}\n{log[-2000:]}"
    stats = json.loads((jdir / "stats.json").read_text())["epochs"]
    return {"job": final, "jdir": jdir, "samples": samples, "mount_seen": mount_seen, "stats": stats}


def _measured(stats: list[dict], start_s: float, end_s: float = float("inf")) -> float:
    """The job's own read rate over its epochs that start between `start_s` and `end_s` seconds
    after its first (the service counts no interval in the first 5 s of reading:
    measured_params.WARMUP_S)."""
    t, nbytes, seconds = 0.0, 0, 0.0
    for e in stats:
        if start_s <= t < end_s:
            nbytes += e["bytes"]
            seconds += e["seconds"]
        t += e["seconds"]
    assert seconds > 0, f"the job read for {t:.1f} s: no epoch starts in [{start_s}, {end_s}) s"
    return nbytes / seconds


def _measured_until(stats: list[dict], start_s: float, epochs_done: int) -> float:
    """The job's own read rate over its epochs that start `start_s` seconds or more after its
    first and end by the `epochs_done`-th (at least the first such epoch)."""
    t, nbytes, seconds = 0.0, 0, 0.0
    for k, e in enumerate(stats):
        if t >= start_s and (k < epochs_done or seconds == 0):
            nbytes += e["bytes"]
            seconds += e["seconds"]
        t += e["seconds"]
    assert seconds > 0, f"no epoch starts {start_s} s after the first"
    return nbytes / seconds


def test_pytorch_job_through_the_mount_reports_and_its_declared_fstar_converges(tmp_path: Path) -> None:
    from scheduler.demo import DataManager, make_jpegs
    from scheduler.service.measured_params import WARMUP_S
    from silod_client import Client

    data = tmp_path / "remote" / "jpegs"
    size = make_jpegs(data, 150, seed=3)
    fstar = _alone_fstar(data)
    # Enough epochs for READ_S seconds of reading at the speed it has alone (under silod it
    # differs by what the mount and the load cost: the service must find that out).
    epochs = max(16, min(400, round(READ_S * fstar / size)))
    dm = DataManager(tmp_path / "dm", tmp_path / "dm.log")
    served = Served(tmp_path, "--datamanager", dm.url, "--allow-uri", (tmp_path / "remote").as_uri() + "/",
                    "--gpus", "2", "--gpus-per-node", "2", "--cache", "100MB", "--remote-io", "100MB/s", "--round", "2s",
                    backend="local")
    try:
        with Client(served.url, served.tokens["alice"]) as alice:
            alice.datasets.register("jpegs", data.as_uri(), size, item_count=150)
            runs = {}
            for label, factor in (("2x too high", 2.0), ("2x too low", 0.5)):
                r = runs[label] = _run(alice, tmp_path, data, factor * fstar, epochs)
                final, stats = r["job"], r["stats"]
                assert r["mount_seen"], "the job never ran with its dataset mounted"
                assert final.consumed_bytes == pytest.approx(final.total_bytes)
                assert len(stats) == epochs and all(e["items"] == 150 and e["bytes"] == size for e in stats)
                # Every byte came through the mount (the first job filled the data manager's cache).
                mount_stats = json.loads((r["jdir"] / "mount-stats.json").read_text())
                assert mount_stats["read_bytes"] >= epochs * size * 0.99
                # The helper reported from inside the DataLoader loop, and the reports arrived.
                assert stats[-1]["reports_sent"] >= 3 and stats[-1]["reports_failed"] == 0
                assert any(client > 0 for _e, _u, client, *_ in r["samples"]), r["samples"]
            first = json.loads((runs["2x too high"]["jdir"] / "mount-stats.json").read_text())
            assert first["miss_bytes"] >= size * 0.99
            for label, r in runs.items():
                declared = r["job"].ideal_throughput
                measured = _measured(r["stats"], WARMUP_S)
                # While it reads: the interval in which it stops reading (its program then exits,
                # which takes seconds) is partly idle, and a job that stopped needs no plan.
                evidenced = [(ev, used) for ev, used, _c, _o, done in r["samples"] if ev > 0 and done <= epochs - 2]
                print(f"{label}: f* alone {fstar:.4g} B/s, declared {declared:.4g}, measured under silod"
                      f" {measured:.4g}; (evidence s, planned, client, last interval, epochs done):"
                      f" {[(round(ev), round(u), round(c), round(o), n) for ev, u, c, o, n in r['samples']]}")
                # Planning moved from the declaration to the job's measured f*: within 15% after at
                # most four of the scheduler's 2 s intervals of evidence, and within 15% at the end
                # (on a loaded machine the job's speed moves by tens of percent within a minute, and
                # the estimate follows the mean of what it read).
                assert evidenced, f"{label}: no interval of the job was evidence of its f* ({r['samples']})"
                # Early: against what the job itself read (its own epoch timings) from the warm-up
                # to that moment; the machine's load can move its speed later in the run.
                early = [(u, _measured_until(r["stats"], WARMUP_S, n)) for ev, u, _c, _o, n in r["samples"]
                         if 0 < ev <= 8.0 and n <= epochs - 2]
                assert any(abs(u / m - 1) <= 0.15 for u, m in early), (label, early, measured, declared)
                last = evidenced[-1][1]
                assert abs(last / measured - 1) <= 0.15, (label, last, measured, declared)
    finally:
        served.stop()
        dm.close()
