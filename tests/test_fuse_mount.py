"""Real FUSE mounts of `silod mount` over a local directory: caching, throttling, crash safety."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time

import pytest

from fuse_client.cache_store import item_key

from dataplane_helpers import force_unmount, item_files, make_dataset, mounted, read_epoch, silod_cmd, start_mount

pytestmark = pytest.mark.fuse

CONTRACT_KEYS = {"remote_bytes", "hit_bytes", "miss_bytes", "cached_bytes", "items_cached", "read_bytes"}


# Both FUSE front ends serve the same operations; the crash-safety and caching contracts are
# checked on each (raw = the /dev/fuse server with passthrough, what `auto` picks as root on
# Linux >= 6.9; libfuse = mfusepy over the system libfuse).
BACKENDS = ["raw", "libfuse"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "raw" and os.geteuid() != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("the raw FUSE backend needs root")
        pytest.skip("the raw FUSE backend needs root")
    return request.param


@pytest.fixture
def dataset(tmp_path):
    return make_dataset(tmp_path / "remote", n_files=240, seed=1)  # ~4.8 MB, 240 items


def test_uniform_caching_epoch_two_reads_one_minus_c_over_d_remotely(tmp_path, dataset, backend):
    d = dataset.total
    allocation = int(0.4 * d)
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(dataset.root), "ds", "job1", cache, "--cache-size", str(allocation),
                 "--fuse-backend", backend) as m:
        read_epoch(m.mountpoint, dataset, seed=1)
        s1 = m.fresh_stats()
        assert set(s1) >= CONTRACT_KEYS
        # Epoch 1 fills the cache to its allocation (within one item) and never beyond.
        assert allocation - 32_000 < s1["cached_bytes"] <= allocation
        assert s1["remote_bytes"] == d and s1["read_bytes"] == d and s1["miss_bytes"] == d
        assert s1["epoch"] == 1 and s1["items_read_epoch"] == 0
        on_disk = sum(p.stat().st_size for p in item_files(cache, "ds"))
        assert on_disk == s1["cached_bytes"]

        read_epoch(m.mountpoint, dataset, seed=2)
        s2 = m.fresh_stats()
        epoch2_remote = s2["remote_bytes"] - s1["remote_bytes"]
        # Epoch 2 fetches (1 - c/d) of the dataset remotely, within 2% of the dataset.
        assert abs(epoch2_remote - (1 - allocation / d) * d) <= 0.02 * d
        assert s2["hit_bytes"] == s1["cached_bytes"]
        assert s2["cached_bytes"] == s1["cached_bytes"]  # no eviction, no growth once full
        assert s2["read_bytes"] == 2 * d


def test_shrinking_the_allocation_evicts_randomly_and_hit_ratio_follows(tmp_path, dataset):
    d = dataset.total
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(dataset.root), "ds", "job1", cache, "--cache-size", str(int(0.7 * d))) as m:
        read_epoch(m.mountpoint, dataset, seed=1)
    kept_before = {p.name for p in item_files(cache, "ds")}
    new_alloc = int(0.3 * d)
    # A new allocation for the same dataset on this node (latest writer wins) shrinks the cache.
    with mounted(tmp_path / "mnt", str(dataset.root), "ds", "job2", cache, "--cache-size", str(new_alloc)) as m:
        s0 = m.fresh_stats()
        assert new_alloc - 32_000 < s0["cached_bytes"] <= new_alloc
        read_epoch(m.mountpoint, dataset, seed=3)
        s = m.fresh_stats()
    assert abs(s["hit_bytes"] / d - new_alloc / d) <= 0.02
    after_files = {p.name: p.stat().st_size for p in item_files(cache, "ds")}
    kept_after = set(after_files)
    # Eviction stops once the cache fits, which can leave room below the allocation for an item
    # smaller than that slack; uniform caching may admit such items, but nothing beyond it.
    added = kept_after - kept_before
    assert sum(after_files[n] for n in added) <= new_alloc - s0["cached_bytes"]
    kept_after &= kept_before
    # Random, not "oldest first": survivors come from the whole fill order of epoch 1.
    order = sorted(dataset.sizes)
    import random

    random.Random(1).shuffle(order)
    positions = sorted(i for i, rel in enumerate(order) if item_key(rel) in kept_after)
    n_cached_before = len(kept_before)
    assert positions[0] < n_cached_before * 0.3 and positions[-1] > n_cached_before * 0.7


def test_remote_fetches_are_throttled_and_hits_are_not(tmp_path):
    ds = make_dataset(tmp_path / "remote", n_files=20, min_size=100_000, max_size=100_000)
    rate = 1_000_000  # 1 MB/s; the dataset is 2 MB
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--io-rate", "1MB/s") as m:
        t0 = time.monotonic()
        read_epoch(m.mountpoint, ds, seed=1)
        elapsed = time.monotonic() - t0
        # 2 MB at 1 MB/s: at most one 0.1 s burst is free, so >= 1.9 s; generous upper bound.
        assert elapsed >= (ds.total - 0.1 * rate) / rate * 0.97
        assert elapsed < 6.0
        t0 = time.monotonic()
        read_epoch(m.mountpoint, ds, seed=2)  # all cached (no --cache-size: unlimited)
        assert time.monotonic() - t0 < 1.0
        s = m.fresh_stats()
        assert s["hit_bytes"] == ds.total and s["remote_bytes"] == ds.total


def test_kill9_then_restart_drops_corrupt_items_and_never_serves_them(tmp_path, dataset, backend):
    cache = tmp_path / "cache"
    m = start_mount(tmp_path / "mnt", str(dataset.root), "ds", "job1", cache, "--fuse-backend", backend)
    try:
        read_epoch(m.mountpoint, dataset, seed=1)
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
    finally:
        m.stop()
    assert not os.path.ismount(m.mountpoint)
    victim_rel = sorted(dataset.sizes)[7]
    victim = cache / "ds" / "items" / item_key(victim_rel)[:2] / item_key(victim_rel)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x55  # bit rot / torn write
    victim.write_bytes(bytes(data))
    (cache / "ds" / "staging" / "half-written.tmp").write_bytes(b"partial")
    with mounted(tmp_path / "mnt", str(dataset.root), "ds", "job1", cache, "--fuse-backend", backend) as m2:
        read_epoch(m2.mountpoint, dataset, seed=2)  # verifies every byte against the source
        s = m2.fresh_stats()
        assert s["remote_bytes"] == dataset.sizes[victim_rel]  # only the dropped item is refetched
        assert s["items_cached"] == len(dataset.sizes)
    assert victim.read_bytes() == (dataset.root / victim_rel).read_bytes()
    assert not (cache / "ds" / "staging" / "half-written.tmp").exists()


def test_remote_error_gives_eio_and_nothing_partial_is_cached(tmp_path, dataset, backend):
    cache = tmp_path / "cache"
    gone = sorted(dataset.sizes)[3]
    with mounted(tmp_path / "mnt", str(dataset.root), "ds", "job1", cache, "--fuse-backend", backend) as m:
        (dataset.root / gone).unlink()  # the store loses the object after listing
        t0 = time.monotonic()
        with pytest.raises(OSError) as info:
            (m.mountpoint / gone).read_bytes()
        assert info.value.errno == errno.EIO
        assert time.monotonic() - t0 >= 1.0  # retried with backoff before giving up
        s = m.fresh_stats()
        assert s["items_cached"] == 0 and s["cached_bytes"] == 0
        other = sorted(dataset.sizes)[4]
        assert (m.mountpoint / other).read_bytes() == (dataset.root / other).read_bytes()
    assert not any((cache / "ds" / "staging").iterdir())


def test_two_jobs_share_one_cache_and_a_concurrent_miss_is_fetched_once(tmp_path, dataset):
    cache = tmp_path / "cache"
    d = dataset.total
    with mounted(tmp_path / "a", str(dataset.root), "ds", "jobA", cache, "--cache-size", str(int(0.5 * d))) as a, \
         mounted(tmp_path / "b", str(dataset.root), "ds", "jobB", cache) as b:
        read_epoch(a.mountpoint, dataset, seed=1)
        read_epoch(b.mountpoint, dataset, seed=2)
        sa, sb = a.fresh_stats(), b.fresh_stats()
        # B hits exactly what A cached: cache space is charged once for the dataset.
        assert sb["hit_bytes"] == sa["cached_bytes"] == sb["cached_bytes"]
        assert sb["remote_bytes"] == d - sa["cached_bytes"]
    # Concurrent misses: one big item, slow remote IO, both jobs read it at the same time.
    big = make_dataset(tmp_path / "remote2", n_files=1, min_size=600_000, max_size=600_000, seed=5)
    rel = next(iter(big.sizes))
    with mounted(tmp_path / "a", str(big.root), "big", "jobA", cache, "--cache-size", "0", "--io-rate", "1MB/s") as a, \
         mounted(tmp_path / "b", str(big.root), "big", "jobB", cache, "--io-rate", "1MB/s") as b:
        out = {}
        ta = threading.Thread(target=lambda: out.__setitem__("a", (a.mountpoint / rel).read_bytes()))
        ta.start()
        time.sleep(0.2)
        out["b"] = (b.mountpoint / rel).read_bytes()
        ta.join(10)
        assert out["a"] == out["b"] == (big.root / rel).read_bytes()
        sa, sb = a.fresh_stats(), b.fresh_stats()
        assert sa["remote_bytes"] + sb["remote_bytes"] == big.total
        assert sa["items_cached"] == 0  # allocation 0: shared in flight, not cached


def test_stats_file_is_rewritten_every_second_and_atomically(tmp_path, dataset):
    with mounted(tmp_path / "mnt", str(dataset.root), "ds", "job1", tmp_path / "cache") as m:
        stamps = set()
        t0 = time.time()
        while time.time() - t0 < 2.2:
            stamps.add(m.stats()["updated_at"])  # json.loads fails on a torn file
            time.sleep(0.02)
        assert len(stamps) >= 3
        assert not [p for p in m.stats_file.parent.iterdir() if p.name.endswith(".tmp")]


def test_mount_is_read_only_and_lists_the_store(tmp_path, dataset):
    with mounted(tmp_path / "mnt", str(dataset.root), "ds", "job1", tmp_path / "cache") as m:
        assert sorted(os.listdir(m.mountpoint)) == ["class0", "class1", "class2", "class3"]
        rel = sorted(dataset.sizes)[0]
        assert (m.mountpoint / rel).stat().st_size == dataset.sizes[rel]
        with pytest.raises(OSError) as info:
            open(m.mountpoint / rel, "r+b")
        assert info.value.errno in (errno.EROFS, errno.EACCES)
        with pytest.raises(OSError):
            (m.mountpoint / "new.bin").write_bytes(b"x")
        assert not (m.mountpoint / "missing.bin").exists()


def test_sigint_unmounts_cleanly_even_with_a_throttled_read_in_flight(tmp_path, backend):
    ds = make_dataset(tmp_path / "remote", n_files=1, min_size=2_000_000, max_size=2_000_000)
    m = start_mount(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--io-rate", "100KB/s",
                    "--fuse-backend", backend)
    try:
        reader = subprocess.Popen(["cat", str(m.mountpoint / next(iter(ds.sizes)))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        m.proc.send_signal(signal.SIGINT)
        assert m.proc.wait(10) == 0
        assert not os.path.ismount(m.mountpoint)
        reader.wait(10)
    finally:
        m.stop()


# -- bad input: exit 2, a message naming the input, no state change ----------------------------


def _run_mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*silod_cmd(), "mount", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing_mountpoint", "does not exist"),
        ("nonempty_mountpoint", "not empty"),
        ("unreachable_source", "unreachable"),
        ("missing_source_dir", "does not exist"),
        ("slash_in_dataset", "--dataset"),
        ("dotdot_job", "--job"),
        ("negative_cache_size", "--cache-size"),
        ("text_io_rate", "--io-rate"),
        ("too_many_slow_fetches", "--slow-fetches"),
        ("negative_memory_staging", "--memory-staging"),
        ("zero_index_bytes", "--max-index-bytes"),
        ("zero_listing_entries", "--max-listing-entries"),
        ("tiny_listing_bytes", "--max-listing-bytes"),
        ("tiny_inflight_bytes", "--max-inflight-bytes"),
        ("negative_stream_min", "--stream-min-size '-8MiB' is negative"),
        ("rate_stream_min", "--stream-min-size '8MB/s' is a rate"),
        ("word_stream_min", "--stream-min-size 'never' is not a size; write bytes as a number or with a unit, e.g. 143GB, 1.3TB, 512MiB; or off"),
        ("huge_stream_min", "--stream-min-size 2199023255552 bytes: must be between 64 KiB and 1 TiB"),
        ("tiny_stream_min", "--stream-min-size 1000 bytes: must be between 64 KiB and 1 TiB"),
    ],
)
def test_bad_mount_input_exits_2_with_a_clear_message(tmp_path, dataset, case, expect):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache = tmp_path / "cache"
    args = {"mnt": str(mnt), "source": str(dataset.root), "dataset": "ds", "job": "job1"}
    extra: list[str] = []
    if case == "missing_mountpoint":
        args["mnt"] = str(tmp_path / "nope")
    elif case == "nonempty_mountpoint":
        (mnt / "x").write_text("x")
    elif case == "unreachable_source":
        args["source"] = "http://127.0.0.1:9/dataset/"
    elif case == "missing_source_dir":
        args["source"] = str(tmp_path / "no-such-dir")
    elif case == "slash_in_dataset":
        args["dataset"] = "a/b"
    elif case == "dotdot_job":
        args["job"] = ".."
    elif case == "negative_cache_size":
        extra = ["--cache-size", "-5GB"]
    elif case == "text_io_rate":
        extra = ["--io-rate", "fast"]
    elif case == "too_many_slow_fetches":
        extra = ["--slow-fetches", "100000"]
    elif case == "negative_memory_staging":
        extra = ["--memory-staging", "-1MB"]
    elif case == "zero_index_bytes":
        extra = ["--max-index-bytes", "0"]
    elif case == "zero_listing_entries":
        extra = ["--max-listing-entries", "0"]
    elif case == "tiny_listing_bytes":
        extra = ["--max-listing-bytes", "100"]
    elif case == "tiny_inflight_bytes":
        extra = ["--max-inflight-bytes", "1KB"]
    elif case == "negative_stream_min":
        extra = ["--stream-min-size", "-8MiB"]
    elif case == "rate_stream_min":
        extra = ["--stream-min-size", "8MB/s"]
    elif case == "word_stream_min":
        extra = ["--stream-min-size", "never"]  # the word is `off`
    elif case == "huge_stream_min":
        extra = ["--stream-min-size", "2TiB"]
    elif case == "tiny_stream_min":
        extra = ["--stream-min-size", "1KB"]
    r = _run_mount(args["mnt"], "--source", args["source"], "--dataset", args["dataset"], "--job", args["job"],
                   "--cache-dir", str(cache), *extra)
    try:
        assert r.returncode == 2, r.stderr
        assert "error:" in r.stderr and expect in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert not os.path.ismount(mnt)
        assert not cache.exists()
    finally:
        force_unmount(mnt)
