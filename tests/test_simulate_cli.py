"""`silod simulate` end to end: the contract's outputs, and one clear error for each bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

SILOD = [sys.executable, "-m", "scheduler"]
HEADER = "job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs\n"
SUMMARY_KEYS = {"policy", "cache_system", "jobs", "avg_jct_s", "makespan_s", "p50_jct_s", "p99_jct_s",
                "avg_fairness_ratio", "gpu_utilization", "remote_io_utilization", "sim_wall_s", "sim_cpu_s"}


def silod(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*SILOD, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_default_simulation_writes_the_contract_outputs(tmp_path):
    out = tmp_path / "out"
    proc = silod("simulate", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["policy"] == "fifo" and summary["cache_system"] == "silod"
    with (out / "jobs.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == summary["jobs"] > 0
    assert {"job_id", "submit_s", "start_s", "finish_s", "jct_s"} <= set(rows[0])
    for row in rows:
        assert float(row["finish_s"]) >= float(row["start_s"]) >= float(row["submit_s"])
    timeline = (out / "timeline.csv").read_text().splitlines()
    assert timeline[0].startswith("time_s,running_jobs") and len(timeline) > 2


#: The Gavel msr traces ship in the repository (MIT, with their licence).
SHIPPED_GAVEL = Path(__file__).resolve().parents[1] / "traces" / "gavel-msr"


def _shared_traces() -> Path:
    """The traces silod may not ship (Alibaba's openb, which users get with `silod trace fetch`)
    live in shared/ beside the repository, or beside the repository this one was cloned from
    (a clone made elsewhere, e.g. /tmp)."""
    repo = Path(__file__).resolve().parents[1]
    candidates = [repo.parent / "shared" / "traces"]
    origin = subprocess.run(["git", "-C", str(repo), "config", "--get", "remote.origin.url"], capture_output=True, text=True)
    url = origin.stdout.strip().removeprefix("file://")
    if origin.returncode == 0 and url.startswith("/"):
        candidates.append(Path(url).resolve().parent / "shared" / "traces")
    git_common = subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-common-dir"], capture_output=True, text=True)
    if git_common.returncode == 0 and git_common.stdout.strip():  # a worktree: beside the main checkout
        candidates.append((repo / git_common.stdout.strip()).resolve().parent.parent / "shared" / "traces")
    return next((c for c in candidates if c.is_dir()), candidates[0])


def test_gavel_trace_with_cluster_file(tmp_path):
    trace = SHIPPED_GAVEL / "23dbec.trace"
    assert trace.is_file(), f"{trace} missing: the msr traces ship in traces/gavel-msr"
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("gpus: 32\ngpus_per_node: 4\ncache: 8TB\nremote_io: 2Gbps\n")
    proc = silod("simulate", "--trace", str(trace), "--format", "gavel", "--cluster", str(cluster),
                 "--policy", "gavel", "--cache-system", "alluxio", "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["jobs"] == len(trace.read_text().splitlines())
    assert summary["cluster"]["remote_io_bytes_per_s"] == 250e6


def write(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(header + body)
    return path


@pytest.mark.parametrize(
    ("header", "body", "expected"),
    [
        ("job_id,submit_time,num_gpus,model,dataset,dataset_size,epochs\n", "a,0,1,resnet50,imagenet-1k,143GB,1\n", "missing column(s) ideal_throughput"),
        (HEADER, "a,0,1,x,d,-5GB,,1\n", "line 2, column 'dataset_size'"),
        (HEADER, "a,0,1,x,d,12 parsecs,10MB/s,1\n", "column 'dataset_size'"),
        (HEADER, "a,0,1,x,d,5XB,10MB/s,1\n", "unknown unit 'X'"),
        (HEADER, "a,0,1,gpt-9,d,5GB,,1\n", "unknown model 'gpt-9'"),
        (HEADER, "a,0,1,x,d,5GB,10MB,1\n", "has no time unit"),
        (HEADER, "a,0,0,x,d,5GB,10MB/s,1\n", "column 'num_gpus'"),
        (HEADER, "a,0,1.5,x,d,5GB,10MB/s,1\n", "column 'num_gpus'"),
        (HEADER, "a,0,1,x,d,5GB,10MB/s,-1\n", "column 'epochs'"),
        (HEADER, "a,0,1,x,d,5GB,10MB/s,1\na,1,1,x,d,5GB,10MB/s,1\n", "duplicate job id"),
        (HEADER, "", "no jobs"),
        ("", "", "the file is empty"),
        (HEADER, "a,0,1,x,d,5GB,10MB/s,1\nb,0,1,x,d,6GB,10MB/s,1\n", "one dataset has one size"),
        (HEADER, "a,0,1,x,d,1e400,10MB/s,1\n", "column 'dataset_size'"),
    ],
    ids=["missing-column", "negative-size", "nonsense-size", "unknown-unit", "unknown-model", "rate-without-time",
         "zero-gpus", "fractional-gpus", "negative-epochs", "duplicate-id", "no-jobs", "empty-file", "two-sizes", "huge-number"],
)
def test_bad_trace_gives_one_clear_error_and_exit_2(tmp_path, header, body, expected):
    trace = write(tmp_path, body, header)
    proc = silod("simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert str(trace) in proc.stderr or "empty" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "summary.json").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--policy", "lottery"], "unknown policy 'lottery'; choose one of: fifo, fifo-strict, gavel, greedy, sjf"),
        (["--cache-system", "redis"], "unknown cache system 'redis'; choose one of: silod, alluxio, coordl, quiver"),
        (["--gpus", "1"], "needs 2 GPUs but the cluster has 1"),
        (["--cache", "-1TB"], "is negative"),
        (["--remote-io", "1GB"], "has no time unit"),
        (["--remote-io", "0"], "--remote-io must be > 0"),
        (["--gpus", "many"], "is not a whole number"),
        (["--trace", "/nonexistent.csv"], "does not exist"),
        (["--resolution", "0"], "resolution 0"),
        # Was a MemoryError reported as "a bug in silod" (745 GiB for one job's chunk order).
        (["--resolution", "100000000000"], "is more than 65,536 chunks per dataset"),
        (["--gpu-speed", "-2"], "must be a positive factor"),
    ],
)
def test_bad_flags_give_clear_errors(tmp_path, args, expected):
    trace = write(tmp_path, "a,0,2,x,d,5GB,10MB/s,1\n")
    proc = silod("simulate", "--trace", str(trace), *args, "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nonsense"], "unknown experiment 'nonsense'; choose one of: matrix, fairness, bandwidth, gpu-speed, sharing, quiver-noise, micro, curriculum, irregular-mix, cpu, stagger, alibaba, autocache, all"),
        (["matrix", "--max-jobs", "0"], "--max-jobs 0 must be >= 1"),
        (["matrix", "--remote-io", "fast"], "--remote-io"),
        (["matrix", "--trace", "/nonexistent.trace"], "not found"),
        (["micro", "--workers", "0"], "--workers 0 must be >= 1"),
        (["micro", "--workers", "two"], "--workers"),
        (["micro", "--resolution", "100000000"], "is more than 65,536 chunks per dataset"),
    ],
)
def test_bad_experiment_input_gives_clear_errors(tmp_path, args, expected):
    proc = silod("experiment", *args, "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sweep_experiment_writes_json_and_plot(tmp_path):
    proc = silod("experiment", "sharing", "--max-jobs", "12", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads((tmp_path / "sharing.json").read_text())
    assert payload["fractions"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert set(payload["avg_jct_s"]) == {"fifo", "sjf", "gavel"}
    assert all(len(v) == 5 and min(v) > 0 for v in payload["avg_jct_s"].values())
    assert (tmp_path / "sharing.png").stat().st_size > 1000


def test_curriculum_experiment_uniform_and_lru_agree(tmp_path):
    """Fig. 16b: for curriculum learning LRU caching is as good as uniform caching (a newly
    cached item is useful at once), at both Steps, over 5 seeds each."""
    proc = silod("experiment", "curriculum", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads((tmp_path / "curriculum.json").read_text())
    assert set(payload["jct_min"]) == {"50k", "75k"}
    for step, modes in payload["jct_min"].items():
        assert len(modes["uniform"]["runs_min"]) == len(modes["LRU"]["runs_min"]) == 5
        # Ideal is 367 min; the link is below f*, so both stall somewhat, and equally.
        assert 367 < modes["uniform"]["mean_min"] < 600
        assert modes["LRU"]["mean_min"] == pytest.approx(modes["uniform"]["mean_min"], rel=0.02), step
    assert (tmp_path / "curriculum.png").stat().st_size > 1000


def test_irregular_mix_experiment_reports_both_kinds(tmp_path):
    proc = silod("experiment", "irregular-mix", "--max-jobs", "40", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads((tmp_path / "irregular_mix.json").read_text())
    table = payload["avg_jct_s"]
    assert list(table) == ["0%", "10%", "25%", "50%"]
    for fraction, rows in table.items():
        assert set(rows) == {"partition", "all regular", "all LRU"}
        for row in rows.values():
            assert row["all"] > 0
            assert ("irregular" in row) == (fraction != "0%")
    # With no curriculum job the partition changes nothing: the same run as all regular.
    assert table["0%"]["partition"]["all"] == pytest.approx(table["0%"]["all regular"]["all"], rel=1e-9)
    assert (tmp_path / "irregular_mix.png").stat().st_size > 1000


def test_window_average_weights_each_row_by_its_time_inside_the_window():
    from scheduler.sim.experiments import window_average

    rows = ((100.0, 1.0), (300.0, 0.5), (400.0, float("nan")), (600.0, 2.0))
    # [0,100] at 1.0, [100,300] at 0.5; the NaN row is left out; [400,500] at 2.0: (100 + 100 + 200) / 400
    assert window_average(rows, 500.0) == pytest.approx(1.0)
    assert window_average(rows, 200.0) == pytest.approx((100 * 1.0 + 100 * 0.5) / 200)


def test_fairness_experiment_averages_every_system_over_one_common_window(tmp_path):
    # 8 GPUs make the first 30 jobs of the synthetic trace queue under every cache system.
    proc = silod("experiment", "fairness", "--max-jobs", "30", "--gpus", "8", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads((tmp_path / "fairness.json").read_text())
    assert payload["window"] == "every system still has queued jobs"
    window = payload["window_s"]
    assert window == pytest.approx(min(payload["queued_until_s"].values()))
    # (Under Gavel's rounds the queues of this small case all end at the same round's end; the
    # window is still the earliest of them.)
    assert window > 0 and max(payload["queued_until_s"].values()) >= window
    assert set(payload["avg_fairness_ratio"]) == {"silod", "alluxio", "coordl", "quiver", "silod (IO not allocated)"}
    assert all(0 < v for v in payload["avg_fairness_ratio"].values())
    assert (tmp_path / "fairness.png").stat().st_size > 1000


def test_quiver_noise_experiment_runs_quiver_at_each_sigma(tmp_path):
    proc = silod("experiment", "quiver-noise", "--max-jobs", "12", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads((tmp_path / "quiver_noise.json").read_text())
    assert payload["noises"] == [0.0, 0.1, 0.25]
    for policy in ("fifo", "sjf", "gavel"):
        assert set(payload["avg_jct_s"][policy]) == {"silod", "quiver sigma 0", "quiver sigma 0.1", "quiver sigma 0.25"}
        assert min(payload["avg_jct_s"][policy].values()) > 0
    assert (tmp_path / "quiver_noise.png").stat().st_size > 1000


def test_profile_noise_is_for_quiver_only(tmp_path):
    proc = silod("simulate", "--cache-system", "alluxio", "--profile-noise", "0.1", "--max-jobs", "3", "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2
    assert "--profile-noise applies to the quiver cache system only" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    proc = silod("simulate", "--cache-system", "quiver", "--profile-noise", "-1", "--max-jobs", "3", "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2 and "must be >= 0" in proc.stderr + proc.stdout


def test_a_lower_case_b_is_refused_on_the_command_line_in_yaml_and_in_traces(tmp_path):
    """`--cache 10tb` ran with 1.25e12 bytes (terabits); every entry point now refuses it with
    both readings, naming where the value came from."""
    proc = silod("simulate", "--max-jobs", "3", "--cache", "10tb", "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--cache '10tb' is ambiguous" in proc.stderr
    assert "10TB for 10 terabytes (10TB)" in proc.stderr and "10Tbit for 10 terabits (1.25TB)" in proc.stderr
    assert not (tmp_path / "o" / "summary.json").exists()

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("gpus: 8\ncache: 1TB\nremote_io: 10Gb/s\n")
    proc = silod("simulate", "--max-jobs", "3", "--cluster", str(cluster), "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert f"cluster file {cluster}: remote_io '10Gb/s' is ambiguous" in proc.stderr
    assert "10GB/s for 10 gigabytes/s" in proc.stderr and "10Gbps for 10 gigabits/s (1.25GB/s)" in proc.stderr

    trace = write(tmp_path, "j1,0,1,resnet50,mine,143gb,114MB/s,2\n")
    proc = silod("simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "line 2" in proc.stderr and "dataset_size '143gb' is ambiguous" in proc.stderr and "143GB" in proc.stderr


def test_the_summary_shows_the_cluster_it_simulated(tmp_path):
    out = tmp_path / "o"
    proc = silod("simulate", "--max-jobs", "5", "--gpus", "16", "--gpus-per-node", "4", "--cache", "2TB",
                 "--remote-io", "8Gbps", "--cpus-per-node", "12", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    line = "cluster: 16 GPUs (4 nodes of 4), cache 2TB, remote IO 1GB/s, 48 CPU cores (12 per node, model)"
    assert line in proc.stdout, proc.stdout
    cluster = json.loads((out / "summary.json").read_text())["cluster"]
    assert cluster["gpus"] == 16 and cluster["nodes"] == 4 and cluster["cache_bytes"] == 2e12
    assert cluster["remote_io_bytes_per_s"] == 1e9 and cluster["cpus"] == 48 and cluster["cpus_per_node"] == 12
    assert cluster["description"] == line.removeprefix("cluster: ")


def test_a_flag_that_overrides_the_cluster_file_says_so(tmp_path):
    """`--cluster FILE --gpus 8` used the flag silently; the flag still wins (as flags do), with a note."""
    out = tmp_path / "o"
    proc = silod("simulate", "--max-jobs", "3", "--cluster", str(EXAMPLE_CLUSTER), "--gpus", "8", "--gpus-per-node", "4",
                 "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert f"note: --gpus 8 overrides gpus: 96 in {EXAMPLE_CLUSTER}" in proc.stderr
    assert "--gpus-per-node" not in proc.stderr  # the same value as the file's: nothing to say
    assert json.loads((out / "summary.json").read_text())["cluster"]["gpus"] == 8


EXAMPLE_CLUSTER = Path(__file__).resolve().parents[1] / "traces" / "cluster.example.yaml"


def test_the_documented_cluster_file_loads_as_documented():
    from scheduler.core.cluster import describe_cluster, load_cluster

    capacity, speed = load_cluster(EXAMPLE_CLUSTER)
    assert describe_cluster(capacity, speed) == "96 GPUs (24 nodes of 4), cache 24TB, remote IO 1GB/s, 768 CPU cores (32 per node, model)"
    doc = (Path(__file__).resolve().parents[1] / "docs" / "simulator.md").read_text()
    assert EXAMPLE_CLUSTER.read_text() in doc, "docs/simulator.md shows traces/cluster.example.yaml as it is"
