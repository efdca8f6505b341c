"""The loader's miss term (issue 49): a real PyTorch job with misses ran at 0.63-0.67 of
min(f*, b / (1 - c/d)) with the link to spare, because each miss holds a DataLoader worker for
its latency. estimator.loader_perf models it as 1 / (1/f* + (1 - h)/m), m = W s / L; a job that
declares nothing about its loader (m = inf) keeps the paper's model. The simulator uses the same
function for jobs that declare it (TraceJob.loader_miss_rate)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator import io_perf, loader_miss_rate, loader_miss_time, loader_perf, silod_loader_perf, silod_perf, window_io_perf
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


def test_the_miss_time_at_a_binding_bucket_is_the_wait_that_matches_its_rate():
    """L(b) (estimator.loader_miss_time), by hand: W = 2 workers, s = 10 kB items, f* = 10 MB/s,
    h = 0.5, L_free = 0.5 ms. At b = 2 MB/s the loader would miss 0.5 X(L_free) = 4.76 MB/s > b:
    the waiters' queue grows until L = W s (1/b - 1/((1-h) f*)) = 20,000 (1/2e6 - 1/5e6) = 6 ms,
    where the loader's misses flow at b (X = b / (1-h) = 4 MB/s). At b = 8 MB/s the link does not
    bind: W s / b = 2.5 ms < W s / ((1-h) f*) = 4 ms, so L = L_free."""
    w, s, f, h, free = 2, 10_000.0, 10 * MB, 0.5, 0.5e-3
    assert loader_miss_time(free, w, s, f, h, 2 * MB) == pytest.approx(6e-3)
    assert loader_perf(f, h, loader_miss_rate(w, s, 6e-3)) == pytest.approx(2 * MB / (1 - h))
    assert loader_miss_time(free, w, s, f, h, 8 * MB) == free
    assert loader_miss_time(free, w, s, f, h, math.inf) == free  # no cap
    assert loader_miss_time(free, w, s, f, 1.0, 2 * MB) == free  # nothing missed: no wait
    assert loader_miss_time(free, w, s, f, h, 0.0) == math.inf  # paused
    # The burst banked before a 2 s window: b' = 1 MB/s + 65,536 B / 2 s = 1,032,768 B/s,
    # L = 20,000 / 1,032,768 - 4e-3 = 15.365 ms (it would be 16 ms without it).
    assert loader_miss_time(free, w, s, f, h, 1 * MB, burst=65_536, seconds=2.0) == pytest.approx(20_000 / 1_032_768 - 4e-3)
    assert loader_miss_time(free, w, s, f, h, 1 * MB) == pytest.approx(16e-3)
    # 4 workers wait twice as long per miss for the same rate: twice the misses in flight.
    assert loader_miss_time(free, 4, s, f, 0.0, 2 * MB) == pytest.approx(40_000 / 2e6 - 40_000 / 1e7)
    # Arrays (the policies' columns) and the throughput it gives: min(X(L_free), b/(1-h)).
    bs = np.array([1 * MB, 2 * MB, 4 * MB, 8 * MB])
    lb = loader_miss_time(free, w, s, f, h, bs)
    x = loader_perf(f, h, loader_miss_rate(w, s, lb))
    assert x == pytest.approx(np.minimum(loader_perf(f, h, loader_miss_rate(w, s, free)), bs / (1 - h)))
    with pytest.raises(ValueError, match="workers"):
        loader_miss_time(free, 0, s, f, h, 2 * MB)


def test_the_simulator_follows_the_loader_term():
    plain = _jct(None, 0.0)
    assert plain == pytest.approx(4 * 50 * GB / (100 * MB), rel=1e-3)  # the link never binds
    # No cache: every read misses, every epoch at 1 / (1/100 + 1/100) MB/s.
    assert _jct(100 * MB, 0.0) == pytest.approx(4 * 50 * GB / float(loader_perf(100 * MB, 0.0, 100 * MB)), rel=1e-3)
    # The whole dataset cached after its first epoch: only that epoch pays the miss term.
    assert _jct(100 * MB, 100 * GB) == pytest.approx(50 * GB / (50 * MB) + 3 * 50 * GB / (100 * MB), rel=1e-2)
    assert _jct(None, 100 * GB) == pytest.approx(plain, rel=1e-3)
