"""Large misses are read while they are fetched (issue 45, Build item 7: cold large files).

A real HTTP source on 127.0.0.1 (tests/hostile_http.py) holds back part of a 12 MiB item; the
reader, through a real mount on each front end, must get its first bytes before the item's last
byte has left the server. And the guarantees of a whole fetch stay: an object replaced after a
reader got bytes of it is a clear EIO (never bytes of two versions), a source that sends more
than the listing says fails the read of the last bytes (never a clean end of file), and small
items are still fetched whole before their open returns.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest

from dataplane_helpers import mounted, wait_until
from hostile_http import Behaviour, HostileSource

pytestmark = pytest.mark.fuse

MiB = 1 << 20
SIZE = 12 * MiB  # over the 8 MiB from which misses stream (dataplane.DEFAULT_STREAM_MIN_BYTES)


def _data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _backend_args(backend: str) -> list[str]:
    if backend.startswith("raw") and os.geteuid() != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("the raw front end mounts with mount(2): run as root")
        pytest.skip("the raw front end mounts with mount(2): run as root")
    return {"libfuse": ["--fuse-backend", "libfuse"],
            "raw": ["--fuse-backend", "raw"],  # passthrough where the kernel has it: direct I/O
            "raw-nopassthrough": ["--fuse-backend", "raw", "--no-passthrough"]}[backend]


BACKENDS = ["libfuse", "raw", "raw-nopassthrough"]


def _read_all(f) -> bytes:
    out = bytearray()
    while chunk := f.read(MiB):
        out += chunk
    return bytes(out)


def _read_to_error(path, version: bytes, code: int, first_mib: bool = False) -> bytes:
    """Read `path` in 1 MiB reads until one fails, which must fail with `code`; every byte read
    must be `version`'s (with `first_mib`, the first read must be its first MiB). The bytes read."""
    got = bytearray()
    with open(path, "rb", buffering=0) as f:
        got += f.read(MiB)
        if first_mib:
            assert bytes(got) == version[:MiB], "the first bytes are not version 1's"
        with pytest.raises(OSError) as err:
            while chunk := f.read(MiB):
                got += chunk
    assert err.value.errno == code, err.value
    assert bytes(got) == version[:len(got)], "bytes of two versions reached the reader"
    return bytes(got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_miss_is_read_before_its_last_byte_leaves_the_server(tmp_path, backend):
    """The server stops for 4 s after 6 MiB. Before: the open returned only once the fetch had
    the whole item, so the first read came after the server had sent every byte."""
    data = _data(SIZE, 1)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(pause_at=6 * MiB, pause_s=4.0)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "10") as m:
            with open(m.mountpoint / "big.bin", "rb", buffering=0) as f:
                first = f.read(MiB)
                sent = sum(r.sent for r in src.item_requests("big.bin"))
                assert first == data[:MiB]
                assert sent < SIZE, f"the first read came after all {sent} bytes were sent\n{m.log()}"
                rest = _read_all(f)
            assert first + rest == data
            s = m.fresh_stats()
            assert s["streaming_opens"] == 1, s
            # Fetched once, admitted whole: the next open is a hit with the same bytes.
            assert (m.mountpoint / "big.bin").read_bytes() == data
            assert len(src.item_requests("big.bin")) == 1
    finally:
        src.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_readers_of_one_large_miss_share_its_fetch_while_it_runs(tmp_path, backend):
    """Three readers open the item during the pause: each gets its first bytes before the tail
    leaves the server, all from the one fetch."""
    data = _data(SIZE, 2)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(pause_at=6 * MiB, pause_s=4.0)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "10") as m:
            early: list[bool] = []
            results: list[bytes] = []

            def reader() -> None:
                with open(m.mountpoint / "big.bin", "rb", buffering=0) as f:
                    first = f.read(MiB)
                    early.append(sum(r.sent for r in src.item_requests("big.bin")) < SIZE)
                    results.append(first + _read_all(f))

            threads = [threading.Thread(target=reader) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert results == [data] * 3, m.log()
            assert early == [True] * 3
            assert len(src.item_requests("big.bin")) == 1
    finally:
        src.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_object_replaced_after_a_reader_got_bytes_of_it_is_an_eio_not_a_mix(tmp_path, backend):
    """The server pauses at 4 MiB (the reader gets its first MiB of version 1 meanwhile), then
    replaces the object at 6 MiB and cuts the connection; the resumed request's If-Range no
    longer matches, so the fetch restarts on version 2. The reader that holds version-1 bytes
    gets EIO and a log line, never version-2 bytes; the next open reads version 2 whole. Before:
    the open returned after the restart, and the reader got version 2 only."""
    v1, v2 = _data(SIZE, 3), _data(SIZE, 4)
    src = HostileSource({"big.bin": v1}, {"big.bin": Behaviour(pause_at=4 * MiB, pause_s=3.0,
                                                               replace_at=6 * MiB, replace_with=v2)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "10") as m:
            got = _read_to_error(m.mountpoint / "big.bin", v1, errno.EIO, first_mib=True)
            assert len(got) < SIZE
            wait_until(lambda: "changed on the remote while it was read" in m.log(), 10, message="the log line")
            # Version 2 cached first: the next open is then a hit, which the kernel may serve from
            # its page cache, where version 1's first pages are (a mix, before they were dropped).
            wait_until(lambda: m.stats().get("cached_bytes", 0) >= SIZE, 30, message="version 2 cached")
            again = (m.mountpoint / "big.bin").read_bytes()
            same = again == v2  # not in the assert: pytest's diff of two 32 MiB strings takes minutes
            assert same, (f"the next open read {len(again)} of {SIZE} bytes;"
                          f" {sum(again[i:i + 4096] == v1[i:i + 4096] for i in range(0, len(again), 4096))} pages of version 1")
            reqs = src.item_requests("big.bin")
            assert reqs[1].if_range is not None and reqs[1].status == 200, [(r.range, r.status) for r in reqs]
    finally:
        src.close()


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_a_cut_from_a_server_without_ranges_is_invisible_to_a_reader_of_the_same_version(tmp_path, backend):
    """The server ignores Range (every answer is the whole item, 200) and cuts the connection at
    6 MiB after the reader got its first MiB. The fetch's next answer starts at byte 0 again, but
    with the same ETag and Last-Modified: the object did not change, so the reader keeps reading
    and gets the item whole (the re-sent first 6 MiB are checked against the staged ones, not
    staged again). Before: the restart from byte 0 failed the reader with EIO."""
    data = _data(SIZE, 11)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(no_ranges=True, pause_at=4 * MiB, pause_s=3.0,
                                                                 drop_at=6 * MiB)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "10") as m:
            reqs = _read_through_a_cut(m, src, data)
            assert [r.status for r in reqs] == [200, 200], [(r.range, r.status, r.sent) for r in reqs]
            assert reqs[1].range is not None, "the retry did not even ask for a range"
    finally:
        src.close()


def _read_through_a_cut(m, src: HostileSource, data: bytes) -> list:
    """Read big.bin, whose answer is cut: the first MiB before the server sent every byte, then
    the rest, which must make the item whole, with no "changed" log line; the next open reads it
    whole (admitted: no more requests). The item's requests."""
    with open(m.mountpoint / "big.bin", "rb", buffering=0) as f:
        first = f.read(MiB)
        assert sum(r.sent for r in src.item_requests("big.bin")) < SIZE
        rest = _read_all(f)
    whole = first + rest == data  # not in the assert: pytest's diff of two 12 MiB strings is slow
    assert whole, f"read {len(first) + len(rest)} of {SIZE} bytes\n{m.log()}"
    reqs = src.item_requests("big.bin")
    assert "changed on the remote" not in m.log()
    assert (m.mountpoint / "big.bin").read_bytes() == data  # admitted whole
    assert len(src.item_requests("big.bin")) == 2
    return reqs


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
@pytest.mark.parametrize("validators", ["new", "same", "none"],
                         ids=["new-validators", "same-validators-other-bytes", "no-validators"])
def test_a_server_without_ranges_that_replaces_the_object_still_fails_its_reader(tmp_path, backend, validators):
    """The same server, but the object is replaced at 6 MiB: with a new ETag and date the
    restart is a new version (EIO, as before); a server that keeps the old ETag and date for
    the new bytes, or sends none at all, is caught by the re-sent bytes not matching the staged
    ones (EIO too). Never bytes of two versions."""
    v1, v2 = _data(SIZE, 12), _data(SIZE, 13)
    src = HostileSource({"big.bin": v1}, {"big.bin": Behaviour(no_ranges=True, pause_at=4 * MiB, pause_s=3.0,
                                                               replace_at=6 * MiB, replace_with=v2,
                                                               keep_validators=validators == "same",
                                                               no_validators=validators == "none")})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "10") as m:
            _read_to_error(m.mountpoint / "big.bin", v1, errno.EIO)
            wait_until(lambda: "changed on the remote while it was read" in m.log(), 10, message="the log line")
            if validators == "same":
                assert "with the same validator but other bytes" in m.log()
            if validators == "none":
                assert "without a validator but other bytes" in m.log()
    finally:
        src.close()


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
@pytest.mark.parametrize("no_ranges", [False, True], ids=["ranges", "no-ranges"])
def test_a_cut_from_a_server_without_validators_is_invisible_to_a_reader_of_the_same_bytes(tmp_path, backend,
                                                                                           no_ranges):
    """The server sends no ETag and no Last-Modified and cuts the connection at 6 MiB after the
    reader got its first MiB. A range could not be pinned to the staged version, so the fetch
    asks for the item whole again (no Range) and checks its first 6 MiB against the staged ones:
    they match, so the reader keeps reading and gets the item whole. Before: the restart from
    byte 0 failed the reader with EIO (rclone resumes with a plain range and gets 0 EIO here)."""
    data = _data(SIZE, 14)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(no_validators=True, no_ranges=no_ranges,
                                                                 pause_at=4 * MiB, pause_s=3.0, drop_at=6 * MiB)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "10") as m:
            reqs = _read_through_a_cut(m, src, data)
            assert [(r.status, r.range) for r in reqs] == [(200, None)] * 2, [(r.range, r.status, r.sent) for r in reqs]
    finally:
        src.close()


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_a_job_paused_mid_stream_fails_its_reads_with_eio_never_a_short_read(tmp_path, backend):
    """The data manager pauses the job (rate 0) while two readers are inside a streamed item.
    Once the pause is older than the open deadline (1 s) - the bound an open of a miss has - the
    reads waiting for the next bytes fail, with EIO: an open gets EAGAIN, but a read must not,
    as Python (like any read(2) caller ready for non-blocking files) takes EAGAIN for "no data
    yet": the unbuffered read returns None and the buffered read() the bytes so far, a sample
    cut short with no error. So the buffered reader gets an OSError, not part of the item; a log
    line names the pause as the cause, the pause itself is logged once, a whole open of a miss in
    the same state gets EAGAIN, and once a rate is granted the item opened again reads whole."""
    from datamanager.client import DataManagerClient
    from dataplane_helpers import start_datamanager

    data, small = _data(2 * SIZE, 17), _data(100_000, 18)
    src = HostileSource({"big.bin": data, "small.bin": small})
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as sched, \
                mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                        "--manager", dm.url, "--open-deadline", "1") as m:
            sched.allocate_remote_io("job1", 2e6)  # 24 MiB take 12 s: the pause comes mid-item
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 2e6, 3.0, message="rate pulled")
            with open(m.mountpoint / "big.bin", "rb", buffering=0) as f, open(m.mountpoint / "big.bin", "rb") as buffered:
                got = bytearray(f.read(MiB))
                sched.allocate_remote_io("job1", 0)
                wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 0, 3.0, message="pause pulled")
                paused = time.monotonic()
                with pytest.raises(OSError) as err:
                    while chunk := f.read(MiB):
                        got += chunk
                    raise AssertionError(f"the read ended with {chunk!r} after {len(got)} of {len(data)} bytes, no error")
                assert err.value.errno == errno.EIO, err.value
                assert time.monotonic() - paused < 4.0  # the deadline from the pause, plus slack
                assert len(got) < len(data) and bytes(got) == data[:len(got)], "other bytes reached the reader"
                with pytest.raises(OSError) as whole_read:
                    cut = buffered.read()
                    raise AssertionError(f"a buffered read() returned {len(cut)} of {len(data)} bytes, no error")
                assert whole_read.value.errno == errno.EIO, whole_read.value
            wait_until(lambda: "stopped on the job's token wait" in m.log(), 5, message="the log line naming the pause")
            # A whole open of a miss in the same state: EAGAIN (open(2) has no "no data yet").
            with pytest.raises(OSError) as opened:
                (m.mountpoint / "small.bin").read_bytes()
            assert opened.value.errno == errno.EAGAIN, opened.value
            assert m.log().count("remote IO paused (rate 0)") == 1, m.log()
            sched.allocate_remote_io("job1", 50e6)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 50e6, 3.0, message="rate pulled again")
            whole = (m.mountpoint / "big.bin").read_bytes() == data
            assert whole, "the item opened again after the pause is not whole"
            assert (m.mountpoint / "small.bin").read_bytes() == small
    finally:
        dm.kill()
        src.close()


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_a_source_sending_more_than_listed_fails_the_last_read_not_a_clean_eof(tmp_path, backend):
    """Every byte the listing promises arrives, then more: the reader must not see a clean end
    of file on an item the fetch rejects (size + 1 cap); the read with the last byte waits for
    the fetch's verdict and gets EIO."""
    data = _data(SIZE, 5)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(oversend=MiB, times=100)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "3") as m:
            got = bytearray()
            with pytest.raises(OSError) as err:
                with open(m.mountpoint / "big.bin", "rb", buffering=0) as f:
                    while chunk := f.read(MiB):
                        got += chunk
            assert err.value.errno == errno.EIO, err.value
            assert len(got) < SIZE and bytes(got) == data[:len(got)]
            assert "sends more than the listing" in m.log()
    finally:
        src.close()


