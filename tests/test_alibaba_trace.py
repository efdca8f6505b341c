"""`--format alibaba-openb`: the Alibaba 2023 GPU trace mapped to catalog models, with each task's
CPU request as its input pipeline's cores (traces/alibaba_trace.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from estimator.errors import UserError
from traces.alibaba_trace import load_alibaba_trace
from traces.catalog import MODELS
from traces.loader import TraceFormat, load_trace

from test_simulate_cli import _shared_traces  # noqa: E402 - shared/ beside this clone or its origin

SHARED = _shared_traces() / "alibaba-openb"
HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def _write(tmp_path, *rows):
    p = tmp_path / "pods.csv"
    p.write_text(HEADER + "\n".join(rows) + "\n")
    return p


def test_mapping_by_hand(tmp_path):
    p = _write(tmp_path,
               "openb-pod-0000,12000,16384,1,1000,,LS,Running,0,1000,10",  # 990 s, 12 cores
               "openb-pod-0001,6000,12288,1,460,,LS,Succeeded,50,650,100",  # a GPU share -> 1 GPU, 550 s
               "openb-pod-0002,4000,8192,0,0,,BE,Succeeded,60,500,60",  # CPU-only: left out
               "openb-pod-0003,32000,8192,8,1000,,LS,Pending,70,900,",  # never scheduled: left out
               "openb-pod-0004,64000,8192,8,1000,,LS,Failed,80,1080,80")  # 8 GPUs, 1000 s, 64 cores
    tr = load_trace(p, TraceFormat.auto)  # recognised by its header
    assert [j.job_id for j in tr.jobs] == ["openb-pod-0000", "openb-pod-0001", "openb-pod-0004"]
    assert tr.notes == ("left out 1 CPU-only task(s)", "left out 1 never scheduled task(s)")
    for j, gpus, seconds, cores in zip(tr.jobs, (1, 1, 8), (990, 550, 1000), (12, 6, 64), strict=True):
        spec = MODELS[j.model]
        assert j.num_gpus == gpus and j.ideal_throughput == spec.ideal_per_gpu * gpus
        assert j.ideal_duration(tr.dataset_sizes[j.dataset]) == pytest.approx(seconds)
        # On its requested cores it runs exactly at f*.
        assert cores * j.pipeline.cpu_rate == pytest.approx(j.ideal_throughput)
    assert tr.jobs[1].submit_time == 50.0  # arrival = creation time


def test_same_seed_same_models(tmp_path):
    p = _write(tmp_path, *(f"openb-pod-{i:04d},8000,1,1,1000,,LS,Running,{i},{i + 100},{i}" for i in range(40)))
    a, b, c = (load_alibaba_trace(p, seed=s) for s in (1, 1, 2))
    assert [j.model for j in a.jobs] == [j.model for j in b.jobs]
    assert [j.model for j in a.jobs] != [j.model for j in c.jobs]
    assert len({j.model for j in a.jobs}) >= 3


@pytest.mark.parametrize("row,fragment", [
    ("openb-pod-0000,abc,1,1,1000,,LS,Running,0,100,0", "cpu_milli"),
    ("openb-pod-0000,1000,1,1.5,1000,,LS,Running,0,100,0", "num_gpu"),
    ("openb-pod-0000,1000,1,1,1000,,LS,Running,,100,0", "creation_time"),
])
def test_bad_rows_name_line_and_column(tmp_path, row, fragment):
    with pytest.raises(UserError, match=f"line 2, column '{fragment}'"):
        load_alibaba_trace(_write(tmp_path, row))


def test_wrong_file_is_a_clear_error(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="missing column"):
        load_alibaba_trace(p)


@pytest.mark.skipif(not SHARED.is_dir() and os.environ.get("CI") != "true", reason="the shared openb trace is not on this machine")
def test_the_real_trace_loads():
    tr = load_trace(SHARED, TraceFormat.auto)  # the folder is recognised
    # 8,152 tasks: 1,088 CPU-only and the never-scheduled ones are left out, the rest mapped.
    assert len(tr) + 1088 + int(tr.notes[1].split()[2]) + sum(int(n.split()[2]) for n in tr.notes[2:]) == 8152
    assert tr.notes[0] == "left out 1088 CPU-only task(s)"
    assert all(j.pipeline is not None for j in tr.jobs)  # every GPU task requests CPU
    assert tr.max_gpus == 8


def test_window_keeps_tasks_created_in_it_and_shifts_arrivals(tmp_path):
    p = _write(tmp_path, *(f"openb-pod-{i:04d},8000,1,1,1000,,LS,Running,{i * 100},{i * 100 + 50},{i * 100}" for i in range(10)))
    whole = load_alibaba_trace(p, seed=3)
    tr = load_alibaba_trace(p, seed=3, window_s=(300.0, 700.0))
    assert [j.job_id for j in tr.jobs] == [f"openb-pod-{i:04d}" for i in (3, 4, 5, 6)]
    assert [j.submit_time for j in tr.jobs] == [0.0, 100.0, 200.0, 300.0]
    # A task maps to the same model whatever the window.
    by_id = {j.job_id: j.model for j in whole.jobs}
    assert all(by_id[j.job_id] == j.model for j in tr.jobs)
    assert "left out 6 outside the window task(s)" in tr.notes
    with pytest.raises(UserError, match="window"):
        load_alibaba_trace(p, window_s=(700.0, 300.0))


def test_densest_window_and_offered_load_by_hand(tmp_path):
    from scheduler.sim.experiments import DAY_S, densest_window, offered_load

    day = int(DAY_S)
    # Day 0: one 1-GPU task running 100 days (counts only up to the window's end: 1 day);
    # day 10: two 2-GPU tasks of half a day each (1 GPU-day each, 2 in all) -> the densest.
    p = _write(tmp_path, f"openb-pod-0000,8000,1,1,1000,,LS,Running,0,{100 * day},0",
               f"openb-pod-0001,8000,1,2,1000,,LS,Running,{10 * day},{10 * day + day // 2},{10 * day}",
               f"openb-pod-0002,8000,1,2,1000,,LS,Running,{10 * day + 3600},{10 * day + 3600 + day // 2},{10 * day + 3600}")
    assert densest_window(p, seed=0, days=1.0) == (10 * DAY_S, 11 * DAY_S)
    tr = load_alibaba_trace(p, window_s=(10 * DAY_S, 11 * DAY_S))
    # 2 tasks x 2 GPUs x 43,200 s over a 3,600 s arrival span.
    assert offered_load(tr) == pytest.approx(2 * 2 * 43200 / 3600)
