"""The data path on a bad day (issue 45): slow, paused, flaky and replaced items from a real HTTP
source on 127.0.0.1 (tests/hostile_http.py), and an S3 object replaced mid-fetch (moto).

Store-level tests drive `RemoteStore.fetch` directly; the mount-level ones read through real
mounts on both front ends.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dataplane_helpers import free_port, mounted
from hostile_http import Behaviour, HostileSource, mount_and_read


@pytest.fixture(scope="module")
def moto_endpoint():
    """A real S3-compatible server (moto in server mode) on a free local port."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class _Sink:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.pieces = 0

    def write(self, data: bytes, offset: int) -> None:
        if len(self.buf) < offset + len(data):
            self.buf.extend(bytes(offset + len(data) - len(self.buf)))
        self.buf[offset:offset + len(data)] = data

    def reset(self) -> None:
        self.buf.clear()

    def piece(self) -> None:
        self.pieces += 1


class _NoWait:
    """A throttle that never waits, with a rate that makes the fetch read 64 KiB chunks."""

    rate = 1.0

    def __init__(self, before_chunk=None) -> None:
        self.calls = 0
        self._before = before_chunk

    def acquire(self, nbytes: int) -> None:
        self.calls += 1
        if self._before is not None:
            self._before(self.calls)


def _fetch(store, name: str, size: int, throttle=None, sink: _Sink | None = None):
    import zlib

    from fuse_client.remote import FileEntry

    sink = sink or _Sink()
    crc = store.fetch(FileEntry(0, name, size), sink.write, throttle or _NoWait(), lambda n: None, sink.reset,
                      **({"on_progress": sink.piece} if "on_progress" in inspect.signature(store.fetch).parameters
                         else {}))  # (so that this file also runs against older code, to show it fail)
    assert crc == zlib.crc32(bytes(sink.buf))
    return bytes(sink.buf), sink


def test_a_pause_longer_than_the_read_timeout_resumes_after_the_staged_bytes():
    """Item 3: a pause mid-transfer costs a ranged retry from the bytes already staged, not a
    restart from byte 0 (before: the staging file was truncated and the item fetched again)."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteStore

    data = _data(600_000)
    src = HostileSource({"a.bin": data}, {"a.bin": Behaviour(pause_at=400_000, pause_s=2.0, times=2)})
    try:
        store = RemoteStore(src.url, RetryPolicy(deadline_s=3.0))  # read timeout 1.5 s
        got, _ = _fetch(store, "a.bin", len(data))
        assert got == data
        reqs = src.item_requests("a.bin")
        assert [r.range for r in reqs] == [None, "bytes=400000-"], reqs
        assert reqs[1].if_range == src.etag("a.bin")
        assert sum(r.sent for r in reqs) < len(data) * 1.1  # resumed, not fetched twice
    finally:
        src.close()


def test_a_pause_shorter_than_the_deadline_is_waited_out_on_the_same_connection():
    """Timeouts scale with --open-deadline: at 10 s a 2.5 s pause is not an error (before: the
    read timeout was min(2 s, deadline / 2) whatever the deadline)."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteStore

    data = _data(300_000)
    src = HostileSource({"a.bin": data}, {"a.bin": Behaviour(pause_at=100_000, pause_s=2.5)})
    try:
        got, _ = _fetch(RemoteStore(src.url, RetryPolicy(deadline_s=10.0)), "a.bin", len(data))
        assert got == data
        assert len(src.item_requests("a.bin")) == 1
    finally:
        src.close()


