"""Issue 45's bad-day guarantees, re-checked for streaming opens (misses >= --stream-min-size whose
reads wait for the staged bytes instead of their open waiting for the whole item).

tests/test_fuse_bad_day.py proves each Build item with items below the streaming threshold; here
the same hostile sources (tests/hostile_http.py, a real HTTP server on 127.0.0.1) serve items
that stream, through real mounts on both front ends: a slow-but-alive item, pauses longer than
the read timeout, a full cache disk (a real tmpfs filled to its last block), and a source that
sends far more than listed while the disk is full (memory staging), with the mount's peak RSS.
"""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest

from dataplane_helpers import mounted
from hostile_http import Behaviour, HostileSource, mount_and_read
from test_fuse_bad_day import RSS_LIMIT_KB, _peak_rss_kb

pytestmark = pytest.mark.fuse

MiB = 1 << 20
BACKENDS = ["libfuse", "raw"]


def _data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _backend_args(backend: str) -> list[str]:
    if backend == "raw" and os.geteuid() != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("the raw front end mounts with mount(2): run as root")
        pytest.skip("the raw front end mounts with mount(2): run as root")
    return ["--fuse-backend", backend]


def _read(path) -> bytes | OSError:
    try:
        with open(path, "rb", buffering=0) as f:
            out = bytearray()
            while chunk := f.read(MiB):
                out += chunk
            return bytes(out)
    except OSError as exc:
        return exc


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slow_but_alive_streamed_item_reaches_its_reader(tmp_path, backend):
    """Item 2 with a streaming open: 200 kB trickling at 40 kB/s (5 s) under a 1 s deadline. The
    chunks are 64 KiB (--max-inflight-bytes) so that the item streams (--stream-min-size 64KiB):
    its reads wait for each staged chunk, longer than the stall limit in all, and get every byte."""
    data = _data(200_000, 1)
    src = HostileSource({"slow.bin": data}, {"slow.bin": Behaviour(trickle_rate=40_000, times=100)})
    with mount_and_read(tmp_path, src, "slow.bin", data, [*_backend_args(backend), "--open-deadline", "1",
                                                          "--stream-min-size", "64KiB", "--max-inflight-bytes", "64KiB"],
                        _read) as m:
        s = m.fresh_stats()
        assert s["streaming_opens"] == 1 and s["failed_opens"] == 0, s


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pauses_in_a_streamed_item_cost_resumes_not_its_reader(tmp_path, backend):
    """Item 3 with a streaming open: a 12 MiB item pauses twice for longer than the read timeout
    (deadline 2 s: 1 s) while its reader already reads it. The reader gets every byte; the fetch
    resumes after the staged bytes (ranged requests), never restarting from byte 0."""
    data = _data(12 * MiB, 2)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(pause_at=(5 * MiB, 9 * MiB), pause_s=1.6, times=2)})
    with mount_and_read(tmp_path, src, "big.bin", data, [*_backend_args(backend), "--open-deadline", "2"],
                        _read) as m:
        reqs = src.item_requests("big.bin")
        assert len(reqs) == 3 and all(r.range for r in reqs[1:]), [(r.range, r.sent) for r in reqs]
        assert sum(r.sent for r in reqs) < 1.5 * len(data)
        assert m.fresh_stats()["streaming_opens"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flaky_source_gives_a_streamed_items_reader_every_byte(tmp_path, backend):
    """Item 6's flaky remote with a streaming open: the item's first three answers are 500s and
    every later one is cut after 3 MiB. The reader of the 12 MiB item (its open returned at the
    first staged bytes) gets every byte, no EIO: each cut is resumed after the staged bytes."""
    data = _data(12 * MiB, 3)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(fail_first=3, drop_every=3 * MiB, times=100)})
    with mount_and_read(tmp_path, src, "big.bin", data, [*_backend_args(backend), "--open-deadline", "5"],
                        _read) as m:
        reqs = src.item_requests("big.bin")
        assert [r.status for r in reqs[:3]] == [500] * 3 and all(r.status == 206 for r in reqs[4:]), \
            [(r.range, r.status, r.sent) for r in reqs]
        assert sum(r.sent for r in reqs) < 1.2 * len(data)
        s = m.fresh_stats()
        assert s["streaming_opens"] == 1 and s["failed_opens"] == 0 and s["remote_breaker_state"] == "closed", s


