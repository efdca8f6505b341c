"""Self-correcting f* (estimator/measured.py) and the simulator using it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator.measured import FStarEstimate, observe
from policies.estimators import SiloDEstimator
from policies.fifo import FifoPolicy
from policies.types import ClusterCapacity
from scheduler.sim.engine import SimConfig, Simulator
from traces.model import Trace, TraceJob

MB = 1e6
GB = 1e9


def test_gpu_bound_samples_correct_a_2x_declaration():
    s = FStarEstimate.start(200 * MB)
    s = observe(s, 100 * MB, 60.0, io_bound=500 * MB)  # neither IO nor CPU held it: f* = 100
    assert s.estimate == pytest.approx(100 * MB)
    s = observe(s, 110 * MB, 60.0)
    assert s.estimate == pytest.approx(105 * MB)


def test_bound_samples_only_raise_and_bounds_hold():
    s = FStarEstimate.start(100 * MB)
    assert observe(s, 50 * MB, 60.0, io_bound=50 * MB).estimate == 100 * MB  # IO-bound: says nothing of f*
    assert observe(s, 150 * MB, 60.0, cpu_bound=150 * MB).estimate == 150 * MB  # at least 150
    # A job that stalls on purpose cannot push its f* below declared / 4 (nor above 4x).
    assert observe(s, 1.0, 3600.0).estimate == pytest.approx(25 * MB)
    assert observe(s, 1e12, 3600.0).estimate == pytest.approx(400 * MB)
    assert observe(s, 100 * MB, 0.0) is s


def test_old_evidence_fades():
    s = FStarEstimate.start(100 * MB, horizon_s=600.0)
    s = observe(s, 100 * MB, 6000.0)
    s = observe(s, 50 * MB, 600.0)  # a new phase: half the old evidence's (capped) weight
    assert s.estimate == pytest.approx(75 * MB)


def _run(declared: float | None):
    job = TraceJob("a", 0.0, 1, "m", "d", 100 * MB, 4.0, declared_throughput=declared)
    trace = Trace((job,), {"d": 50 * GB})
    cap = ClusterCapacity(gpus=1, cache=100 * GB, remote_io=1 * GB, gpus_per_node=1)
    return Simulator(trace, cap, FifoPolicy(), SiloDEstimator(), "silod", SimConfig()).run()


def test_simulated_job_with_2x_wrong_f_star_converges_to_the_measured_one():
    right = _run(None)
    wrong = _run(200 * MB)
    rec = wrong.jobs[0]
    assert rec.declared_ideal == pytest.approx(200 * MB)
    assert rec.measured_ideal == pytest.approx(100 * MB, rel=0.02)
    # The job itself reads at its real speed either way.
    assert rec.jct_s == pytest.approx(right.jobs[0].jct_s, rel=1e-3)
    assert math.isnan(right.jobs[0].measured_ideal) or right.jobs[0].measured_ideal == pytest.approx(100 * MB, rel=0.02)
    assert np.isfinite(rec.jct_s)
