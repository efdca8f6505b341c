"""Sizes, rates and GPU counts have one set of bounds (estimator.units), enforced by every entry
point: the unit parsers, the cluster flags, the trace readers and the REST API's schemas (the
data manager's are in test_datamanager_api.py, the CLI's in test_error_walk.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from estimator.units import (
    MAX_GPUS,
    MAX_RATE_BYTES_PER_S,
    MAX_SIZE_BYTES,
    UnitError,
    parse_gpus,
    parse_rate,
    parse_size,
)

HEADER = "job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs\n"


def test_limits_are_the_documented_ones():
    assert (MAX_SIZE_BYTES, MAX_RATE_BYTES_PER_S, MAX_GPUS) == (1e18, 1e13, 1_000_000)


@pytest.mark.parametrize("text", ["1EB", "1e18", 10**18, "999PB", "0"])
def test_sizes_up_to_one_exabyte_are_accepted(text):
    assert parse_size(text) <= MAX_SIZE_BYTES


@pytest.mark.parametrize("text", ["1.01EB", "1EiB", "1e30", 1e19, "2000PB", "9e99TB"])
def test_larger_sizes_are_rejected_with_the_range(text):
    with pytest.raises(UnitError, match=r"between 0 and 1EB"):
        parse_size(text, "dataset_size")


@pytest.mark.parametrize("text", ["10TB/s", "80Tbps", 1e13, "200MB/s"])
def test_rates_up_to_ten_terabytes_per_second_are_accepted(text):
    assert parse_rate(text) <= MAX_RATE_BYTES_PER_S


@pytest.mark.parametrize("text", ["10.1TB/s", "1PB/s", "100Tbps", 1e14, "1e30"])
def test_larger_rates_are_rejected_with_the_range(text):
    with pytest.raises(UnitError, match=r"between 0 and 10TB/s"):
        parse_rate(text, "--remote-io")


@pytest.mark.parametrize("value", [1, "8", 1_000_000, 4.0])
def test_gpu_counts_in_range(value):
    assert parse_gpus(value) == int(value)


@pytest.mark.parametrize("value", [0, -1, 1_000_001, "1e3", "x", True, 2.5])
def test_gpu_counts_out_of_range_or_not_whole(value):
    with pytest.raises(UnitError, match=r"GPU"):
        parse_gpus(value, "--gpus")


def test_cluster_flags_use_the_bounds():
    from scheduler.core.cluster import load_cluster

    with pytest.raises(UnitError, match="1EB"):
        load_cluster(gpus=8, cache="2EB", remote_io="1GB/s")
    with pytest.raises(UnitError, match="10TB/s"):
        load_cluster(gpus=8, cache="1TB", remote_io="100TB/s")
    with pytest.raises(UnitError, match="1,000,000"):
        load_cluster(gpus=2_000_000, cache="1TB", remote_io="1GB/s")


@pytest.mark.parametrize(("row", "column", "limit"), [
    ("j1,0,1,m,d,1e30,100MB/s,1", "dataset_size", "1EB"),
    ("j1,0,1,m,d,10GB,1PB/s,1", "ideal_throughput", "10TB/s"),
    ("j1,0,2000000,m,d,10GB,100MB/s,1", "num_gpus", "1,000,000"),
    # 1e300 epochs overflowed the job's bytes to inf: the job "finished" in 10 s (GPU use 187%).
    ("j1,0,1,m,d,1GB,100MB/s,1e300", "epochs", "1e+06"),
    ("j1,0,1,m,d,1GB,100MB/s,1000001", "epochs", "1e+06"),
    # A 1e-300-byte dataset finished inside the engine's shortest step (GPU use 1040%).
    ("j1,0,1,m,d,1e-300,100MB/s,1", "dataset_size", "at least 1 byte"),
])
def test_trace_rows_out_of_range_name_line_column_and_range(tmp_path, row, column, limit):
    from traces.csv_trace import TraceError, load_csv_trace

    path = tmp_path / "t.csv"
    path.write_text(HEADER + row + "\n")
    with pytest.raises(TraceError) as info:
        load_csv_trace(path)
    assert f"line 2, column {column!r}" in str(info.value) and limit in str(info.value)


def test_a_column_given_twice_is_refused(tmp_path):
    """csv.DictReader keeps the last of two same-named columns: `job_id,job_id,...` read the
    second id and ignored the first without a word."""
    from traces.csv_trace import TraceError, load_csv_trace

    path = tmp_path / "t.csv"
    path.write_text("job_id," + HEADER + "j0,j1,0,1,m,d,10GB,100MB/s,1\n")
    with pytest.raises(TraceError, match="line 1, column 'job_id': appears twice"):
        load_csv_trace(path)


def test_durations_outside_the_simulated_horizon_are_refused(tmp_path):
    """1 GB at 1e-3 B/s (1e12 s) had the engine step through ten simulated years for minutes;
    at 1e-300 B/s it warned of an overflow and never ended. Both name the job and its units."""
    import subprocess
    import sys

    for rate, shown in (("1e-3", "1e+12 s"), ("1e-300", "inf s")):
        path = tmp_path / "t.csv"
        path.write_text(HEADER + f"j1,0,1,m,d,1GB,{rate},1\n")
        r = subprocess.run([sys.executable, "-m", "scheduler", "simulate", "--trace", str(path), "--out", str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "job j1" in r.stderr and shown in r.stderr and "ideal_throughput" in r.stderr


def test_binary_trace_is_a_clear_error(tmp_path):
    from traces.csv_trace import TraceError, load_csv_trace

    path = tmp_path / "t.csv"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff" * 50)
    with pytest.raises(TraceError, match="not UTF-8 text"):
        load_csv_trace(path)


def test_rest_api_schemas_use_the_bounds():
    from scheduler.service.api.schemas import DatasetIn, JobIn

    assert DatasetIn(name="d", uri="s3://b/d", size="1EB").size == 1e18
    with pytest.raises(ValidationError, match="1EB"):
        DatasetIn(name="d", uri="s3://b/d", size="2EB")
    with pytest.raises(ValidationError, match="10TB/s"):
        JobIn(name="j", gpus=1, dataset="d", epochs=1, ideal_throughput="20TB/s")
    with pytest.raises(ValidationError):
        JobIn(name="j", gpus=MAX_GPUS + 1, dataset="d", epochs=1, ideal_throughput="1GB/s")
    assert JobIn(name="j", gpus=MAX_GPUS, dataset="d", epochs=1, ideal_throughput="10TB/s").gpus == MAX_GPUS