def _full_disk_mount(tmp_path, backend, src, *extra, size="1m", fill=True):
    """A mount whose cache is on a tmpfs of `size`: filled to its last block (`fill`), or left to
    fill up while the first items are staged (a disk that becomes full mid-item)."""
    from full_disk import fill_to_the_last_block, tiny_tmpfs

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk_cm = tiny_tmpfs(tmp_path / "disk", size=size)
    disk = disk_cm.__enter__()
    mount_cm = mounted(tmp_path / "mnt", src.url, "ds", "job1", disk / "cache", *_backend_args(backend),
                       "--breaker-threshold", "2", *extra)
    try:
        m = mount_cm.__enter__()
        if fill:
            fill_to_the_last_block(disk / "filler")
    except BaseException:
        disk_cm.__exit__(None, None, None)
        raise
    return m, disk / "cache", mount_cm, disk_cm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("disk", ["full", "fills-mid-item"])
def test_streamed_misses_on_a_full_cache_disk_are_served_from_memory_and_the_breaker_stays_closed(tmp_path, backend, disk):
    """Item 4 with streaming opens: four readers of three 12 MiB items while the cache disk is
    full, or becomes full after the streams started (a 10 MiB disk: the fetches move to memory
    mid-item, with readers holding descriptors of the staging files). Every reader gets its
    bytes, the breaker stays closed, the stats name the disk, and the memory staging is given
    back."""
    items = {f"big{i}.bin": _data(12 * MiB, 10 + i) for i in range(3)}
    src = HostileSource(items, {n: Behaviour(pause_at=6 * MiB, pause_s=0.5) for n in items})
    m, cache, mount_cm, disk_cm = _full_disk_mount(tmp_path, backend, src, "--open-deadline", "5",
                                                   **({} if disk == "full" else {"size": "10m", "fill": False}))
    try:
        results: dict[str, bytes | OSError] = {}
        names = [*items, "big0.bin"]

        def reader(i: int, name: str) -> None:
            results[f"{i}:{name}"] = _read(m.mountpoint / name)

        threads = [threading.Thread(target=reader, args=(i, n)) for i, n in enumerate(names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for key, got in results.items():
            want = items[key.split(":", 1)[1]]
            assert got == want, f"{key}: {got!r}\n{m.log()}" if isinstance(got, OSError) else f"{key}: content differs"
        assert len(results) == len(names)
        s = m.fresh_stats()
        assert s["streaming_opens"] >= 3, s
        assert s["remote_breaker_state"] == "closed" and s["remote_breaker_opened_total"] == 0, s
        assert s["failed_opens"] == 0 and s["remote_errors"] == 0, s
        assert s["cache_disk_errors"] > 0 and s["memory_staged_items"] >= 3, s
        assert str(cache) in s["cache_disk_last_error"] and "ENOSPC" in s["cache_disk_last_error"], s
        assert s["memory_staging_used_bytes"] == 0, s
    finally:
        mount_cm.__exit__(None, None, None)
        disk_cm.__exit__(None, None, None)
        src.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_streamed_item_that_sends_far_more_than_listed_on_a_full_disk_keeps_the_mount_small(tmp_path, backend):
    """Item 5 with a streaming open and memory staging: a 12 MiB item that sends 1.5 GB more,
    while the cache disk is full. The reader gets EIO on its last read (never a clean end of
    file), at most size + 1 bytes are taken per try, the memory staging is given back, and the
    mount's peak RSS stays under 300 MB."""
    data = _data(12 * MiB, 20)
    src = HostileSource({"a.bin": data, "ok.bin": _data(1000, 21)},
                        {"a.bin": Behaviour(oversend=1_500_000_000, times=10**6)})
    m, _cache, mount_cm, disk_cm = _full_disk_mount(tmp_path, backend, src, "--open-deadline", "2")
    try:
        got = _read(m.mountpoint / "a.bin")
        assert isinstance(got, OSError) and got.errno == errno.EIO, got if isinstance(got, OSError) else len(got)
        assert (m.mountpoint / "ok.bin").read_bytes() == src.items["ok.bin"]
        peak = _peak_rss_kb(m.proc.pid)
        assert "more than the listing" in m.log()
        s = m.fresh_stats()
        assert s["streaming_opens"] >= 1 and s["memory_staged_items"] >= 1, s
        assert s["memory_staging_used_bytes"] == 0, s
        assert peak < RSS_LIMIT_KB, f"peak RSS {peak} kB"
        print(f"12 MiB item sending 1.5 GB more, disk full, {backend}: peak RSS {peak / 1024:.0f} MB")
        reqs = src.item_requests("a.bin")
        assert sum(r.sent for r in reqs) < len(reqs) * (len(data) + 64 * MiB), [r.sent for r in reqs]
    finally:
        mount_cm.__exit__(None, None, None)
        disk_cm.__exit__(None, None, None)
        src.close()