def test_a_small_miss_is_still_fetched_whole_before_its_open_returns(tmp_path):
    """Below 8 MiB nothing changes: the open returns after the last byte (a daemon open)."""
    data = _data(2 * MiB, 6)
    src = HostileSource({"small.bin": data}, {"small.bin": Behaviour(pause_at=MiB, pause_s=1.5)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", "--fuse-backend", "libfuse",
                     "--open-deadline", "10") as m:
            with open(m.mountpoint / "small.bin", "rb", buffering=0) as f:
                assert sum(r.sent for r in src.item_requests("small.bin")) == len(data)
                assert _read_all(f) == data
            s = m.fresh_stats()
            assert s["streaming_opens"] == 0 and s["daemon_opens"] == 1, s
    finally:
        src.close()


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
@pytest.mark.parametrize("option, size, streamed", [("off", SIZE, False), ("5MiB", 6 * MiB, True)],
                         ids=["off", "5MiB"])
def test_the_streaming_threshold_is_the_stream_min_size_option(tmp_path, backend, option, size, streamed):
    """--stream-min-size off: a 12 MiB miss opens only after its last byte (as below 8 MiB);
    --stream-min-size 5MiB: a 6 MiB miss is read while it arrives (an item of one 4 MiB chunk is
    fetched by one request either way). The server holds the bytes after 5 MiB for 2 s, so when the
    open returned tells which."""
    data = _data(size, 14)
    src = HostileSource({"item.bin": data}, {"item.bin": Behaviour(pause_at=5 * MiB, pause_s=2.0)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "10", "--stream-min-size", option) as m:
            with open(m.mountpoint / "item.bin", "rb", buffering=0) as f:
                sent = sum(r.sent for r in src.item_requests("item.bin"))
                got = _read_all(f)
            assert got == data
            assert (sent < size) is streamed, f"{sent} of {size} bytes had left the server at the open"
            assert m.fresh_stats()["streaming_opens"] == int(streamed)
    finally:
        src.close()


def test_the_mount_default_threshold_is_the_data_paths():
    from fuse_client.dataplane import DEFAULT_STREAM_MIN_BYTES
    from fuse_client.mount import MountConfig, parse_stream_min

    assert MountConfig.stream_min_bytes == DEFAULT_STREAM_MIN_BYTES == parse_stream_min("8MiB")
    assert parse_stream_min(" OFF ") is None


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_a_reader_killed_while_its_read_waits_for_held_bytes_exits_at_once(tmp_path, backend):
    """The server holds the item after 2 MiB for 8 s; a reader killed while its read waits for
    the held bytes exits at once (its READ is answered with EINTR, not after the bytes come:
    the kernel waits uninterruptibly for a READ the mount has taken), and the mount goes on:
    the next reader gets the item whole."""
    import subprocess
    import sys

    data = _data(SIZE, 7)
    src = HostileSource({"big.bin": data}, {"big.bin": Behaviour(pause_at=2 * MiB, pause_s=8.0)})
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *_backend_args(backend),
                     "--open-deadline", "20") as m:
            path = m.mountpoint / "big.bin"
            child = subprocess.Popen([sys.executable, "-c", f"open({str(path)!r}, 'rb', buffering=0).read()"])
            wait_until(lambda: src.item_requests("big.bin") and src.item_requests("big.bin")[0].sent >= 2 * MiB, 10)
            time.sleep(1.0)  # its read waits for the held bytes by now
            t0 = time.monotonic()
            child.kill()
            assert child.wait(20) == -9
            assert time.monotonic() - t0 < 4.0, "the killed reader waited for the held bytes"
            assert sum(r.sent for r in src.item_requests("big.bin")) < SIZE  # the server still holds them
            assert path.read_bytes() == data
    finally:
        src.close()


def test_the_staging_file_is_written_in_slices_not_whole_chunks(tmp_path, monkeypatch):
    """A 4 MiB pwrite into a fresh staging file makes the page cache allocate large folios,
    which cost 5-10x the system time of 256 KiB writes on the test VM (the cold large-file
    benchmark's main cost). Before: one pwrite per fetched chunk (4 MiB). In-process: the
    resolver over a real local source and cache, with os.pwrite counted."""
    from fuse_client import dataplane
    from fuse_client.accounting import JobAccounting
    from fuse_client.cache_store import DatasetCache
    from fuse_client.remote import RemoteStore
    from fuse_client.token_bucket import Throttle

    src = tmp_path / "src"
    src.mkdir()
    data = _data(SIZE, 8)
    (src / "big.bin").write_bytes(data)
    store = RemoteStore(str(src))
    listing = store.list()
    resolver = dataplane.ItemResolver(store, DatasetCache(tmp_path / "cache", "ds"), Throttle(float("inf")),
                                      JobAccounting(len(listing.files)))
    sizes: list[int] = []
    real = os.pwrite

    def counted(fd, buf, offset):
        sizes.append(len(buf))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", counted)
    try:
        item = resolver.resolve(listing.files["big.bin"])
        fd = item.fd if item.stream is None else item.stream.span(0, SIZE)
        assert os.pread(fd, SIZE, 0) == data
    finally:
        monkeypatch.undo()
        if item.stream is not None:
            item.stream.release()
        else:
            os.close(item.fd)
        resolver.close()
    assert sizes and max(sizes) <= dataplane.STAGING_WRITE_BYTES == 256 * 1024, max(sizes)
    assert sum(sizes) == SIZE
