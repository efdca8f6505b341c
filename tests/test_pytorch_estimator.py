"""The estimator against the real PyTorch job (a short form of benchmarks/bench_pytorch_estimator.py):
through a real `silod mount`, with the link binding, the job's steady throughput after its first
epoch is b / (1 - c/d), and the hit ratio the mount measures is c/d (uniform caching).

IO-bound points only: there the prediction does not depend on f*, which on a shared machine
drifts by tens of percent within a minute (the benchmark measures it before every point).
Needs torch, /dev/fuse and root (fails under CI=true where they are missing)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from scheduler.backends.local import fuse_problems

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

pytestmark = [pytest.mark.fuse, pytest.mark.slow]


def _need(problem: str | None) -> None:
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true must run the PyTorch job: {problem}")
    pytest.skip(problem)


def test_io_bound_real_job_follows_b_over_one_minus_c_over_d(tmp_path: Path) -> None:
    from scheduler.demo import make_jpegs, torch_problem

    _need(torch_problem())
    problems = fuse_problems()
    _need("real FUSE mounts are not possible here: " + "; ".join(problems) if problems else None)
    from bench_pytorch_estimator import Point, median, mounted, rate, run_point, trainer

    from estimator import loader_miss_time, window_io_perf
    from fuse_client.token_bucket import TokenBucket

    source = tmp_path / "remote" / "jpegs"
    d = make_jpegs(source, 160, seed=2)
    with mounted(tmp_path, source, "fstar", d * 1.05, None) as (mnt, _stats):
        reference = trainer(mnt, 2)
        try:
            reference.epoch()  # fills its cache
            fstar = rate(reference.epoch())
            # Binds up to c/d = 0.95. Low enough that a measured epoch lasts seconds: each follows
            # the reference's, during which the link idles and the token bucket banks its burst B
            # (an epoch of E seconds reads b E + B of misses: estimator.window_io_perf), and at
            # each epoch's end the link idles while the trainer takes the batches the loader
            # prefetched (about as long as B lasts at b); at b = 0.2 f*, epochs under 1 s followed
            # neither b / (1 - c/d) (1.06, 0.91) nor the burst-aware rate (0.98, 0.80).
            b = 0.05 * fstar
            for i, c in enumerate((0.0, 0.5)):
                r = run_point(tmp_path, source, d, i, Point(c, b, f"c/d={c}"), reference, 2, 2)
                assert r.hit_ratio is not None and abs(r.hit_ratio - c) <= 0.06, r
                assert r.predicted_mb_s == pytest.approx(b / (1 - c) / 1e6), r
                assert r.burst_bytes == TokenBucket(rate=b).burst
                windowed = median([t / window_io_perf(b, c, 1.0, d / t, r.burst_bytes) for _f, t in r.pairs])
                print(f"c/d={c}: epochs {r.epoch_s} s, measured / (b / (1 - c/d)) {r.ratio:.3f},"
                      f" / ((b + B/E) / (1 - c/d)) {windowed:.3f}")
                assert 0.8 <= r.ratio <= 1.15, r
                assert 0.8 <= windowed <= 1.15, (r, windowed)
                # The token bucket's queue (estimator.loader_miss_time): at this cap a miss holds
                # its worker W s (1/b' - 1/((1-h) f*)), 20 s/f* - 2 s/((1-h) f*) here, mostly the
                # wait for tokens (L_free, under 2 ms, is below it), as the mount times it.
                seconds = median([d / t for _f, t in r.pairs])
                model = float(loader_miss_time(0.0, 2, r.miss_item_bytes, r.fstar_mb_s * 1e6, c, b, r.burst_bytes, seconds))
                print(f"c/d={c}: per-miss time {r.miss_service_s * 1e3:.2f} ms, L(b) {model * 1e3:.2f} ms")
                assert r.miss_service_s == pytest.approx(model, rel=0.3), (r, model)
        finally:
            reference.close()


def test_the_benchmark_runs_the_loader_with_the_prefetch_it_is_given(tmp_path: Path) -> None:
    """`--prefetch P` reaches the job's DataLoader (torch's prefetch_factor), for every trainer the
    benchmark starts: the depth of the loader's read-ahead is what the c/d = 0.5 point's departure
    from the loader term is checked against (docs/sdk.md)."""
    from scheduler.demo import make_jpegs, torch_problem

    _need(torch_problem())
    from bench_pytorch_estimator import main, trainer

    make_jpegs(tmp_path / "jpegs", 8, seed=3)
    for prefetch in (2, 8):
        t = trainer(tmp_path / "jpegs", 2, prefetch)
        try:
            assert t.loader.prefetch_factor == prefetch and t.loader.num_workers == 2
        finally:
            t.close()
    with pytest.raises(SystemExit):
        main(["--prefetch", "x"])


def test_the_benchmark_runs_the_loader_out_of_order_when_asked(tmp_path: Path) -> None:
    """`--out-of-order` reaches the job's DataLoader as torch's in_order=False (batches handed out
    as workers finish them): the partial-cache points are compared both ways (docs/sdk.md). Bad
    --fractions are refused with the flag named."""
    from scheduler.demo import make_jpegs, torch_problem

    _need(torch_problem())
    from bench_pytorch_estimator import main, trainer

    make_jpegs(tmp_path / "jpegs", 8, seed=3)
    for in_order in (True, False):
        t = trainer(tmp_path / "jpegs", 2, 2, in_order)
        try:
            assert t.loader.in_order is in_order
            assert t.epoch()["items"] == 8  # every item once, whatever the order
        finally:
            t.close()
    for bad in ("x", "0.5,2"):
        with pytest.raises(SystemExit):
            main(["--fractions", bad])


def test_the_loader_order_benchmark_refuses_bad_input() -> None:
    """benchmarks/bench_loader_order.py names the flag it cannot use, before any mount."""
    from bench_loader_order import main

    for bad in (["--fractions", "x"], ["--fractions", "1.5"], ["--pairs", "0"], ["--b-prefetch", "0"]):
        with pytest.raises(SystemExit):
            main(bad)