def test_dropped_connections_resume_and_each_try_that_delivers_starts_the_count_again():
    """Item 6 (flaky remote): every response cut after 100 kB still gives the item, each try
    continuing where the last one stopped, although only 3 tries in a row may fail."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteStore

    data = _data(700_000)
    src = HostileSource({"a.bin": data}, {"a.bin": Behaviour(drop_every=100_000, times=100)})
    try:
        store = RemoteStore(src.url, RetryPolicy(deadline_s=5.0, attempts=3, backoff_s=0.01))
        got, _ = _fetch(store, "a.bin", len(data))
        assert got == data
        reqs = src.item_requests("a.bin")
        starts = [0] + [int(r.range[len("bytes="):-1]) for r in reqs[1:]]
        assert reqs[0].range is None and all(b > a for a, b in zip(starts, starts[1:])), [r.range for r in reqs]
        assert sum(r.sent for r in reqs) < 2 * len(data)
    finally:
        src.close()


def test_five_500s_in_a_row_are_retried_within_the_deadline():
    """Item 6 (at 30% 500s silod gave 15 EIO where rclone gave 0): tries go on while the deadline
    allows (before: 4 tries in all)."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteStore

    data = _data(50_000)
    src = HostileSource({"a.bin": data}, {"a.bin": Behaviour(fail_first=5)})
    try:
        got, _ = _fetch(RemoteStore(src.url, RetryPolicy(deadline_s=5.0)), "a.bin", len(data))
        assert got == data
        assert [r.status for r in src.item_requests("a.bin")] == [500] * 5 + [200]
    finally:
        src.close()


def test_an_http_object_replaced_mid_fetch_restarts_cleanly():
    """The resumed request carries If-Range: the server sees the object changed and sends the new
    one whole, so the staged copy is the new version, never a mix."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteStore

    old, new = _data(500_000, 1), _data(500_000, 2)
    src = HostileSource({"a.bin": old}, {"a.bin": Behaviour(replace_at=200_000, replace_with=new)})
    try:
        got, _ = _fetch(RemoteStore(src.url, RetryPolicy(deadline_s=3.0, backoff_s=0.01)), "a.bin", len(old))
        assert got == new
        reqs = src.item_requests("a.bin")
        assert reqs[1].range.startswith("bytes=") and reqs[1].range != "bytes=0-"
        assert reqs[1].status == 200  # If-Range did not match: the new object, whole
    finally:
        src.close()


class _CountingSink(_Sink):
    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1
        super().reset()


def _fetch_counting_resets(src: HostileSource, size: int) -> tuple[bytes, _CountingSink]:
    """Fetch `a.bin` of `src` through a real RemoteStore (3 s deadline, quick retries)."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteStore

    sink = _CountingSink()
    got, _ = _fetch(RemoteStore(src.url, RetryPolicy(deadline_s=3.0, backoff_s=0.01)), "a.bin", size, sink=sink)
    return got, sink


def test_a_server_without_ranges_sending_the_same_version_again_is_read_past_not_restarted():
    """A server that ignores Range cuts the connection at 200 kB; its next answer is the whole
    item again with the same ETag and Last-Modified: the staged bytes stay (no reset, which would
    fail a streamed item's readers) and the re-sent ones are read past. Before: a restart."""
    data = _data(500_000, 3)
    src = HostileSource({"a.bin": data}, {"a.bin": Behaviour(no_ranges=True, drop_at=200_000)})
    try:
        got, sink = _fetch_counting_resets(src, len(data))
        assert got == data and sink.resets == 0
        reqs = src.item_requests("a.bin")
        assert [r.status for r in reqs] == [200, 200] and reqs[1].if_range == src.etag("a.bin"), reqs
    finally:
        src.close()


@pytest.mark.parametrize("lying", [True, False], ids=["same-validators", "no-validators"])
def test_other_bytes_under_the_same_or_no_validators_restart_the_fetch_not_a_mix(lying):
    """The same server replaces the object at 200 kB but keeps answering with the old ETag and
    Last-Modified (or sends none at all): the re-sent first bytes do not match the staged ones,
    so the fetch restarts from byte 0 and stages the new version whole, never a mix."""
    old, new = _data(500_000, 4), _data(500_000, 5)
    src = HostileSource({"a.bin": old}, {"a.bin": Behaviour(no_ranges=True, replace_at=200_000, replace_with=new,
                                                            keep_validators=lying, no_validators=not lying)})
    try:
        got, sink = _fetch_counting_resets(src, len(old))
        assert got == new and sink.resets >= 1
    finally:
        src.close()


