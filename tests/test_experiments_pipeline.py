"""`silod experiment cpu`, `stagger`, `autocache` and `alibaba` (issue 22) run, plot, and give figures
that can be checked by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def silod(*args):
    return subprocess.run([sys.executable, "-m", "scheduler", *args], capture_output=True, text=True, timeout=900)


def test_experiment_cpu_small(tmp_path):
    proc = silod("experiment", "cpu", "--max-jobs", "20", "--workers", "1", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cpu.png").stat().st_size > 0
    runs = json.loads((tmp_path / "cpu.json").read_text())["runs"]
    assert len(runs) == 12
    # 20 jobs on 400 GPUs never queue; at 2 cores per GPU the estimator's cores let every
    # ResNet-50 job (3.2 cores per GPU needed) run at f*, GPU-proportional cores do not.
    for p in ("fifo", "sjf", "gavel"):
        ours = runs[f"{p}/model @ 2 cores/GPU"]["avg_jct_s"]
        base = runs[f"{p}/gpu-proportional @ 2 cores/GPU"]["avg_jct_s"]
        assert ours < base, (p, ours, base)


STEPS = list(range(0, 101, 10))


def test_experiment_stagger_end_point_by_hand(tmp_path):
    proc = silod("experiment", "stagger", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads((tmp_path / "stagger.json").read_text())
    assert payload["stagger_percent"] == STEPS
    # 100%: ResNet-50 alone (epoch 1 at the 100 MB/s link: 1,430 s; epochs 2-3 at 114 MB/s:
    # 2,509 s), then EfficientNet-B1 on a fully cached dataset: 3 x 143 GB / 69 MB/s = 6,217 s.
    expected = 143e9 / 100e6 + 2 * 143e9 / 114e6 + 3 * 143e9 / 69e6
    for system in ("silod", "alluxio"):
        assert payload["makespan_s"][system][-1] == pytest.approx(expected, rel=0.02)
        # SiloD's model: fetched items serve both readers and the dataset fits the cache, so
        # remote bytes are the dataset's (143 GB) once at every stagger: nothing for a delay to
        # save. Exact: the engine counts the chunks fetched (an expected-miss charge was off by
        # -4..+5% over seeds 0-5 with two concurrent readers).
        assert payload["remote_bytes"][system] == pytest.approx([143e9] * len(STEPS), rel=1e-9)
    # The paper's setting: an interior optimum, then rising (its Fig. 3's shape).
    paper = payload["paper_setting"]["makespan_s"]
    best = paper.index(min(paper))
    assert 0 < best < 10 and paper[0] > paper[best] < paper[-1]
    assert (tmp_path / "stagger.png").stat().st_size > 0


def test_experiment_autocache_small(tmp_path):
    proc = silod("experiment", "autocache", "--max-jobs", "60", "--workers", "1", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    runs = json.loads((tmp_path / "autocache.json").read_text())["runs"]
    assert sorted(runs) == sorted(f"{p}/{m}" for p in ("fifo", "sjf", "gavel") for m in ("on", "off"))
    # 60 jobs on 400 GPUs hardly queue; the pool has cores to spare, but a multi-GPU image job
    # needs more cores than its nodes have (8 per 4 GPUs: ResNet-50 needs 3.2 per GPU), so it is
    # CPU-bound, and its dataset fits decoded (6x) in the 100 TB cache: caching decoded items
    # makes those jobs faster, and no job slower on average.
    for p in ("fifo", "sjf", "gavel"):
        assert runs[f"{p}/on"]["avg_jct_s"] < runs[f"{p}/off"]["avg_jct_s"], p


def test_experiment_alibaba_needs_the_trace(tmp_path):
    proc = silod("experiment", "alibaba", "--trace", str(tmp_path / "nope"), "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 2
    assert "openb" in proc.stderr and "Traceback" not in proc.stderr
