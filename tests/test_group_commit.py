"""Group commit of the index inserts of concurrent misses (cache_store.DatasetCache.publish): the
items of misses that finish while another thread's admission transaction runs are admitted
together in one transaction, and each open still returns only after its own item is committed.

Real components: a real DatasetCache (SQLite) in tmp_path; real FUSE mounts of both front ends
over a real HTTP server on 127.0.0.1 (tests/hostile_http.py's, its answers held at a barrier).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import zlib

import pytest

from dataplane_helpers import mounted
from fuse_client.cache_store import DatasetCache, item_key
from hostile_http import HostileSource

N = 8


def _staged(cache: DatasetCache, key: str, data: bytes):
    fd, path = cache.new_staging_file(key)
    os.write(fd, data)
    os.close(fd)
    return path


def _indexed(cache: DatasetCache) -> set[str]:
    """The keys committed in the index, read on a connection of its own (what another process sees)."""
    db = sqlite3.connect(cache.root / "index.sqlite")
    try:
        return {k for (k,) in db.execute("SELECT key FROM items")}
    finally:
        db.close()


def test_concurrent_publishes_commit_in_one_transaction_and_none_is_visible_before_it(tmp_path, monkeypatch):
    """N threads publish while the write lock is held: on its release, one transaction admits all
    N. Before: each publish ran its own transaction (N COMMITs). No item is in the index, nor
    returned by publish, before that commit."""
    cache = DatasetCache(tmp_path / "cache", "ds")
    commits: list[str] = []
    connect = sqlite3.connect

    def traced(*args, **kw):  # the real connection, its COMMITs recorded
        db = connect(*args, **kw)
        db.set_trace_callback(lambda sql: commits.append(sql) if sql.strip().upper() == "COMMIT" else None)
        return db

    monkeypatch.setattr(sqlite3, "connect", traced)
    items = {f"k{i:02d}": os.urandom(1000 + i) for i in range(N)}
    keys = {name: item_key(name) for name in items}
    staged = {name: _staged(cache, keys[name], data) for name, data in items.items()}
    returned: dict[str, tuple[bool, set[str]]] = {}

    def publish(name: str) -> None:
        data = items[name]
        ok = cache.publish(keys[name], staged[name], len(data), zlib.crc32(data))
        returned[name] = (ok, _indexed(cache))  # what is committed when this call returns

    threads = [threading.Thread(target=publish, args=(name,)) for name in items]
    with cache._write_lock:  # another transaction of this process runs
        for t in threads:
            t.start()
        time.sleep(0.5)  # every publisher reaches the lock
        assert returned == {}
        assert _indexed(cache) == set()
        commits.clear()
    for t in threads:
        t.join(10)
    assert len(commits) == 1, commits
    for name, (ok, committed) in returned.items():
        assert ok and keys[name] in committed, name
    assert cache.admission_commits == 1
    usage = cache.usage()
    assert (usage.items_cached, usage.cached_bytes) == (N, sum(len(d) for d in items.values()))
    for name, data in items.items():
        fd = cache.open_cached(keys[name])
        assert fd is not None and os.read(fd, len(data) + 1) == data
        os.close(fd)
        assert not staged[name].exists()  # the staging name goes once its item is committed
    cache.close()


def test_a_failing_item_of_a_batch_fails_only_its_own_publish(tmp_path):
    """An item whose staging file is gone cannot be linked: its publish raises, and the others of
    the same batch are admitted in their own transactions."""
    cache = DatasetCache(tmp_path / "cache", "ds")
    items = {f"k{i}": os.urandom(500) for i in range(4)}
    keys = {name: item_key(name) for name in items}
    staged = {name: _staged(cache, keys[name], data) for name, data in items.items()}
    staged["k2"].unlink()
    results: dict[str, object] = {}

    def publish(name: str) -> None:
        data = items[name]
        try:
            results[name] = cache.publish(keys[name], staged[name], len(data), zlib.crc32(data))
        except OSError as exc:
            results[name] = exc

    threads = [threading.Thread(target=publish, args=(name,)) for name in items]
    with cache._write_lock:
        for t in threads:
            t.start()
        time.sleep(0.5)
    for t in threads:
        t.join(10)
    assert isinstance(results.pop("k2"), FileNotFoundError)
    assert results == {"k0": True, "k1": True, "k3": True}
    assert _indexed(cache) == {keys[n] for n in ("k0", "k1", "k3")}
    assert cache.usage().items_cached == 3
    cache.close()


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_misses_finishing_together_share_admission_transactions_and_open_after_their_commit(tmp_path, backend):
    """N readers open N cold items while another process (this test) holds the index's write
    lock; once every item's bytes have left the server, the lock is let go. The N admissions
    then take at most 2 transactions (the first waiter began its own before the others arrived;
    the rest went into one) - before, one each, and the stats had no `cache_admission_commits`.
    Each read returns its bytes with its item already committed in the index."""
    if backend == "raw" and os.geteuid() != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("the raw front end mounts with mount(2): run as root")
        pytest.skip("the raw front end mounts with mount(2): run as root")
    items = {f"f{i:02d}.bin": os.urandom(20_000 + i) for i in range(N)}
    src = HostileSource(items)
    cache_dir = tmp_path / "cache"
    index = cache_dir / "ds" / "index.sqlite"
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", cache_dir, "--fuse-backend", backend) as m:
            os.listdir(m.mountpoint)
            seen: dict[str, tuple[bytes, bool]] = {}
            errors: list[BaseException] = []

            def read(name: str) -> None:
                try:
                    data = (m.mountpoint / name).read_bytes()
                    db = sqlite3.connect(index)
                    try:
                        there = db.execute("SELECT 1 FROM items WHERE key = ?", (item_key(name),)).fetchone()
                    finally:
                        db.close()
                    seen[name] = (data, there is not None)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            holder = sqlite3.connect(index, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")  # another mount's write transaction
            threads = [threading.Thread(target=read, args=(name,)) for name in items]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while sum(r.sent for name in items for r in src.item_requests(name)) < sum(map(len, items.values())):
                assert time.monotonic() < deadline, f"the items were not fetched\n{m.log()}"
                time.sleep(0.05)
            time.sleep(0.5)  # their fetches end and their admissions wait for the index
            assert seen == {}, "an open returned before its item was committed"
            holder.execute("ROLLBACK")
            holder.close()
            for t in threads:
                t.join(60)
            assert not errors, f"{errors}\n{m.log()}"
            for name, data in items.items():
                assert seen[name] == (data, True), name
            s = m.fresh_stats()
            assert s["items_cached"] == N, s
            assert 1 <= s["cache_admission_commits"] <= 2, s
    finally:
        src.close()