@pytest.mark.parametrize("no_ranges", [False, True], ids=["ranges", "no-ranges"])
def test_a_cut_from_a_server_without_validators_is_read_past_not_restarted(no_ranges):
    """A server that sends no ETag and no Last-Modified cuts the connection at 200 kB: a range
    could not be pinned to the staged version, so the item is asked for whole again (no Range)
    and its first 200 kB are checked against the staged ones and read past; no reset (which
    would fail a streamed item's readers). Before: a restart from byte 0."""
    data = _data(500_000, 6)
    src = HostileSource({"a.bin": data}, {"a.bin": Behaviour(no_validators=True, no_ranges=no_ranges, drop_at=200_000)})
    try:
        got, sink = _fetch_counting_resets(src, len(data))
        assert got == data and sink.resets == 0
        reqs = src.item_requests("a.bin")
        assert [(r.status, r.range, r.if_range) for r in reqs] == [(200, None, None)] * 2, reqs
    finally:
        src.close()


def test_a_source_sending_more_than_the_listing_is_cut_at_size_plus_one():
    """Item 5: at most the listing's size + 1 byte is read, whatever the source sends."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteFetchError, RemoteStore

    src = HostileSource({"a.bin": _data(1000)}, {"a.bin": Behaviour(oversend=50_000_000, times=100)})
    try:
        store = RemoteStore(src.url, RetryPolicy(deadline_s=2.0, attempts=2, backoff_s=0.01))
        with pytest.raises(RemoteFetchError, match="more than the listing"):
            _fetch(store, "a.bin", 1000)
        # The server could push a few socket buffers before the connection closed, no more.
        assert all(r.sent < 20_000_000 for r in src.item_requests("a.bin"))
    finally:
        src.close()


def test_a_trickling_item_reports_each_piece():
    """Item 2: progress per piece, not per whole item (the waiting opens' liveness)."""
    from fuse_client.breaker import RetryPolicy
    from fuse_client.remote import RemoteStore

    data = _data(6_000)
    src = HostileSource({"a.bin": data}, {"a.bin": Behaviour(trickle_rate=10_000)})
    try:
        got, sink = _fetch(RemoteStore(src.url, RetryPolicy(deadline_s=1.0)), "a.bin", len(data))
        assert got == data
        assert sink.pieces >= 3
    finally:
        src.close()


def test_an_s3_object_replaced_mid_fetch_is_never_staged_as_a_mix(moto_endpoint, monkeypatch):
    """Item 6: s3fs's file object sent one ranged GET per chunk with no version check, so an
    object overwritten between two chunks was staged half old, half new. One streaming GET reads
    one version; a resumed GET carries IfMatch."""
    import boto3

    from fuse_client.remote import RemoteStore

    for k, v in {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = f"mix-{os.getpid()}-{random.randrange(1 << 30)}"
    s3.create_bucket(Bucket=bucket)
    old, new = _data(400_000, 3), _data(400_000, 4)
    s3.put_object(Bucket=bucket, Key="ds/a.bin", Body=old)

    def overwrite(calls: int) -> None:
        if calls == 2:  # between the first and the second chunk
            s3.put_object(Bucket=bucket, Key="ds/a.bin", Body=new)

    store = RemoteStore(f"s3://{bucket}/ds")
    got, _ = _fetch(store, "a.bin", len(old), throttle=_NoWait(overwrite))
    assert got in (old, new), "staged a mix of two versions"


# -- through real mounts, both front ends --------------------------------------------------------

BACKENDS = ["libfuse", "raw"]


def _backend_args(backend: str) -> list[str]:
    if backend == "raw" and os.geteuid() != 0:
        pytest.skip("the raw front end mounts with mount(2): run as root")
    return ["--fuse-backend", backend]


def _read(path: Path) -> bytes | OSError:
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc


@pytest.mark.fuse
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slow_but_alive_item_reaches_its_reader(tmp_path, backend):
    """Item 2: an item trickling for 5 s under a 1 s deadline (stall limit 2.5 s) is read whole.
    Before: the reader got EIO after the stall limit (progress was stamped only when the whole
    item had arrived), and so did every re-open until the background fetch ended."""
    data = _data(40_000)
    src = HostileSource({"slow.bin": data, "ok.bin": _data(5_000, 1)},
                        {"slow.bin": Behaviour(trickle_rate=8_000, times=100)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "1") as m:
            t0 = time.monotonic()
            got = _read(m.mountpoint / "slow.bin")
            assert not isinstance(got, OSError), f"{got!r} after {time.monotonic() - t0:.1f} s\n{m.log()}"
            assert got == data
            assert time.monotonic() - t0 > 3.0  # it really was slower than the stall limit
    finally:
        src.close()


@pytest.mark.fuse
@pytest.mark.parametrize("backend", BACKENDS)
def test_slow_items_do_not_hold_the_fetch_workers_healthy_items_need(tmp_path, backend):
    """Item 2: with 2 fetch workers, 4 items trickling for 10 s must not make 20 healthy items wait
    (before: the healthy opens queued behind them and failed with EIO at the stall limit). The
    healthy ones must all be read while the slow ones still trickle."""
    slow = {f"slow{i}.bin": _data(40_000, 10 + i) for i in range(4)}
    healthy = {f"ok{i:02d}.bin": _data(10_000, 100 + i) for i in range(20)}
    src = HostileSource({**slow, **healthy}, {n: Behaviour(trickle_rate=4_000, times=100) for n in slow})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "2", "--fetch-workers", "2") as m:
            results: dict[str, bytes | OSError] = {}
            finished: dict[str, float] = {}

            def read_slow(name: str) -> None:
                results[name] = _read(m.mountpoint / name)
                finished[name] = time.monotonic()

            readers = [threading.Thread(target=read_slow, args=(n,)) for n in slow]
            for t in readers:
                t.start()
            time.sleep(1.5)  # the slow ones hold the fast lane by now
            for name, want in healthy.items():
                got = _read(m.mountpoint / name)
                assert got == want, f"{name}: {got!r}\n{m.log()}"
            healthy_done = time.monotonic()
            busy = m.fresh_stats()["fetch_lanes"]  # the slow ones still trickle: their buffers count
            for t in readers:
                t.join(60)
            for name, want in slow.items():
                assert results[name] == want, f"{name}: {results[name]!r}\n{m.log()}"
            assert healthy_done < min(finished.values()), "the healthy items waited for the slow ones"
            assert busy["slow_running"] + busy["fast_running"] >= 1 and busy["inflight_bytes"] > 0, busy
            lanes = m.fresh_stats()["fetch_lanes"]
            assert lanes["moved_to_slow_lane"] >= 2, lanes
            assert lanes["inflight_bytes"] == 0 and lanes["inflight_bytes_bound"] == 2 * 4 * 2**20 + 64 * 256 * 2**10
    finally:
        src.close()


@pytest.mark.fuse
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pauses_mid_transfer_cost_resumes_not_the_item(tmp_path, backend):
    """Item 3: two pauses longer than the read timeout (deadline 2 s: 1 s) in one item: the
    reader gets the item, fetched once plus the resumed rest (before: EIO)."""
    data = _data(2_000_000, 5)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(pause_at=(1_000_000, 1_500_000), pause_s=1.6, times=2)})
    with mount_and_read(tmp_path, src, "big.bin", data, [*_backend_args(backend), "--open-deadline", "2"],
                        _read):
        reqs = src.item_requests("big.bin")
        assert len(reqs) == 3 and all(r.range for r in reqs[1:]), [(r.range, r.sent) for r in reqs]
        assert sum(r.sent for r in reqs) < 1.5 * len(data)


