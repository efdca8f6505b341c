"""The input-pipeline fields at the edges: trace CSV columns, cluster flags/YAML, catalog."""

from __future__ import annotations

import subprocess
import sys

import pytest

from estimator.errors import UserError
from scheduler.core.cluster import load_cluster
from traces.catalog import IMAGENET_JPEG_CPU_RATE, MODELS
from traces.csv_trace import TraceError, load_csv_trace, write_csv_trace

HEADER = "job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs"


def _trace(tmp_path, extra_header, *rows):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + extra_header + "\n" + "\n".join(rows) + "\n")
    return p


def test_trace_columns_parse_and_round_trip(tmp_path):
    p = _trace(tmp_path, ",cpu_rate,autocache_expansion,post_cpu_rate",
               "a,0,1,resnet50,d,100GB,100MB/s,2,35MB/s,6,350MB/s",
               "b,0,1,bert,e,10GB,2MB/s,1,,,",
               "c,0,1,resnet50,d,100GB,100MB/s,1,40MB/s,,")
    tr = load_csv_trace(p)
    by = {j.job_id: j for j in tr.jobs}
    assert by["a"].pipeline.cpu_rate == 35e6 and by["a"].pipeline.autocache_expansion == 6.0 and by["a"].pipeline.post_cpu_rate == 350e6
    assert by["b"].pipeline is None  # empty = not CPU-bound
    assert by["c"].pipeline.cpu_rate == 40e6 and not by["c"].pipeline.autocaches
    out = tmp_path / "w.csv"
    write_csv_trace(tr, out)
    assert {j.job_id: j.pipeline for j in load_csv_trace(out).jobs} == {j.job_id: j.pipeline for j in tr.jobs}


def test_trace_without_the_columns_has_no_pipeline(tmp_path):
    tr = load_csv_trace(_trace(tmp_path, "", "a,0,1,resnet50,d,100GB,100MB/s,2"))
    assert tr.jobs[0].pipeline is None  # no catalog fill: an absent column keeps old results


@pytest.mark.parametrize("row,column,fragment", [
    ("-35MB/s,,", "cpu_rate", "negative"),
    ("fast,,", "cpu_rate", "not a rate"),
    ("0,,", "cpu_rate", "must be > 0"),
    ("35MB/s,six,350MB/s", "autocache_expansion", "not a number"),
    ("35MB/s,-2,350MB/s", "autocache_expansion", "must be in"),
    ("35MB/s,6,", "post_cpu_rate", "give both"),
    ("35MB/s,,350MB/s", "autocache_expansion", "give both"),
    ("35MB/s,6,10MB/s", "post_cpu_rate", ">= cpu_rate"),
    (",6,350MB/s", "cpu_rate", "needs the job's cpu_rate"),
    ("20TB/s,,", "cpu_rate", "above the limit"),
])
def test_trace_bad_pipeline_values_name_line_and_column(tmp_path, row, column, fragment):
    p = _trace(tmp_path, ",cpu_rate,autocache_expansion,post_cpu_rate", "a,0,1,resnet50,d,100GB,100MB/s,2," + row)
    with pytest.raises(TraceError) as err:
        load_csv_trace(p)
    msg = str(err.value)
    assert "line 2" in msg and f"column {column!r}" in msg and fragment in msg, msg


def test_cluster_cpus_per_node_from_flags_and_yaml(tmp_path):
    cap, _ = load_cluster(None, gpus=8, gpus_per_node=4, cache="1TB", remote_io="1GB/s", cpus_per_node="12")
    assert cap.cpus_per_node == 12 and cap.cpus == 24 and cap.cpu_cap(1) == 12 and cap.cpu_cap(8) == 24
    assert cap.gpu_proportional_cpu(2) == 6
    y = tmp_path / "c.yaml"
    y.write_text("gpus: 8\ngpus_per_node: 4\ncache: 1TB\nremote_io: 1GB/s\ncpus_per_node: 24\ncpu_allocation: gpu-proportional\n")
    cap, _ = load_cluster(y)
    assert cap.cpus == 48 and cap.cpu_allocation == "gpu-proportional"
    cap, _ = load_cluster(None, gpus=8, cache="1TB", remote_io="1GB/s")
    assert cap.cpus_per_node is None and not cap.manages_cpu and cap.cpus == float("inf")


@pytest.mark.parametrize("value,fragment", [("0", "must be > 0 and at most 1,000,000"), ("-4", "must be > 0 and at most 1,000,000"),
                                            ("many", "not a core count"), ("nan", "must be > 0 and at most 1,000,000"),
                                            ("1e30", r"1e\+30 must be > 0 and at most 1,000,000")])
def test_cluster_bad_cpus_per_node(value, fragment):
    with pytest.raises(UserError, match=fragment):
        load_cluster(None, gpus=8, cache="1TB", remote_io="1GB/s", cpus_per_node=value)


def test_simulate_bad_cpu_flags_exit_2_without_traceback(tmp_path):
    for flags, fragment in ((["--cpus-per-node", "zero"], "--cpus-per-node"), (["--cpus-per-node", "4", "--cpu-allocation", "fair"], "--cpu-allocation")):
        proc = subprocess.run([sys.executable, "-m", "scheduler", "simulate", "--gpus", "8", "--cache", "1TB", "--remote-io", "1GB/s",
                               "--out", str(tmp_path / "o"), "--quiet", *flags], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_catalog_rates_have_sources():
    for spec in MODELS.values():
        assert spec.cpu_source, spec.name
    assert MODELS["resnet50"].cpu_rate == pytest.approx(35.2e6) == IMAGENET_JPEG_CPU_RATE
    assert MODELS["bert"].pipeline is None
