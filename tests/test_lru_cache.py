"""LRU mode of the dataset cache (fuse_client/lru_cache.py and its hooks in cache_store.py),
without a mount: the rules by hand, eviction at admission, shrink, the mode across instances
(mount processes) and restarts, and the allocation as an invariant on random workloads."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuse_client import lru_cache
from fuse_client.cache_store import DatasetCache, file_crc32, item_key
from fuse_client.lru_cache import CacheMode, StampedItem, admission_victims, choose_lru_evictions, parse_mode


def _put(cache: DatasetCache, name: str, size: int, byte: int = 7) -> bool:
    key = item_key(name)
    fd, path = cache.new_staging_file(key)
    os.pwrite(fd, bytes([byte]) * size, 0)
    crc = file_crc32(fd, size)
    os.close(fd)
    admitted = cache.publish(key, path, size, crc)
    if not admitted:
        os.unlink(path)
    return admitted


def _stamp(cache: DatasetCache, name: str, ns: int) -> None:
    os.utime(cache.item_path(item_key(name)), ns=(ns, ns))


def _cached(cache: DatasetCache) -> set[str]:
    return {p.name for p in cache.items_dir.glob("*/*")}


def test_choose_lru_evictions_by_hand():
    items = [StampedItem("a", 100, 30), StampedItem("b", 100, 10), StampedItem("c", 50, 20), StampedItem("d", 100, 10)]
    # 350 cached, target 200: evict oldest first (b, d at t=10, by key), 200 freed -> 150 left.
    assert [i.key for i in choose_lru_evictions(items, 200)] == ["b", "d"]
    assert [i.key for i in choose_lru_evictions(items, 250)] == ["b"]
    assert choose_lru_evictions(items, 350) == []
    assert [i.key for i in choose_lru_evictions(items, 0)] == ["b", "d", "c", "a"]
    # With slack, whole items that fit in it go too, in LRU order, and never one that does not.
    assert [i.key for i in choose_lru_evictions(items, 250, slack_bytes=100)] == ["b", "d"]
    assert [i.key for i in choose_lru_evictions(items, 250, slack_bytes=99)] == ["b"]
    # Room for a 100-byte item under a 10,000-byte allocation full of 50-byte items: 100 bytes
    # plus the 1% batch (100 bytes) -> the 4 oldest.
    full = [StampedItem(f"k{i:03d}", 50, i) for i in range(200)]
    assert [i.key for i in admission_victims(full, 10_000, 100)] == ["k000", "k001", "k002", "k003"]
    assert admission_victims(full[:10], 10_000, 100) == []


def test_parse_mode():
    assert parse_mode(" LRU ") is CacheMode.LRU and parse_mode("uniform") is CacheMode.UNIFORM
    with pytest.raises(ValueError, match="--cache-mode 'fifo' is not a cache mode; use one of: uniform, lru"):
        parse_mode("fifo")


def test_lru_evicts_the_least_recently_used_at_admission(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    cache.set_allocation(300)
    cache.set_mode(CacheMode.LRU)
    for i, name in enumerate("abc"):
        assert _put(cache, name, 100)
        _stamp(cache, name, 1_000_000_000 * (i + 1))  # a oldest, c newest
    # A hit on `a` makes it the most recent: noted on the hit path, stamped on the file by the
    # flush (the control tick's, or the one before victims are chosen, as here).
    fd = cache.open_cached(item_key("a"))
    os.close(fd)
    assert os.stat(cache.item_path(item_key("a"))).st_mtime_ns == 1_000_000_000
    assert cache.flush_recency() == 1 and cache.flush_recency() == 0
    assert os.stat(cache.item_path(item_key("a"))).st_mtime_ns > 3_000_000_000
    os.close(cache.open_cached(item_key("a")))  # noted again; the admission below flushes it
    assert _put(cache, "d", 100)  # full: evicts b (least recently used), admits d
    assert _cached(cache) == {item_key(n) for n in "acd"}
    assert cache.usage().cached_bytes == 300
    # An item larger than the whole allocation is never admitted, and evicts nothing.
    assert not _put(cache, "huge", 301)
    assert cache.usage().cached_bytes == 300


def test_uniform_mode_is_unchanged_and_never_evicts_at_admission(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    assert cache.mode is CacheMode.UNIFORM  # a fresh cache
    cache.set_allocation(200)
    assert _put(cache, "a", 100) and _put(cache, "b", 100)
    assert not _put(cache, "c", 100)
    assert _cached(cache) == {item_key("a"), item_key("b")}
    _stamp(cache, "a", 5)
    os.close(cache.open_cached(item_key("a")))  # no note in uniform mode
    assert cache.flush_recency() == 0
    assert os.stat(cache.item_path(item_key("a"))).st_mtime_ns == 5


def test_lru_shrink_evicts_oldest_first(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    cache.set_mode(CacheMode.LRU)
    for i, name in enumerate("abcde"):
        assert _put(cache, name, 100)
        _stamp(cache, name, (5 - i) * 1_000_000_000)  # e oldest ... a newest
    assert cache.set_allocation(250) == 300
    assert _cached(cache) == {item_key("a"), item_key("b")}


def test_mode_is_shared_by_instances_and_survives_a_restart(tmp_path):
    a, b = DatasetCache(tmp_path, "ds"), DatasetCache(tmp_path, "ds")
    a.set_allocation(200)
    a.set_mode(CacheMode.LRU)
    assert (tmp_path / "ds" / lru_cache.MODE_FILE).read_text().strip() == "lru"
    # b was created before the switch; its admission reads the mode afresh.
    assert _put(b, "x", 100) and _put(b, "y", 100)
    _stamp(b, "x", 1)
    assert _put(b, "z", 100)  # LRU: evicts x
    assert b.mode is CacheMode.LRU and item_key("x") not in _cached(b)
    a.detach()
    b.detach()
    restarted = DatasetCache(tmp_path, "ds")
    assert restarted.attach().ran
    assert restarted.mode is CacheMode.LRU and restarted.usage().cached_bytes == 200
    assert restarted.set_mode(CacheMode.UNIFORM) == 0
    assert DatasetCache(tmp_path, "ds").mode is CacheMode.UNIFORM
    assert not _put(restarted, "w", 100)  # uniform again: full means no admission


def test_switching_to_lru_enforces_the_allocation_by_recency(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    for i, name in enumerate("abc"):
        assert _put(cache, name, 100)
        _stamp(cache, name, (i + 1) * 1_000_000_000)
    with cache._tx() as db:  # an allocation lowered behind the cache's back (another node's push)
        db.execute("UPDATE meta SET value = 150 WHERE name = 'allocation_bytes'")
    assert cache.set_mode(CacheMode.LRU) == 200
    assert _cached(cache) == {item_key("c")}


def test_garbage_mode_file_reads_as_uniform(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    (cache.root / lru_cache.MODE_FILE).write_text("mru\n")
    assert cache.refresh_mode() is CacheMode.UNIFORM


@settings(max_examples=30, deadline=None)
@given(
    allocation=st.integers(0, 2_000),
    ops=st.lists(st.tuples(st.sampled_from(["put", "hit", "shrink", "grow", "mode"]), st.integers(0, 30), st.integers(1, 400)),
                 min_size=1, max_size=40),
    seed=st.integers(0, 1000),
)
def test_cached_bytes_never_exceed_the_allocation(tmp_path_factory, allocation, ops, seed):
    cache = DatasetCache(tmp_path_factory.mktemp("c"), "ds")
    cache.set_allocation(allocation)
    cache.set_mode(CacheMode.LRU)
    rng = random.Random(seed)
    clock = 1_000_000_000
    for op, item, size in ops:
        if op == "put" and _put(cache, f"i{item}", size):
            clock += 1_000
            _stamp(cache, f"i{item}", clock)
        elif op == "hit":
            fd = cache.open_cached(item_key(f"i{item}"))
            if fd is not None:
                os.close(fd)
        elif op == "shrink":
            allocation = max(allocation - size, 0)
            cache.set_allocation(allocation)
        elif op == "grow":
            allocation += size
            cache.set_allocation(allocation)
        elif op == "mode":
            cache.set_mode(rng.choice([CacheMode.LRU, CacheMode.UNIFORM]))
        usage = cache.usage()
        assert usage.cached_bytes <= allocation
        on_disk = sum(p.stat().st_size for p in cache.items_dir.glob("*/*"))
        assert on_disk == usage.cached_bytes


# -- the data manager stores the mode --------------------------------------------------------


def test_data_manager_stores_the_mode_validates_it_and_keeps_it_across_restarts(tmp_path):
    from fastapi.testclient import TestClient

    from datamanager.app import create_app

    with TestClient(create_app(tmp_path)) as client:
        assert client.put("/v1/datasets/ds/cache-mode", json={"mode": "lru"}).status_code == 404  # never declared
        assert client.put("/v1/datasets/ds", json={}).status_code == 200
        for bad in ({"mode": "mru"}, {"mode": None}, {}, {"mode": "lru", "bytes": 1}):
            r = client.put("/v1/datasets/ds/cache-mode", json=bad)
            assert r.status_code == 422, r.text
            assert "mode" in r.json()["detail"] or "bytes" in r.json()["detail"], r.text
        assert client.get("/v1/datasets/ds").json()["cache_mode"] is None
        reg = {"client_id": "c1", "node": "n1", "dataset": "ds", "job": "j"}
        assert "cache_mode" not in client.post("/v1/clients", json=reg).json()["allocation"]  # unset: old shape
        assert client.put("/v1/datasets/ds/cache-mode", json={"mode": "lru"}).json()["cache_mode"] == "lru"
        beat = client.put("/v1/clients/c1/heartbeat", json={"stats": {}}).json()
        assert beat["allocation"]["cache_mode"] == "lru"
    with TestClient(create_app(tmp_path)) as restarted:
        assert restarted.get("/v1/datasets/ds").json()["cache_mode"] == "lru"
        assert restarted.get("/v1/status").json()["datasets"]["ds"]["cache_mode"] == "lru"


# -- LRU as a CachePolicy of the scale-out cache (counters, journal, recovery) -------------------


def test_the_mode_selects_the_cache_policy(tmp_path):
    from fuse_client.lru_cache import LruPolicy, policy_for
    from fuse_client.uniform_cache import CachedItem, UniformPolicy

    cache = DatasetCache(tmp_path, "ds")
    assert isinstance(cache.policy, UniformPolicy) and not cache.policy.evicts_to_admit(1, 10)
    cache.set_mode(CacheMode.LRU)
    assert isinstance(cache.policy, LruPolicy) and cache.policy.uses_recency
    assert LruPolicy().evicts_to_admit(10, 10) and not LruPolicy().evicts_to_admit(11, 10)
    assert isinstance(policy_for(CacheMode.UNIFORM), UniformPolicy)
    # LRU shrinks by recency whatever the rng; uniform's choice is random.
    items = [CachedItem("old", 10, 1), CachedItem("new", 10, 2)]
    assert [v.key for v in LruPolicy().choose_evictions(items, 10, random.Random(1))] == ["old"]


def test_a_crash_inside_an_evicting_admission_is_repaired_from_the_journal(tmp_path, monkeypatch):
    cache = DatasetCache(tmp_path, "ds")
    cache.attach()
    cache.set_allocation(300)
    cache.set_mode(CacheMode.LRU)
    for i, name in enumerate("abc"):
        assert _put(cache, name, 100)
        _stamp(cache, name, (i + 1) * 1_000_000_000)

    def die(*args, **kwargs):
        raise OSError("power cut")  # after the victims' files are unlinked, before the commit

    monkeypatch.setattr(cache, "_admit", die)
    with pytest.raises(OSError, match="power cut"):
        _put(cache, "d", 100)
    # The transaction rolled back: `a`'s row is back but its file is gone; the journal says so.
    assert not cache.item_path(item_key("a")).exists()
    with cache._tx() as db:
        assert [k for (k,) in db.execute("SELECT key FROM journal")] == [item_key("a")]
    assert not cache.detach(clean=True)  # a journal left behind: never marked clean
    restarted = DatasetCache(tmp_path, "ds")
    report = restarted.attach()
    assert report.ran and not report.clean and report.dropped_missing_rows == 1
    usage = restarted.usage()
    assert usage.cached_bytes == 200 and usage.items_cached == 2
    assert sum(p.stat().st_size for p in restarted.items_dir.glob("*/*")) == 200
    assert _put(restarted, "d", 100) and restarted.usage().cached_bytes == 300


def test_verification_reads_are_not_uses_and_unmount_stamps_the_last_hits(tmp_path):
    cache = DatasetCache(tmp_path, "ds")
    cache.set_mode(CacheMode.LRU)
    assert _put(cache, "a", 100) and _put(cache, "b", 100)
    _stamp(cache, "a", 5)
    _stamp(cache, "b", 5)
    last, checked, dropped = cache.verify_batch("")
    assert last is not None and checked == 2 and dropped == 0
    assert cache.flush_recency() == 0  # the background verification after a crash made nothing recent
    os.close(cache.open_cached(item_key("b")))  # a hit the control tick has not stamped yet
    cache.detach()
    assert os.stat(cache.item_path(item_key("a"))).st_mtime_ns == 5
    assert os.stat(cache.item_path(item_key("b"))).st_mtime_ns > 5


def test_mounts_admitting_at_once_never_exceed_the_allocation_on_disk(tmp_path):
    """Four cache instances (one per mount process) admit under LRU concurrently while a
    sampler sums the item files on disk: never above the allocation, always equal to the
    counters, and the counters equal the rows at the end."""
    import threading

    allocation = 2_000
    DatasetCache(tmp_path, "ds").set_allocation(allocation)
    DatasetCache(tmp_path, "ds").set_mode(CacheMode.LRU)
    stop = threading.Event()
    worst = [0]
    errors: list[BaseException] = []

    def sample() -> None:
        # Every change to items/ happens inside a write transaction, so a scan made while holding
        # the write lock is a snapshot (a scan without it can count an evicted item and the item
        # admitted in its place).
        observer = DatasetCache(tmp_path, "ds")
        while not stop.is_set():
            with observer._tx() as db:
                total = sum(p.stat().st_size for p in observer.items_dir.glob("*/*"))
                assert total == observer._meta(db, "cached_bytes")
            worst[0] = max(worst[0], total)
            stop.wait(0.003)  # let the writers in (SQLite's busy wait is not fair)

    def mount(n: int) -> None:
        try:
            cache = DatasetCache(tmp_path, "ds")
            rng = random.Random(n)
            for i in range(60):
                _put(cache, f"m{n}-{i}", rng.randint(50, 300))
                if i % 5 == 0:
                    fd = cache.open_cached(item_key(f"m{n}-{rng.randrange(i + 1)}"))
                    if fd is not None:
                        os.close(fd)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def sample_or_report() -> None:
        try:
            sample()
        except BaseException as exc:  # reported below
            errors.append(exc)

    sampler = threading.Thread(target=sample_or_report)
    sampler.start()
    mounts = [threading.Thread(target=mount, args=(n,)) for n in range(4)]
    for t in mounts:
        t.start()
    for t in mounts:
        t.join(120)
    stop.set()
    sampler.join(10)
    assert not errors, errors
    assert 0 < worst[0] <= allocation
    cache = DatasetCache(tmp_path, "ds")
    with cache._tx() as db:
        rows = db.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM items").fetchone()
        assert db.execute("SELECT COUNT(*) FROM journal").fetchone()[0] == 0
    usage = cache.usage()
    assert (usage.cached_bytes, usage.items_cached) == tuple(rows)
    assert usage.cached_bytes == sum(p.stat().st_size for p in cache.items_dir.glob("*/*"))
    assert allocation - 300 < usage.cached_bytes <= allocation  # it filled up and kept turning over
