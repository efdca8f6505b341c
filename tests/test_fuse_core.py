"""Unit tests of the data plane's pure core and of the cache/fetch logic without a mount."""

from __future__ import annotations

import math
import os
import random
import threading
import time
from pathlib import Path

import pytest

from estimator.errors import UserError
from fuse_client.accounting import EpochBitset, JobAccounting
from fuse_client.breaker import RetryPolicy
from fuse_client.cache_store import DatasetCache, file_crc32, item_key
from fuse_client.dataplane import ItemResolver
from contract.names import validate_name
from fuse_client.remote import RemoteFetchError, RemoteStore
from fuse_client.token_bucket import Throttle, TokenBucket, chunk_size_for
from fuse_client.uniform_cache import CachedItem, choose_evictions, should_admit

from dataplane_helpers import make_dataset

# -- token bucket ------------------------------------------------------------------------------


def simulate(bucket: TokenBucket, total: int, chunk: int, start: float = 0.0) -> float:
    """Drive the bucket with a fake clock; return when the last chunk was granted."""
    now, sent = start, 0
    while sent < total:
        wait = bucket.try_take(chunk, now)
        if wait == 0.0:
            sent += chunk
        else:
            now += wait
    return now


@pytest.mark.parametrize("rate", [1e6, 50e6, 500e6])
def test_bucket_long_run_rate_is_exact(rate):
    bucket = TokenBucket(rate=rate, tokens=0.0, last=0.0)
    chunk = chunk_size_for(rate)
    total = int(rate * 10)
    elapsed = simulate(bucket, total, chunk)
    achieved = total / (elapsed + chunk / rate)  # the last chunk needs its own time to transfer
    assert achieved == pytest.approx(rate, rel=0.01)


def test_bucket_burst_is_bounded_after_idle():
    bucket = TokenBucket(rate=1e6, tokens=0.0, last=0.0)
    # After 100 s idle, at most one burst (0.1 s worth, >= 64 KiB) is free.
    assert bucket.try_take(100_000, 100.0) == 0.0
    assert bucket.try_take(100_000, 100.0) > 0.0


@pytest.mark.parametrize("rate,seconds", [(0.2e6, 0.37), (2e6, 0.37), (2e6, 3.0), (50e6, 0.5)])
def test_a_window_after_idle_reads_what_the_burst_aware_model_says(rate, seconds):
    """Issue 49: a short epoch that follows an idle spell of the link reads b x seconds plus the
    bucket's banked burst (the real PyTorch job's 0.37 s epochs read 18-20% over b / (1 - c/d));
    estimator.window_io_perf models it, and over a long window it is b / (1 - c/d) again."""
    from estimator import io_perf, window_io_perf

    bucket = TokenBucket(rate=rate, tokens=0.0, last=0.0)
    item = 9_000  # a JPEG of the job's dataset: one fetch each
    start = now = 10.0  # ten seconds idle
    granted = 0
    while True:
        wait = bucket.try_take(item, now)
        if wait:
            now += wait
            continue
        if now >= start + seconds:
            break
        granted += item
    model = window_io_perf(rate, 0.0, 1.0, seconds, bucket.burst) * seconds
    assert granted == pytest.approx(model, abs=item)
    assert window_io_perf(rate, 0.5, 1.0, 1e9, bucket.burst) == pytest.approx(io_perf(rate, 0.5, 1.0))


def test_bucket_request_larger_than_burst_goes_into_debt():
    bucket = TokenBucket(rate=1e6, tokens=0.0, last=0.0)
    now = bucket.try_take(5_000_000, 0.0)  # waits for one burst only
    assert now == pytest.approx(0.1)
    assert bucket.try_take(5_000_000, now) == 0.0
    # 0.1 s worth was saved up, 4.9 MB is debt at 1 MB/s: the next request waits 4.9 s.
    assert bucket.try_take(1, now) == pytest.approx(4.9, rel=0.001)


def test_bucket_rate_change_applies_from_now_and_zero_pauses():
    bucket = TokenBucket(rate=1e6, tokens=0.0, last=0.0)
    bucket.set_rate(0.0, 1.0)
    assert math.isinf(bucket.try_take(10, 50.0))
    bucket.set_rate(2e6, 50.0)
    wait = bucket.try_take(200_000, 50.0)
    # Nothing was earned while paused (a paused bucket keeps at most the 64 KiB minimum burst);
    # the rest accrues at the new rate from the moment of the change.
    assert wait == pytest.approx((200_000 - 65_536) / 2e6, abs=1e-5)
    with pytest.raises(ValueError):
        bucket.set_rate(-1, 51.0)


