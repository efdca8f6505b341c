"""The loader's miss term (issue 49): a real PyTorch job with misses ran at 0.63-0.67 of
min(f*, b / (1 - c/d)) with the link to spare, because each miss holds a DataLoader worker for
its latency. estimator.loader_perf models it as 1 / (1/f* + (1 - h)/m), m = W s / L; a job that
declares nothing about its loader (m = inf) keeps the paper's model. The simulator uses the same
function for jobs that declare it (TraceJob.loader_miss_rate)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator import io_perf, loader_miss_rate, loader_perf, silod_loader_perf, silod_perf, window_io_perf
from policies.estimators import SiloDEstimator
from policies.fifo import FifoPolicy
from policies.types import ClusterCapacity
from scheduler.sim.engine import SimConfig, Simulator
from traces.model import Trace, TraceJob

MB = 1e6
GB = 1e9


def test_loader_term_is_neutral_when_nothing_is_declared():
    f, b, d = 100 * MB, 30 * MB, 50 * GB
    for c in (0.0, 0.25 * d, 0.5 * d, d):
        assert silod_loader_perf(f, b, c, d) == silod_perf(f, b, c, d)
    assert loader_perf(f, 0.0) == f
    assert loader_miss_rate(2, 9000, 0.0) == math.inf  # a miss that costs nothing


def test_loader_term_adds_the_miss_cost_per_byte():
    # Two workers, 9 KB items, 3 ms a miss: the loader absorbs 6 MB/s of misses.
    m = loader_miss_rate(2, 9000, 0.003)
    assert m == pytest.approx(6 * MB)
    f = 2.5 * MB
    assert loader_perf(f, 0.0, m) == pytest.approx(1 / (1 / f + 1 / m))  # 1.76 MB/s, not 2.5
    assert loader_perf(f, 1.0, m) == pytest.approx(f)  # all hits: no miss to absorb
    # where the link binds, the IO term still does
    assert silod_loader_perf(f, 0.5 * MB, 0.0, 1.0, m) == pytest.approx(0.5 * MB)
    got = silod_loader_perf(np.array([f, f]), 50 * MB, np.array([0.0, 0.5]), 1.0, m)
    assert got == pytest.approx([1 / (1 / f + 1 / m), 1 / (1 / f + 0.5 / m)])
    with pytest.raises(ValueError, match="miss_rate"):
        loader_perf(f, 0.0, 0.0)
    with pytest.raises(ValueError, match="workers"):
        loader_miss_rate(0, 9000, 0.003)


def test_window_io_perf_is_io_perf_over_a_long_window():
    assert window_io_perf(10 * MB, 0.5, 1.0, 1e12, 1 * MB) == pytest.approx(io_perf(10 * MB, 0.5, 1.0))
    assert window_io_perf(10 * MB, 0.5, 1.0, 0.5, 1 * MB) == pytest.approx((10 * MB + 2 * MB) / 0.5)
    assert window_io_perf(10 * MB, 1.0, 1.0, 0.5, 1 * MB) == math.inf


def _jct(loader: float | None, cache: float) -> float:
    job = TraceJob("a", 0.0, 1, "m", "d", 100 * MB, 4.0, loader_miss_rate=loader)
    trace = Trace((job,), {"d": 50 * GB})
    cap = ClusterCapacity(gpus=1, cache=cache, remote_io=1 * GB, gpus_per_node=1)
    return Simulator(trace, cap, FifoPolicy(), SiloDEstimator(), "silod", SimConfig()).run().jobs[0].jct_s


def test_the_simulator_follows_the_loader_term():
    plain = _jct(None, 0.0)
    assert plain == pytest.approx(4 * 50 * GB / (100 * MB), rel=1e-3)  # the link never binds
    # No cache: every read misses, every epoch at 1 / (1/100 + 1/100) MB/s.
    assert _jct(100 * MB, 0.0) == pytest.approx(4 * 50 * GB / float(loader_perf(100 * MB, 0.0, 100 * MB)), rel=1e-3)
    # The whole dataset cached after its first epoch: only that epoch pays the miss term.
    assert _jct(100 * MB, 100 * GB) == pytest.approx(50 * GB / (50 * MB) + 3 * 50 * GB / (100 * MB), rel=1e-2)
    assert _jct(None, 100 * GB) == pytest.approx(plain, rel=1e-3)
