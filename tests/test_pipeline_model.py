"""The input pipeline's CPU stage in the estimator (estimator/pipeline.py), on hand-computed cases.

One job bound by each resource in turn; the autocache variant; diagnosis and speed-ups.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator import cores_needed, cpu_perf, diagnose, pipeline_perf, silod_perf

MB = 1e6
GB = 1e9


def test_defaults_are_exactly_silod_perf():
    rng = np.random.default_rng(1)
    f = rng.uniform(1, 200, 50) * MB
    b = rng.uniform(0, 100, 50) * MB
    d = rng.uniform(1, 100, 50) * GB
    c = rng.uniform(0, 1.2, 50) * d
    assert np.array_equal(pipeline_perf(f, b, c, d), silod_perf(f, b, c, d))


# One job, f* = 100 MB/s, d = 1000 GB; the resource that binds changes with the allocation.
CASES = [
    # cores, cpu_rate, cache, remote_io -> throughput, bound
    (8, 35 * MB, 500 * GB, 100 * MB, 100 * MB, "gpu"),  # CPU 280, IO 200: GPU binds
    (2, 35 * MB, 500 * GB, 100 * MB, 70 * MB, "cpu"),  # 2 x 35 = 70 < 100, IO 200
    (8, 35 * MB, 900 * GB, 4 * MB, 40 * MB, "cache"),  # IO 4 / 0.1 = 40; +10% cache -> 4/0.01 = 400 beats +10% link
    (8, 35 * MB, 100 * GB, 30 * MB, 30 * MB / 0.9, "remote_io"),  # IO 33.3; +10% link 36.7 beats +10% cache 34.1
]


@pytest.mark.parametrize("cores,rate,cache,io,expected,bound", CASES)
def test_one_job_bound_by_each_resource(cores, rate, cache, io, expected, bound):
    got = pipeline_perf(100 * MB, io, cache, 1000 * GB, cores, rate)
    assert got == pytest.approx(expected)
    diag = diagnose(np.array([100 * MB]), 1, io, cache, 1000 * GB, cores, rate)
    assert diag.bound[0] == bound
    assert diag.throughput[0] == pytest.approx(expected)


def test_speedups_hand_computed():
    # CPU-bound at 2 cores x 35 = 70: one more core gives 105 -> capped by f* = 100: 100/70.
    d = diagnose(np.array([100 * MB]), 1, 100 * MB, 500 * GB, 1000 * GB, 2, 35 * MB)
    assert d.speedup_cpu[0] == pytest.approx(100 / 70)
    assert d.speedup_gpu[0] == pytest.approx(1.0)  # more GPU does nothing while CPU binds
    assert d.speedup_cache[0] == pytest.approx(1.0)
    # GPU-bound 1-GPU job: a second GPU doubles f* to 200, CPU (280) and IO (200) allow it.
    d = diagnose(np.array([100 * MB]), 1, 100 * MB, 500 * GB, 1000 * GB, 8, 35 * MB)
    assert d.speedup_gpu[0] == pytest.approx(2.0)
    # remote-IO-bound: +10% link is +10% speed while IO still binds.
    d = diagnose(np.array([100 * MB]), 1, 30 * MB, 100 * GB, 1000 * GB, 8, 35 * MB)
    assert d.speedup_remote_io[0] == pytest.approx(1.1)
    assert d.speedup_cache[0] == pytest.approx(0.9 / 0.89)


def test_not_cpu_bound_and_unconstrained_cores():
    assert cpu_perf(4, np.inf) == math.inf  # empty cpu_rate: not CPU-bound
    assert cpu_perf(0, np.inf) == math.inf
    assert cpu_perf(np.inf, 35 * MB) == math.inf  # CPU not modelled on the cluster
    assert cpu_perf(0, 35 * MB) == 0.0  # CPU-bound and no cores: no progress
    assert cores_needed(100 * MB, np.inf) == 0.0
    assert cores_needed(70 * MB, 35 * MB) == pytest.approx(2.0)


def test_autocache_variant_hand_computed():
    # Preprocessed cache: e = 6 (decoded images, Plumber), r = 35 MB/s, p = 350 MB/s per core.
    # d = 100 GB, c = 300 GB holds 300 / 600 = half the items. CPU cost per byte:
    # 0.5/350 + 0.5/35 = 0.0157142../MB -> 4 cores give 4 / 0.0157142 = 254.5 MB/s.
    # IO: 50 MB/s / 0.5 = 100 MB/s. f* = 300: IO binds at 100.
    kw = dict(cores=4, cpu_rate=35 * MB, expansion=6.0, post_cpu_rate=350 * MB)
    assert pipeline_perf(300 * MB, 50 * MB, 300 * GB, 100 * GB, **kw) == pytest.approx(100 * MB)
    assert pipeline_perf(300 * MB, 500 * MB, 300 * GB, 100 * GB, **kw) == pytest.approx(4 / (0.5 / 350 + 0.5 / 35) * MB)
    # The same 300 GB as source cache holds everything (h = 1) but every item costs 1/35 core-s/MB:
    # CPU binds at 4 x 35 = 140.
    assert pipeline_perf(300 * MB, 50 * MB, 300 * GB, 100 * GB, 4, 35 * MB) == pytest.approx(140 * MB)
    # Fully preprocessed-cached (c = 600 GB): 4 x 350 = 1400, f* binds at 300.
    assert pipeline_perf(300 * MB, 0.0, 600 * GB, 100 * GB, **kw) == pytest.approx(300 * MB)
    assert cores_needed(100 * MB, 35 * MB, 0.5, 350 * MB) == pytest.approx(100 * (0.5 / 350 + 0.5 / 35))


def test_vectorised_matches_scalar():
    f = np.array([100, 100, 100.0]) * MB
    got = pipeline_perf(f, [100 * MB, 100 * MB, 4 * MB], [500 * GB, 500 * GB, 900 * GB], 1000 * GB, [8, 2, 8], [35 * MB, 35 * MB, np.inf])
    assert got == pytest.approx(np.array([100, 70, 40.0]) * MB)
    assert list(diagnose(f, [1, 1, 1], [100 * MB, 100 * MB, 4 * MB], [500 * GB, 500 * GB, 900 * GB], 1000 * GB, [8, 2, 8],
                         [35 * MB, 35 * MB, np.inf]).bound) == ["gpu", "cpu", "cache"]


@pytest.mark.parametrize("kw,name", [(dict(cpu_rate=-1.0), "cpu_rate"), (dict(cpu_rate=0.0), "cpu_rate"),
                                     (dict(cores=-2.0, cpu_rate=1.0), "cores"), (dict(cpu_rate=1.0, post_cpu_rate=0.0), "post_cpu_rate"),
                                     (dict(cpu_rate=float("nan")), "cpu_rate"), (dict(expansion=0.0), "expansion")])
def test_bad_input_names_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        pipeline_perf(100.0, 10.0, 0.0, 1000.0, **kw)


def test_autocache_choice_hand_computed():
    from estimator.pipeline import choose_autocache

    # One job, f* 300, r 35, p 350, e 6, d 100 GB, 4 cores, link 500 MB/s.
    # 300 GB of cache: source mode holds everything (h = 1) but CPU binds at 4 x 35 = 140;
    # preprocessed holds half (h = 0.5): CPU 254.5, IO 1000: 254.5 > 140 -> preprocessed.
    args = dict(dataset_index=[0], n_datasets=1, ideal=[300 * MB], remote_io=[500 * MB], dataset_size=[100 * GB],
                cores=[4], cpu_rate=[35 * MB], expansion=[6.0], post_cpu_rate=[350 * MB])
    assert choose_autocache(cache=[300 * GB], **args).tolist() == [True]
    # 60 GB of cache and a 20 MB/s link: source h = 0.6 -> IO 50; preprocessed h = 0.1 -> IO 22.2.
    assert choose_autocache(cache=[60 * GB], **{**args, "remote_io": [20 * MB]}).tolist() == [False]
    # A job without an autocache point: both modes equal, source kept.
    assert choose_autocache(cache=[300 * GB], **{**args, "expansion": [1.0], "post_cpu_rate": [35 * MB]}).tolist() == [False]


@pytest.mark.parametrize("call,name", [
    # An infinite cache over an infinite dataset has no hit ratio (inf / inf).
    (lambda: pipeline_perf(100.0, 10.0, np.inf, np.inf), "hit"),
    (lambda: diagnose(100.0, 1, 10.0, np.inf, np.inf), "hit"),
    # expansion x dataset_size underflowing to 0 is an empty dataset, as it was before the
    # checks moved out of the model's kernels.
    (lambda: pipeline_perf(100.0, 10.0, 1.0, 1e-200, expansion=1e-200), "dataset_size"),
    (lambda: diagnose(100.0, 1, 10.0, 1.0, 1e-200, expansion=1e-200), "dataset_size"),
    (lambda: diagnose(100.0, np.inf, 10.0, 1.0, 1000.0), "gpus"),
])
def test_degenerate_inputs_are_refused_not_answered_with_nan(call, name):
    with pytest.raises(ValueError, match=name):
        call()
