"""The simulator's bottleneck diagnosis: jobs.csv says what bound each job, timeline.csv how many
running jobs each resource bound (scheduler/sim/diagnosis.py). One job per resource, by hand."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

HEADER = "job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,cpu_rate\n"


def _run(tmp_path, name, rows, *flags):
    trace = tmp_path / f"{name}.csv"
    trace.write_text(HEADER + "\n".join(rows) + "\n")
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "scheduler", "simulate", "--trace", str(trace), "--out", str(out), "--quiet", *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with (out / "jobs.csv").open() as fh:
        jobs = {r["job_id"]: r for r in csv.DictReader(fh)}
    with (out / "timeline.csv").open() as fh:
        timeline = list(csv.DictReader(fh))
    return jobs, timeline


def test_one_job_bound_by_each_resource(tmp_path):
    # One GPU per node, 2 cores per node, 10 GB of cache, a 1 GB/s link.
    cluster = ["--gpus", "2", "--gpus-per-node", "1", "--cpus-per-node", "2", "--cache", "10GB", "--remote-io", "1GB/s"]
    # gpu: 50 MB/s, 35 MB/s per core on 2 cores = 70 -> GPU binds; cpu: 100 MB/s on 2 cores -> 70.
    jobs, timeline = _run(tmp_path, "gc", ["g,0,1,m,d1,5GB,50MB/s,2,35MB/s", "c,0,1,m,d2,5GB,100MB/s,2,35MB/s"], *cluster)
    assert jobs["g"]["bottleneck"] == "gpu" and jobs["c"]["bottleneck"] == "cpu"
    # The first epoch reads from the link at 1 GB/s shared: no IO bound there either.
    assert float(jobs["c"]["bound_cpu_s"]) == pytest.approx(float(jobs["c"]["jct_s"]), rel=1e-6)
    assert float(jobs["c"]["jct_s"]) == pytest.approx(10e9 / 70e6, rel=1e-3)
    assert int(timeline[0]["bound_gpu"]) + int(timeline[0]["bound_cpu"]) >= 1
    # remote_io: no cache at all, a 20 MB/s link; cache: 9 of 10 GB cached after its first
    # epoch and an 8 MB/s link (80 MB/s from epoch 2, 15 x 125 s > 1,250 s for epoch 1), where 10%
    # more cache (99% hits) buys more than 10% more link.
    jobs, _ = _run(tmp_path, "io", ["r,0,1,m,d1,5GB,100MB/s,2,"], "--gpus", "1", "--cache", "0", "--remote-io", "20MB/s")
    assert jobs["r"]["bottleneck"] == "remote_io"
    assert float(jobs["r"]["bound_gpu_s"]) == 0.0
    jobs, _ = _run(tmp_path, "cache", ["k,0,1,m,d1,10GB,100MB/s,16,"], "--gpus", "1", "--cache", "9GB", "--remote-io", "8MB/s")
    assert jobs["k"]["bottleneck"] == "cache"
    assert float(jobs["k"]["bound_remote_io_s"]) > 0  # its first epoch (nothing cached yet) was link-bound


def test_no_cpus_per_node_never_cpu_bound(tmp_path):
    jobs, timeline = _run(tmp_path, "nocpu", ["c,0,1,m,d2,5GB,100MB/s,2,35MB/s"], "--gpus", "1", "--cache", "10GB", "--remote-io", "1GB/s")
    assert jobs["c"]["bottleneck"] == "gpu" and float(jobs["c"]["bound_cpu_s"]) == 0.0
    assert all(int(r["bound_cpu"]) == 0 for r in timeline)


def test_simulator_labels_agree_with_the_estimator():
    import numpy as np

    from estimator.pipeline import diagnose
    from scheduler.sim.diagnosis import bound_labels

    rng = np.random.default_rng(3)
    n = 4000
    f = rng.uniform(1, 200, n) * 1e6
    d = np.full(n, 1e11)
    miss = np.where(rng.random(n) < 0.1, 0.0, rng.uniform(0, 1, n))
    b = np.where(rng.random(n) < 0.1, 0.0, rng.uniform(0, 200, n) * 1e6)
    cores = np.where(rng.random(n) < 0.3, np.inf, rng.uniform(0, 8, n))
    rate = np.where(rng.random(n) < 0.3, np.inf, rng.uniform(5, 60, n) * 1e6)
    cpu = np.where(np.isinf(rate), np.inf, cores * rate)
    ours = bound_labels(f, cpu, b, miss)
    theirs = list(diagnose(f, np.ones(n), b, (1 - miss) * d, d, cores, rate).bound)
    assert ours == theirs