@pytest.mark.fuse
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_cache_disk_is_a_cache_problem_not_a_remote_one(tmp_path, backend):
    """Item 4: with the cache disk full (a real tmpfs filled to its last block), misses are
    served from memory, the breaker stays closed and the stats name the disk. Before: ENOSPC on
    the staging write counted as a remote error, the breaker opened for a healthy remote and
    every miss failed."""
    from dataplane_helpers import make_dataset, read_epoch
    from full_disk import fill_to_the_last_block, tiny_tmpfs

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    ds = make_dataset(tmp_path / "src", n_files=30, min_size=40_000, max_size=60_000)
    with tiny_tmpfs(tmp_path / "disk", size="1m") as disk:
        cache = disk / "cache"
        with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache, *_backend_args(backend),
                     "--breaker-threshold", "2") as m:
            fill_to_the_last_block(disk / "filler")
            read_epoch(m.mountpoint, ds, seed=1)  # every item right, none cached
            read_epoch(m.mountpoint, ds, seed=2)
            s = m.fresh_stats()
            assert s["remote_breaker_state"] == "closed" and s["remote_breaker_opened_total"] == 0, s
            assert s["failed_opens"] == 0
            assert s["cache_disk_errors"] > 0 and s["memory_staged_items"] >= 2 * len(ds.sizes) - s["items_cached"] * 2
            assert str(cache) in s["cache_disk_last_error"] and "ENOSPC" in s["cache_disk_last_error"], s
            assert s["memory_staging_used_bytes"] == 0
            assert "the remote is not at fault" in m.log()