def test_unlimited_bucket_never_waits():
    bucket = TokenBucket(rate=math.inf)
    assert all(bucket.try_take(10**9, 0.0) == 0.0 for _ in range(100))


def test_throttle_picks_up_a_new_rate_within_a_second():
    throttle = Throttle(rate=0.0)  # paused
    done = threading.Event()

    def fetch():
        throttle.acquire(1000)
        done.set()

    threading.Thread(target=fetch, daemon=True).start()
    assert not done.wait(0.3)
    t0 = time.monotonic()
    throttle.set_rate(10e6)
    assert done.wait(1.0)
    assert time.monotonic() - t0 < 1.0


def test_throttle_close_wakes_waiters():
    throttle = Throttle(rate=0.0)
    errors = []

    def fetch():
        try:
            throttle.acquire(10)
        except InterruptedError as exc:
            errors.append(exc)

    t = threading.Thread(target=fetch)
    t.start()
    throttle.close()
    t.join(1.0)
    assert not t.is_alive() and errors


# -- uniform caching rules ---------------------------------------------------------------------


def test_admission_boundary():
    assert should_admit(90, 10, 100)
    assert not should_admit(91, 10, 100)
    assert not should_admit(0, 1, 0)


def test_random_eviction_fits_and_is_random():
    items = [CachedItem(f"k{i}", 100) for i in range(100)]
    victims_a = choose_evictions(items, 3_000, random.Random(1))
    victims_b = choose_evictions(items, 3_000, random.Random(2))
    assert sum(v.size for v in victims_a) == 7_000
    assert {v.key for v in victims_a} != {v.key for v in victims_b}
    # Not LRU/FIFO-like: the victims are spread over the whole insertion order.
    idx = sorted(int(v.key[1:]) for v in victims_a)
    assert idx[0] < 30 and idx[-1] > 70
    assert choose_evictions(items, 10_000) == []


def test_epoch_bitset_and_accounting():
    bits = EpochBitset(10)
    assert bits.set(3) and not bits.set(3) and bits.test(3) and bits.count == 1
    acc = JobAccounting(num_items=3)
    acc.item_opened(0, hit=False, admitted_size=500)
    acc.item_opened(1, hit=True)
    snap = acc.snapshot(0.0)
    assert (snap.hits, snap.misses, snap.items_read_epoch, snap.epoch, snap.ineffective_cached_bytes) == (1, 1, 2, 0, 500)
    acc.item_opened(2, hit=False)
    snap = acc.snapshot(1.0)
    assert (snap.epoch, snap.items_read_epoch, snap.ineffective_cached_bytes) == (1, 0, 0)


def test_name_validation():
    assert validate_name("imagenet-1k_v2.0", "--dataset") == "imagenet-1k_v2.0"
    for bad in ["a/b", "..", "a..b", "", "-x", "x" * 200, "a b"]:
        with pytest.raises(UserError, match="--dataset"):
            validate_name(bad, "--dataset")


# -- cache store -------------------------------------------------------------------------------


def _stage(cache: DatasetCache, key: str, data: bytes):
    fd, path = cache.new_staging_file(key)
    os.pwrite(fd, data, 0)
    crc = file_crc32(fd, len(data))
    os.close(fd)
    return path, crc


def test_shared_allocation_is_enforced_across_instances(tmp_path):
    # Two instances = two mount processes with their own SQLite connections on one directory.
    a, b = DatasetCache(tmp_path, "ds"), DatasetCache(tmp_path, "ds")
    a.set_allocation(2500)
    admitted = []
    for i, cache in enumerate([a, b, a, b]):
        path, crc = _stage(cache, item_key(f"k{i}"), b"x" * 1000)
        admitted.append(cache.publish(item_key(f"k{i}"), path, 1000, crc))
    assert admitted == [True, True, False, False]
    assert b.usage().cached_bytes == 2000 and a.usage().items_cached == 2
    assert b.set_allocation(1000) == 1000  # shrink from the other instance: random eviction
    assert a.usage().cached_bytes == 1000
    assert len([p for p in (tmp_path / "ds" / "items").glob("*/*")]) == 1


def _crash(cache: DatasetCache) -> None:
    """What kill -9 leaves: the process's descriptors close, the clean-unmount step never runs."""
    os.close(cache._alive_fd)
    cache._alive_fd = None


def _disk_items(cache: DatasetCache) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in cache.items_dir.glob("*/*")}


