"""The Gavel-trace reader: jobs whose GPU count has no entry in Gavel's throughput table are
counted in a warning and get their rate by an explicit rule (--scale-missing linear|nearest)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from estimator.errors import UserError
from traces.gavel_trace import load_gavel_trace
from traces.loader import TraceFormat, load_trace

TABLE = Path(__file__).resolve().parent / "reference" / "gavel_parity" / "throughputs.json"
A3C = "A3C\tcd %s && python3 main.py --env PongDeterministic-v4\t--max-steps\t0\t{steps}\t{at}\t{gpus}"
RESNET = "ResNet-50 (batch size 16)\tcd %s && python3 main.py --data_dir=%s/imagenet\t--num_minibatches\t1\t{steps}\t{at}\t{gpus}"


def _trace(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "t.trace"
    path.write_text("\n".join(lines) + "\n")
    return path


def _rate(table: dict, key: str) -> float:
    return table["v100"][key]["null"]


def test_jobs_without_a_throughput_entry_are_counted_in_a_warning(tmp_path):
    path = _trace(tmp_path, [A3C.format(steps=1000, at=0, gpus=1), A3C.format(steps=1000, at=1, gpus=4),
                             A3C.format(steps=1000, at=2, gpus=8), RESNET.format(steps=1000, at=3, gpus=8)])
    with pytest.warns(UserWarning, match=r"2 of 4 jobs have a GPU count with no entry in throughputs.json \(--scale-missing linear"):
        trace = load_gavel_trace(path, TABLE)
    assert any("2 of 4 jobs" in n for n in trace.notes)


def test_a_trace_with_every_count_measured_reads_without_a_warning(tmp_path):
    path = _trace(tmp_path, [A3C.format(steps=1000, at=0, gpus=1), RESNET.format(steps=1000, at=3, gpus=4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = load_gavel_trace(path, TABLE)
    assert len(trace.notes) == 1


def test_scale_missing_linear_scales_the_measured_rate_and_nearest_keeps_it(tmp_path):
    table = json.loads(TABLE.read_text())
    one = _rate(table, "('A3C', 1)")
    path = _trace(tmp_path, [A3C.format(steps=7200, at=0, gpus=4)])
    durations = {}
    for rule in ("linear", "nearest"):
        with pytest.warns(UserWarning, match=f"--scale-missing {rule}"):
            job = load_gavel_trace(path, TABLE, scale_missing=rule).jobs[0]
        durations[rule] = job.epochs * 1e6 / job.ideal_throughput  # the A3C stand-in dataset is 1 MB
    assert durations["linear"] == pytest.approx(7200 / (4 * one))
    assert durations["nearest"] == pytest.approx(7200 / one)


def test_scale_missing_refuses_an_unknown_rule_and_other_formats(tmp_path):
    path = _trace(tmp_path, [A3C.format(steps=1000, at=0, gpus=1)])
    with pytest.raises(UserError, match="--scale-missing 'cubic' is not one of linear, nearest"):
        load_gavel_trace(path, TABLE, scale_missing="cubic")
    csv = tmp_path / "t.csv"
    csv.write_text("job_id,submit_time,gpus,model,dataset\n")
    with pytest.raises(UserError, match="--scale-missing applies to --format gavel"):
        load_trace(csv, TraceFormat.csv, scale_missing="nearest")