# -- memory: what a hostile source can make the mount hold (item 5) ------------------------------

RSS_LIMIT_KB = 300 * 1024


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _failed_mount_peak_rss(tmp_path: Path, source: str, *extra: str) -> tuple[int, str, int]:
    """Run a `silod mount` that is expected to fail; returns its exit code, output and peak RSS
    (a wrapper process waits for it and reads its children's ru_maxrss)."""
    from dataplane_helpers import force_unmount, silod_cmd

    (tmp_path / "mnt").mkdir(exist_ok=True)
    wrapper = ("import resource, subprocess, sys\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
               "sys.stdout.write(f'{p.returncode} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n' + p.stdout + p.stderr)\n")
    try:
        out = subprocess.run([sys.executable, "-c", wrapper, *silod_cmd(), "mount", str(tmp_path / "mnt"),
                              "--source", source, "--dataset", "ds", "--job", "j", "--cache-dir",
                              str(tmp_path / "cache"), *extra], capture_output=True, text=True, timeout=180).stdout
    finally:
        force_unmount(tmp_path / "mnt")  # should it have mounted after all (and been killed)
    head, _, rest = out.partition("\n")
    rc, peak = map(int, head.split())
    return rc, rest, peak


@pytest.mark.fuse
def test_an_item_that_sends_far_more_than_listed_does_not_grow_the_mount(tmp_path):
    """An item listed at 1,000 bytes that sends 1.5 GB: read up to 1,001 bytes, EIO, peak RSS
    far below the limit (before: 3.1 GB, the whole body was read into memory)."""
    src = HostileSource({"a.bin": _data(1000), "ok.bin": _data(1000, 1)},
                        {"a.bin": Behaviour(oversend=1_500_000_000, times=10**6)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", "--open-deadline", "2") as m:
            got = _read(m.mountpoint / "a.bin")
            assert isinstance(got, OSError) and got.errno == 5, got
            assert (m.mountpoint / "ok.bin").read_bytes() == src.items["ok.bin"]
            peak = _peak_rss_kb(m.proc.pid)
            assert "more than the listing" in m.log()
        assert peak < RSS_LIMIT_KB, f"peak RSS {peak} kB"
        print(f"1.5 GB item: peak RSS {peak / 1024:.0f} MB")
        assert sum(r.sent for r in src.item_requests("a.bin")) < 200_000_000
    finally:
        src.close()


def _html_flood():
    page = "".join(f'<a href="item{i:07d}.bin">item{i:07d}.bin</a>\n' for i in range(20_000)).encode()
    for _ in range(1_500_000_000 // len(page)):  # 1.5 GB, generated as it is sent
        yield page


def _json_flood(entries: int):
    def gen():
        yield b"["
        step = 10_000
        for start in range(0, entries, step):
            yield ",".join(f'{{"name":"f{i:08d}","type":"file","size":1}}'
                           for i in range(start, min(entries, start + step))).encode() + (b"," if start + step < entries else b"")
        yield b"]"
    return gen


@pytest.mark.fuse
@pytest.mark.parametrize("flood", ["html-1.5GB", "json-2M-entries", "json-entries-over-the-limit"])
def test_a_hostile_index_fails_the_mount_with_a_message_and_bounded_memory(tmp_path, flood):
    """A 1.5 GB HTML index (before: 5.3 GB of RSS) and a 2,000,000-entry JSON index (before:
    1.1 GB) are refused at --max-index-bytes; a JSON index within it but with more entries than
    --max-listing-entries is refused too. Each with one line naming the limit, exit 2, and a peak
    RSS within the limit."""
    src = HostileSource({"ok.bin": b"x"})
    extra: list[str] = []
    if flood == "html-1.5GB":
        src.index_stream, src.index_type = _html_flood, "text/html"
        limit = "is larger than 33554432 bytes (--max-index-bytes)"
    elif flood == "json-2M-entries":
        src.index_stream = _json_flood(2_000_000)
        limit = "is larger than 33554432 bytes (--max-index-bytes)"
    else:
        src.index_stream = _json_flood(300_000)  # 12 MB: within the page limit
        extra = ["--max-listing-entries", "100000"]
        limit = "lists more entries than --max-listing-entries allows"
    try:
        rc, out, peak = _failed_mount_peak_rss(tmp_path, src.url, *extra)
    finally:
        src.close()
    assert rc == 2 and limit in " ".join(out.split()), out
    assert peak < RSS_LIMIT_KB, f"peak RSS {peak} kB"
    print(f"{flood}: peak RSS {peak / 1024:.0f} MB")


class _TreeSource:
    """A real HTTP source on 127.0.0.1 with nginx's JSON indexes for `dirs` directories of `files`
    items each, generated as they are sent (the test process never holds the listing); every item
    is one byte. `name_len` pads the item names (a source choosing long names)."""

    def __init__(self, dirs: int, files: int, name_len: int = 9) -> None:
        import http.server

        outer = self
        self.dirs, self.files, self.name_len = dirs, files, name_len

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                parts = self.path.split("/")  # ['', 'ds', 'd0001', 'f...'] or ['', 'ds', 'd0001', '']
                if self.path == "/ds/":
                    self._send(b"[" + ",".join(f'{{"name":"d{d:04d}","type":"directory"}}'
                                                for d in range(outer.dirs)).encode() + b"]")
                elif len(parts) == 4 and parts[3] == "":
                    self._stream(outer._page)
                elif len(parts) == 4:
                    self._send(b"x", "application/octet-stream")
                else:
                    self.send_error(404)

            def _send(self, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream(self, gen) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for piece in gen():
                        self.wfile.write(piece)
                except OSError:
                    pass
                self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ds/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def name(self, i: int) -> str:
        return f"f{i:08d}".ljust(self.name_len, "n")

    def _page(self):
        yield b"["
        step = 5_000
        for start in range(0, self.files, step):
            end = min(self.files, start + step)
            yield ",".join(f'{{"name":"{self.name(i)}","type":"file","size":1}}'
                           for i in range(start, end)).encode() + (b"," if end < self.files else b"")
        yield b"]"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.fuse
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_listing_at_the_default_entry_cap_mounts_within_the_memory_limit(tmp_path, backend):
    """A JSON index of 149 directories of 10,000 items (1,490,149 entries: the most the default
    --max-listing-entries allows) mounts and serves with a peak RSS within the limit. Before: the
    listing cost ~0.4 KB per item (a dict of path -> NamedTuple, child-name lists, the raw front
    end's list of entries), ~650 MB here."""
    src = _TreeSource(149, 10_000)
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     timeout=240) as m:
            assert (m.mountpoint / "d0148" / src.name(9_999)).read_bytes() == b"x"
            assert len(os.listdir(m.mountpoint / "d0007")) == 10_000
            assert os.listdir(m.mountpoint)[:2] == ["d0000", "d0001"]
            assert m.fresh_stats(10)["items_total"] == 1_490_000
            peak = _peak_rss_kb(m.proc.pid)
        assert peak < RSS_LIMIT_KB, f"peak RSS {peak} kB"
        print(f"1,490,149 entries ({backend}): peak RSS {peak / 1024:.0f} MB")
    finally:
        src.close()


@pytest.mark.fuse
def test_long_names_are_capped_by_the_listing_bytes_limit(tmp_path):
    """1,400,000 items of 200-byte names, within both per-page and entry caps (280 MB of names;
    before: about 0.9 GB of RSS), are refused at --max-listing-bytes (64MiB) with one line naming
    the limit, exit 2, and a peak RSS within the limit."""
    src = _TreeSource(14, 100_000, name_len=200)
    try:
        rc, out, peak = _failed_mount_peak_rss(tmp_path, src.url)
    finally:
        src.close()
    assert rc == 2 and "(--max-listing-bytes)" in " ".join(out.split()), out
    assert peak < RSS_LIMIT_KB, f"peak RSS {peak} kB"
    print(f"long names: peak RSS {peak / 1024:.0f} MB")


def test_directory_paths_count_toward_the_listing_bytes(tmp_path):
    """A file in a directory of its own doubles the listing's path bytes (the directory column
    holds the prefix again): --max-listing-bytes caps both together, so no choice of layout
    takes the listing past it."""
    from estimator.errors import UserError
    from fuse_client.remote import ListingLimits, RemoteStore

    for i in range(5):
        (tmp_path / f"dir{i:010d}").mkdir()
        (tmp_path / f"dir{i:010d}" / "f").write_bytes(b"x")  # 15 bytes of file path, 13 of directory
    with pytest.raises(UserError, match=r"more than 100 bytes in all \(--max-listing-bytes\)"):
        RemoteStore(str(tmp_path), limits=ListingLimits(max_listing_bytes=100)).list()
    assert len(RemoteStore(str(tmp_path), limits=ListingLimits(max_listing_bytes=140)).list().files) == 5


def test_an_s3_listing_stops_asking_at_the_entry_cap(moto_endpoint, monkeypatch):
    """1,050 keys with --max-listing-entries 100: the listing fails after the first page of
    ListObjectsV2 (1,000 keys). Before: s3fs listed both pages into memory twice (fs.isdir
    lists the whole prefix too), then the cap was checked (so a bucket of millions of keys was held whole first). Requests are counted
    with botocore's own event hook on the real client."""
    import boto3
    from fsspec.asyn import sync

    from estimator.errors import UserError
    from fuse_client.remote import ListingLimits, RemoteStore

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket="many")
    for i in range(1_050):
        s3.put_object(Bucket="many", Key=f"ds/k{i:05d}", Body=b"x")
    store = RemoteStore("s3://many/ds", limits=ListingLimits(max_entries=100))
    sync(store.fs.loop, store.fs.set_session)
    pages: list[dict] = []
    store.fs.s3.meta.events.register("before-call.s3.ListObjectsV2", lambda params, **kw: pages.append(params))
    with pytest.raises(UserError, match="--max-listing-entries"):
        store.list()
    assert len(pages) == 1 and "continuation-token" not in pages[0]["query_string"], pages
    assert sorted(RemoteStore("s3://many/ds", limits=ListingLimits(max_entries=3_000)).list().files)[-1] == "k01049"


@pytest.mark.fuse
def test_an_html_index_of_millions_of_directory_links_is_refused_in_bounded_memory(tmp_path):
    """A 32 MB HTML page of ~2.3M short directory links (within --max-index-bytes): the listing
    stops at --max-listing-entries with a message, exit 2, peak RSS within the limit. Before: every
    link was kept as an absolute URL, twice (a list and a dict), with the page: about 0.6 GB."""
    def flood():
        sent, j = 0, 0
        while True:
            line = "".join(f'<a href="{j:x}.{i:x}/">' for i in range(4096)).encode()
            if sent + len(line) > 32 * 1024 * 1024:
                return
            sent += len(line)
            j += 1
            yield line

    src = HostileSource({"ok.bin": b"x"})
    src.index_stream, src.index_type = flood, "text/html"
    try:
        rc, out, peak = _failed_mount_peak_rss(tmp_path, src.url)
    finally:
        src.close()
    assert rc == 2 and "--max-listing-entries" in out, out
    assert peak < RSS_LIMIT_KB, f"peak RSS {peak} kB"
    print(f"html directory links: peak RSS {peak / 1024:.0f} MB")


@pytest.mark.fuse
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fetch_pools_in_flight_bytes_are_bounded_by_configuration(tmp_path, backend):
    """Build item 5: --max-inflight-bytes bounds the fetched data the pool holds in memory at once.
    16 readers open 16 uncached 300 KB items and 2 items of 3 MB on 8 fetch workers under a
    1 MiB bound: every item arrives whole, and the pool never held more than the bound (a chunk
    waits for room before it is read; the 3 MB items are read in chunks of at most the bound).
    Before: the bytes were counted but bounded only by workers x 4 MiB (no such option)."""
    from dataplane_helpers import make_dataset

    ds = make_dataset(tmp_path / "src", n_files=16, min_size=290_000, max_size=310_000, subdirs=2)
    for name in ("big0.bin", "big1.bin"):
        data = _data(3_000_000, len(name))
        (ds.root / name).write_bytes(data)
        ds.sizes[name], ds.digests[name] = len(data), hashlib.sha256(data).hexdigest()
    bound = 1 << 20
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                 "--fetch-workers", "8", "--max-inflight-bytes", "1MiB") as m:
        errors: list[str] = []

        def reader(name: str) -> None:
            data = (m.mountpoint / name).read_bytes()
            if hashlib.sha256(data).hexdigest() != ds.digests[name]:
                errors.append(name)

        threads = [threading.Thread(target=reader, args=(n,)) for n in ds.sizes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        lanes = m.fresh_stats()["fetch_lanes"]
    assert lanes["inflight_bytes_bound"] == bound and lanes["inflight_bytes"] == 0, lanes
    assert 0 < lanes["inflight_bytes_peak"] <= bound + 1, lanes  # + 1: a whole item is read as size + 1


# -- smaller ones (item 6) -----------------------------------------------------------------------


@pytest.mark.fuse
def test_a_listing_request_that_fails_twice_is_retried_and_a_new_cache_is_not_a_recovery(tmp_path):
    """Two 500s on the index do not fail the mount (before: 1% of 500s made 2 of 10 mounts
    exit), and the first mount of a brand-new cache does not log "not unmounted cleanly"."""
    src = HostileSource({"a.bin": _data(3000)})
    src.index_failures = 2
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache") as m:
            assert (m.mountpoint / "a.bin").read_bytes() == src.items["a.bin"]
            assert [r.status for r in src.requests if r.path == "/ds/"] == [500, 500, 200]
            assert "not unmounted cleanly" not in m.log(), m.log()
    finally:
        src.close()


# -- many loader workers on a throttled job (item 1) --------------------------------------------


@pytest.mark.fuse
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opens", ["whole", "streaming"])
def test_128_loader_workers_on_a_throttled_job_get_no_eagain(tmp_path, backend, opens):
    """128 readers open uncached items at once on a 20 MB/s allocation: every open waits its turn
    (in arrival order) and none fails. Before: under libfuse at most 96 opens could wait and the
    rest got EAGAIN at once (1,869 of 2,000 in the issue's run); the raw server lost a few to
    token races (a waiter that lost every race overran its bound). "streaming": the same with
    every miss a streaming open (64 KiB chunks, --stream-min-size 64KiB), whose reads, not opens,
    wait for the tokens (under libfuse each waiting read holds a worker thread)."""
    from dataplane_helpers import make_dataset

    ds = make_dataset(tmp_path / "src", n_files=256, min_size=140_000, max_size=160_000, subdirs=8)
    names = sorted(ds.sizes)
    stream = ["--stream-min-size", "64KiB", "--max-inflight-bytes", "64KiB"] if opens == "streaming" else []
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                 "--io-rate", "20MB/s", *stream) as m:
        errors: list[str] = []
        barrier = threading.Barrier(128)

        def reader(i: int) -> None:
            barrier.wait()
            for name in names[i::128]:
                try:
                    data = (m.mountpoint / name).read_bytes()
                except OSError as exc:
                    errors.append(f"{name}: {exc!r}")
                    continue
                if hashlib.sha256(data).hexdigest() != ds.digests[name]:
                    errors.append(f"{name}: content differs")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(128)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, f"{len(errors)} failed opens, e.g. {errors[:3]}\n{m.log()[-2000:]}"
        if opens == "streaming":
            # (an open that comes after its fetch ended is an ordinary one)
            assert m.fresh_stats()["streaming_opens"] >= len(names) // 2, m.fresh_stats()