def test_clean_remount_trusts_the_index_and_checks_nothing(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    assert cache.attach().ran
    for i in range(3):
        path, crc = _stage(cache, item_key(f"k{i}"), bytes([i]) * 5000)
        assert cache.publish(item_key(f"k{i}"), path, 5000, crc)
    assert cache.detach()  # the last mount marks the index clean
    (cache.staging_dir / "left.over").write_bytes(b"partial")
    fresh = DatasetCache(tmp_path, "ds")
    report = fresh.attach()
    assert report.ran and report.clean and report.verified == 0 and report.removed_staging == 1
    assert not fresh.verify_pending and fresh.usage().items_cached == 3
    # While mounted the index is unclean: a crash now must not be mistaken for a clean stop.
    _crash(fresh)
    again = DatasetCache(tmp_path, "ds")
    assert not again.attach().clean and again.verify_pending


def test_detach_of_one_of_two_mounts_does_not_mark_clean(tmp_path):
    a, b = DatasetCache(tmp_path, "ds"), DatasetCache(tmp_path, "ds")
    a.attach()
    assert not b.attach().ran
    assert not a.detach()  # b is still alive
    _crash(b)
    assert not DatasetCache(tmp_path, "ds").attach().clean


def test_crash_recovery_repairs_only_items_in_flight_then_verifies_lazily(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    cache.attach()
    for i in range(4):
        path, crc = _stage(cache, item_key(f"k{i}"), bytes([i]) * 5000)
        assert cache.publish(item_key(f"k{i}"), path, 5000, crc)
    # Died between the link into items/ and the commit of an admission:
    path, _ = _stage(cache, item_key("torn"), b"t" * 700)
    os.link(path, cache.item_path(item_key("torn")))
    # Died between an eviction's unlink and its commit:
    cache._journal([item_key("k3")])
    cache.item_path(item_key("k3")).unlink()
    # Bit rot in an item that was not in flight, and a staging leftover:
    p1 = cache.item_path(item_key("k1"))
    data = bytearray(p1.read_bytes())
    data[100] ^= 0xFF
    p1.write_bytes(bytes(data))
    (cache.staging_dir / "left.over").write_bytes(b"partial")
    # A fetch that was refused admission and whose item another mount then admitted: the
    # staging name must not make recovery unlink the (indexed) item.
    leftover, _ = _stage(cache, item_key("k0"), b"x" * 10)
    _crash(cache)

    fresh = DatasetCache(tmp_path, "ds")
    report = fresh.attach()
    assert report.ran and not report.clean and report.journaled == 1
    assert report.dropped_unindexed == 1 and report.dropped_missing_rows == 1 and report.verified == 0
    assert not fresh.item_path(item_key("torn")).exists()
    assert fresh.usage().items_cached == 3 and fresh.usage().cached_bytes == 15000
    assert not any(fresh.staging_dir.iterdir())
    # k1 was not in flight, so recovery did not read it; the first hit (or the background
    # verifier) checks it and drops it.
    assert fresh.verify_pending
    fd = fresh.open_cached(item_key("k1"))
    assert fd is not None and not fresh.verify_item(item_key("k1"), fd)
    os.close(fd)
    assert fresh.open_cached(item_key("k1")) is None
    last, checked, dropped = fresh.verify_batch("", 100)
    assert checked == 2 and dropped == 0 and fresh.verify_batch(last)[0] is None
    fresh.finish_verification()
    assert not DatasetCache(tmp_path, "ds").refresh_verify_pending()
    assert fresh.usage() == DatasetCache(tmp_path, "ds").usage()
    assert sum(_disk_items(fresh).values()) == fresh.usage().cached_bytes == 10000


def test_counters_equal_the_sum_on_disk_after_random_admissions_and_evictions(tmp_path):
    rng = random.Random(7)
    cache = DatasetCache(tmp_path, "ds")
    cache.attach()
    for step in range(300):
        if rng.random() < 0.08:
            cache.set_allocation(rng.randrange(0, 400_000))
        else:
            key = item_key(f"k{rng.randrange(400)}")
            size = rng.randrange(0, 9000)
            path, crc = _stage(cache, key, os.urandom(size))
            if not cache.publish(key, path, size, crc):
                path.unlink()
        if step % 50 == 0:
            cache.set_allocation(2**62)
        usage = cache.usage()
        on_disk = _disk_items(cache)
        assert usage.cached_bytes == sum(on_disk.values()) and usage.items_cached == len(on_disk)
        assert usage.cached_bytes <= max(usage.allocation_bytes, 0) or usage.allocation_bytes >= 2**62


_CHURN = """
import os, random, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from fuse_client.cache_store import DatasetCache, file_crc32, item_key
cache = DatasetCache(sys.argv[1], "ds")
cache.attach()
rng = random.Random(int(sys.argv[4]))
print("ready", flush=True)
while True:
    if rng.random() < 0.05:
        cache.set_allocation(rng.randrange(50_000, 600_000))
        continue
    key = item_key(f"k{rng.randrange(2000)}")
    size = rng.randrange(1, 6000)
    fd, path = cache.new_staging_file(key)
    os.pwrite(fd, os.urandom(size), 0)
    crc = file_crc32(fd, size)
    os.close(fd)
    if not cache.publish(key, path, size, crc):
        path.unlink()
"""


@pytest.mark.parametrize("seed", [1, 2])
def test_counters_equal_the_sum_on_disk_after_kill9_in_the_middle_of_admissions(tmp_path, seed):
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", _CHURN, str(tmp_path), str(repo), str(repo / "tests"), str(seed * 10 + i)],
                              stdout=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    time.sleep(1.5 + seed * 0.37)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    cache = DatasetCache(tmp_path, "ds")
    report = cache.attach()
    assert report.ran and not report.clean
    rows = dict(cache._db().execute("SELECT key, size FROM items"))
    on_disk = _disk_items(cache)
    assert on_disk == rows  # no file without a row, no row without a file, sizes agree
    usage = cache.usage()
    assert usage.cached_bytes == sum(on_disk.values()) and usage.items_cached == len(on_disk) > 0
    # Killed between recording a smaller allocation and evicting down to it: the mount's next
    # tick evicts; counters stay exact through that too.
    cache.enforce_allocation()
    usage = cache.usage()
    assert usage.cached_bytes <= usage.allocation_bytes
    assert usage.cached_bytes == sum(_disk_items(cache).values())
    assert not any(cache.staging_dir.iterdir())
    assert not (tmp_path / "ds" / "locks").exists()


# -- the resolver (fetch path) without a mount -------------------------------------------------


def _resolver(tmp_path: Path, source: Path, job_rate: float = math.inf, cache: DatasetCache | None = None, allocation: int | None = None):
    store = RemoteStore(str(source))
    listing = store.list()
    cache = cache or DatasetCache(tmp_path / "cache", "ds")
    if allocation is not None:
        cache.set_allocation(allocation)
    acc = JobAccounting(num_items=len(listing.files))
    return ItemResolver(store, cache, Throttle(job_rate), acc), listing


def test_resolver_hits_after_admission_and_counts_remote_bytes(tmp_path):
    ds = make_dataset(tmp_path / "src", n_files=5)
    resolver, listing = _resolver(tmp_path, ds.root)
    entry = listing.files[sorted(ds.sizes)[0]]
    first = resolver.resolve(entry)
    second = resolver.resolve(entry)
    assert not first.hit and second.hit
    assert os.pread(second.fd, entry.size, 0) == (ds.root / entry.path).read_bytes()
    assert resolver.accounting.remote_bytes == entry.size


def test_remote_error_is_retried_then_eio_and_nothing_enters_the_cache(tmp_path, monkeypatch):
    ds = make_dataset(tmp_path / "src", n_files=3)
    resolver, listing = _resolver(tmp_path, ds.root)
    resolver.store.policy = RetryPolicy(backoff_s=0.01)
    calls = []
    real_open = resolver.store._open

    def flaky_open(rel, chunk, size=None):
        calls.append(rel)
        f = real_open(rel, chunk, size)
        f.read = lambda n, _r=f.read: (_ for _ in ()).throw(ConnectionResetError("peer reset"))
        return f

    monkeypatch.setattr(resolver.store, "_open", flaky_open)
    entry = listing.files[sorted(ds.sizes)[0]]
    with pytest.raises(RemoteFetchError) as info:
        resolver.resolve(entry)
    assert info.value.errno == 5 and len(calls) == resolver.store.policy.attempts
    assert resolver.cache.usage().items_cached == 0
    assert not any(resolver.cache.staging_dir.iterdir())
    # A transient error that clears up is retried transparently.
    fails = iter([True, False])

    def once_flaky(rel, chunk, size=None):
        f = real_open(rel, chunk, size)
        if next(fails, False):
            f.read = lambda n: (_ for _ in ()).throw(TimeoutError("slow"))
        return f

    monkeypatch.setattr(resolver.store, "_open", once_flaky)
    item = resolver.resolve(entry)
    assert os.pread(item.fd, entry.size, 0) == (ds.root / entry.path).read_bytes()


def test_concurrent_misses_of_one_item_are_fetched_once(tmp_path):
    """Two jobs (separate caches on one dir, like two processes) miss the same item together."""
    ds = make_dataset(tmp_path / "src", n_files=1, min_size=400_000, max_size=400_000)
    # Allocation 0: nothing is admitted, so the waiter must get the fetcher's transient copy.
    r1, listing = _resolver(tmp_path, ds.root, job_rate=1e6, allocation=0)
    r2, _ = _resolver(tmp_path, ds.root, job_rate=1e6, cache=DatasetCache(tmp_path / "cache", "ds"))
    entry = next(iter(listing.files.values()))
    results = {}

    def run(name, r):
        results[name] = r.resolve(entry)

    t1 = threading.Thread(target=run, args=("a", r1))
    t1.start()
    time.sleep(0.1)
    t2 = threading.Thread(target=run, args=("b", r2))
    t2.start()
    t1.join(10)
    t2.join(10)
    total_remote = r1.accounting.remote_bytes + r2.accounting.remote_bytes
    assert total_remote == entry.size
    assert r2.accounting.shared_fetches == 1
    for item in results.values():
        assert os.pread(item.fd, entry.size, 0) == (ds.root / entry.path).read_bytes()
    assert not any(r1.cache.transient_dir.iterdir())  # the last waiter cleaned up
    assert r1.cache.usage().items_cached == 0


def test_item_key_is_flat_and_stable():
    assert item_key("a/b.jpg") == item_key("a/b.jpg") != item_key("a/c.jpg")
    assert "/" not in item_key("../../etc/passwd")


def test_unmount_wakes_opens_whose_fetch_never_started(tmp_path):
    """With every fetch worker busy, queued misses must not hang when the mount closes."""
    ds = make_dataset(tmp_path / "src", n_files=6, min_size=50_000, max_size=50_000)
    store = RemoteStore(str(ds.root))
    listing = store.list()
    cache = DatasetCache(tmp_path / "cache", "ds")
    throttle = Throttle(0.0)  # paused: fetches block on tokens
    resolver = ItemResolver(store, cache, throttle, JobAccounting(len(listing.files)), fetch_workers=2)
    errors = []

    def open_one(entry):
        try:
            resolver.resolve(entry)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(e,)) for e in listing.files.values()]
    for t in threads:
        t.start()
    wait = time.monotonic() + 5
    while resolver.fetches_running() < 2 and time.monotonic() < wait:
        time.sleep(0.01)
    assert resolver.fetches_running() == 2  # two running, four queued behind them
    throttle.close()
    resolver.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 6
    wait = time.monotonic() + 5
    while resolver.fetches_running() and time.monotonic() < wait:
        time.sleep(0.01)
    assert resolver.fetches_running() == 0 and cache.usage().items_cached == 0
    assert not any(cache.staging_dir.iterdir())


