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
    with mounted(tmp_path, source, "fstar", d * 1.05, None) as (mnt, _stats, ref_pid):
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
                r = run_point(tmp_path, source, d, i, Point(c, b, f"c/d={c}"), reference, 2, 2, ref_pid=ref_pid)
                assert r.hit_ratio is not None and abs(r.hit_ratio - c) <= 0.06, r
                assert r.predicted_mb_s == pytest.approx(b / (1 - c) / 1e6), r
                assert r.burst_bytes == TokenBucket(rate=b).burst
                # Both trainers' processes were accounted over the point's two measured epochs and
                # the three reference epochs around them (R P R P R).
                assert r.usage is not None and r.usage["items"] == 2 * 160 and r.usage["cpu_ms"]["workers"] > 0
                assert r.usage_ref is not None and r.usage_ref["items"] == 3 * 160
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


def test_the_benchmark_accounts_each_process_cpu_and_run_queue_wait(tmp_path: Path) -> None:
    """The benchmark's per-process accounting (what located the partial-cache shortfall: the
    loader's workers and the mount's threads waiting for a core, docs/sdk.md): one accounted
    epoch of a real trainer charges its workers' decode CPU to `workers` (not to `main`), a busy
    child process's CPU and its wait for a core are read from all its threads, and the per-item
    figures are totals over items (hand-computed)."""
    import subprocess

    from scheduler.demo import make_jpegs, torch_problem

    _need(torch_problem())
    from bench_pytorch_estimator import ROLES, Usage, accounted_epoch, schedstat, trainer, usage_summary

    # Two threads of a child spin until each has used 0.35 s of CPU, and exit: their CPU still counts (the process's
    # utime + stime keeps exited threads'); a process that is gone reads 0, 0.
    busy = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                             "def spin():\n    while time.thread_time() < 0.35: pass\n"
                             "ts = [threading.Thread(target=spin) for _ in range(2)]\n"
                             "[t.start() for t in ts]; [t.join() for t in ts]; print(1, flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE)
    try:
        assert busy.stdout is not None and busy.stdout.readline()  # both threads are done
        cpu, wait = schedstat(busy.pid)
        assert cpu >= 0.68 and wait >= 0.0  # 2 x 0.35 s, in clock ticks of 10 ms
    finally:
        busy.kill()
        busy.wait()
    assert schedstat(busy.pid) == (0.0, 0.0)

    # 256 images: ~0.1 s of decode, several of the 10 ms clock ticks /proc/<pid>/stat counts in
    make_jpegs(tmp_path / "jpegs", 256, seed=3)
    t = trainer(tmp_path / "jpegs", 2)
    try:
        t.epoch()  # starts the persistent workers
        u = Usage.zero()
        rec = accounted_epoch(t, os.getpid(), u)  # no mount here: this process stands in as one
        assert rec["items"] == 256 and u.items == 256 and u.seconds == rec["seconds"]
        assert u.cpu["workers"] > 0  # Pillow's decode runs in the two worker processes
        assert u.machine[0] > 0 and 0.0 <= (u.busy or 0.0) <= 1.0
    finally:
        t.close()
    # Per item: totals over items; cores: CPU over wall seconds; busy: 1 - idle / all jiffies.
    hand = Usage({"main": 0.2, "workers": 0.6, "mount": 0.2}, {"main": 0.1, "workers": 0.3, "mount": 0.4}, items=200,
                 seconds=0.5, machine=(400, 100))
    assert hand.per_item("cpu", "workers") == 0.6 / 200 and hand.per_item("wait", "mount") == 0.4 / 200
    assert hand.cores == 2.0 and hand.busy == 0.75
    s = usage_summary(hand)
    assert s["cpu_ms"] == {"main": 1.0, "workers": 3.0, "mount": 1.0} and s["wait_ms"]["mount"] == 2.0
    assert s["cores"] == 2.0 and s["busy"] == 0.75 and set(s["cpu_ms"]) == set(ROLES)
    assert Usage.zero().per_item("cpu", "main") is None and Usage.zero().busy is None


def test_each_measured_epoch_takes_the_mean_f_star_of_the_reference_epochs_around_it() -> None:
    """R P R P R: the two measured epochs' f* are (10 + 14) / 2 and (14 + 6) / 2 (hand-computed);
    a steady drift of f* from 10 to 14 within a pair is then cancelled, where the reference before
    alone (10) would put the epoch 20% off. Fewer than two references is refused."""
    from bench_pytorch_estimator import bracketed

    assert bracketed([10.0, 14.0, 6.0]) == [12.0, 10.0]
    with pytest.raises(ValueError, match="before and after"):
        bracketed([10.0])