def test_latency_histogram_buckets_are_upper_bounds_and_cumulative():
    from fuse_client.accounting import LATENCY_BUCKETS_S, LatencyHistogram

    h = LatencyHistogram()
    for v in (0.0, 0.00005, 0.00006, 1.0, 1.0001, 60.0):
        h.observe(v)
    out = h.export()
    le = dict((str(b), c) for b, c in out["buckets"])
    assert le[str(0.00005)] == 2 and le[str(0.0001)] == 3 and le[str(1.0)] == 4 and le[str(2.5)] == 5
    assert out["buckets"][-1] == ["+Inf", 6] and out["count"] == 6 and len(out["buckets"]) == len(LATENCY_BUCKETS_S) + 1
    assert abs(out["sum_s"] - 62.00021) < 1e-9
    assert h.quantile(0.5) == 0.0001 and h.quantile(1.0) == float("inf")


def test_local_listing_follows_symlinks_once_and_matches_the_tree(tmp_path):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "x.bin").write_bytes(b"x" * 10)
    (src / "top.bin").write_bytes(b"t" * 3)
    (src / "a" / "loop").symlink_to(src)  # a cycle must not hang the mount
    (src / "link.bin").symlink_to(src / "top.bin")
    listing = RemoteStore(str(src)).list()
    assert {p: e.size for p, e in listing.files.items()} == {"a/b/x.bin": 10, "top.bin": 3, "link.bin": 3}
    assert sorted(listing.dirs[""]) == ["a", "link.bin", "top.bin"] and listing.dirs["a/b"] == ["x.bin"]
    assert [listing.files[p].index for p in sorted(listing.files)] == [0, 1, 2]
