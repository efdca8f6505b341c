"""Every byte through the daemon path is right (issue 19, part 1).

The raw server without passthrough (and any open whose backing registration fails) answers
READs itself. Its reply buffer was exactly the granted max read (1 MiB), so a full-size READ got
a reply 16 bytes short, which the kernel takes as end of file: the file silently shrank for every
reader. Full-size READs only come with a large readahead, so these tests raise the mount's
read_ahead_kb and drop the page cache first, then read with 128 KiB, 1 MiB and larger buffers and
compare checksums with the source. Both front ends (raw without passthrough, libfuse) are read.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
from pathlib import Path

import pytest

from dataplane_helpers import make_dataset, mounted

pytestmark = pytest.mark.fuse

MiB = 1 << 20


def _require(condition: bool, why: str) -> None:
    if condition:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def _set_read_ahead(mountpoint: Path, kb: int) -> None:
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    path.write_text(str(kb))
    assert int(path.read_text()) == kb


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def _digest(path: Path, chunk: int) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            data = f.read(chunk)
            if not data:
                break
            n += len(data)
            h.update(data)
    return n, h.hexdigest()


BACKENDS = {
    "raw-nopassthrough": ("--fuse-backend", "raw", "--no-passthrough"),
    "libfuse": ("--fuse-backend", "libfuse"),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_large_daemon_reads_return_every_byte_with_raised_readahead(tmp_path, backend):
    _require(os.geteuid() == 0, "raising read_ahead_kb and dropping caches need root")
    # Items of 4-9 MiB: each is read by several full-size (1 MiB) READs per open.
    ds = make_dataset(tmp_path / "remote", n_files=6, min_size=4 * MiB + 1, max_size=9 * MiB, seed=19, subdirs=2)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", *BACKENDS[backend],
                 "--no-kernel-cache") as m:
        for read_ahead_kb in (1024, 4096):
            _set_read_ahead(m.mountpoint, read_ahead_kb)
            for chunk in (128 * 1024, MiB, 4 * MiB):
                _drop_caches()
                for rel in sorted(ds.sizes):  # the first round fetches (misses), later ones hit
                    n, digest = _digest(m.mountpoint / rel, chunk)
                    assert n == ds.sizes[rel], (backend, read_ahead_kb, chunk, rel, n)
                    assert digest == ds.digests[rel], (backend, read_ahead_kb, chunk, rel)
                    assert os.stat(m.mountpoint / rel).st_size == ds.sizes[rel]  # the inode did not shrink
        s = m.fresh_stats()
        assert s.get("passthrough_opens", 0) == 0  # every byte above came through the daemon


# -- the protocol, without a kernel ------------------------------------------------------------


class _FakeOps:
    """What RawFuseServer needs of DatasetOperations to answer READs of one local file."""

    attribution = None
    hits_may_block = False

    def __init__(self, path: Path, size: int) -> None:
        from fuse_client.remote import DatasetListing

        self.listing = DatasetListing.from_sizes({"item.bin": size})
        self.mtime_ns = 0
        self.size = size
        self.fd = os.open(path, os.O_RDONLY)

    def read_ready(self, fh: int, size: int, offset: int) -> bool:
        return True  # a complete local file: no read waits

    def read_span(self, fh: int, size: int, offset: int) -> tuple[int, int]:
        return self.fd, max(0, min(size, self.size - offset))


def _request(p, opcode: int, unique: int, nodeid: int, body: bytes) -> bytes:
    return p.IN_HEADER.pack(p.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 0, 0, 0) + body


def test_every_read_reply_is_as_long_as_the_request_allows(tmp_path):
    """A fake kernel on a SOCK_SEQPACKET pair (one message per request and reply, like
    /dev/fuse): INIT, then READs up to the granted maximum; each reply must carry exactly
    min(size, bytes left) bytes, and the right ones."""
    _require(os.geteuid() == 0, "SO_SNDBUFFORCE (a reply of the granted max read in one message) needs root")
    from fuse_client.rawfuse import protocol as p
    from fuse_client.rawfuse.server import RawFuseServer

    size = 3 * MiB + 12345
    data = os.urandom(size)
    (tmp_path / "item.bin").write_bytes(data)
    ops = _FakeOps(tmp_path / "item.bin", size)
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
    for s in (kernel, daemon):
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 * MiB)
    server = RawFuseServer(ops, tmp_path, "test", passthrough=False)  # type: ignore[arg-type]
    server._fd = daemon.fileno()
    init_in = p.INIT_IN.pack(7, 40, 1 << 20, p.ASYNC_READ | p.MAX_PAGES | p.INIT_EXT, 0) + bytes(44)
    kernel.send(_request(p, p.INIT, 1, 0, init_in))
    server._handshake()
    reply = kernel.recv(4096)
    length, error, unique = p.OUT_HEADER.unpack_from(reply)
    assert (error, unique, length) == (0, 1, 16 + p.INIT_OUT.size)
    max_pages = p.INIT_OUT.unpack_from(reply, 16)[8]
    max_read = max_pages * 4096
    assert max_read >= MiB
    thread = threading.Thread(target=server._loop, args=(daemon.fileno(),), daemon=True)
    thread.start()
    nodeid = server.inodes.file_base
    cases = [(0, 4096), (0, 128 * 1024), (0, MiB), (0, max_read), (4096, max_read), (MiB + 7, max_read),
             (size - 100, max_read), (size - max_read, max_read), (size, max_read), (size + 4096, 4096)]
    try:
        for i, (offset, want) in enumerate(cases, start=10):
            kernel.send(_request(p, p.READ, i, nodeid, p.READ_IN.pack(1, offset, want, 0, 0, 0, 0)))
            reply = kernel.recv(max_read + 4096)
            length, error, unique = p.OUT_HEADER.unpack_from(reply)
            expect = max(0, min(want, size - offset))
            assert (unique, error) == (i, 0)
            assert length == len(reply) == 16 + expect, (offset, want, length)
            assert reply[16:] == data[offset:offset + expect]
        kernel.send(_request(p, p.DESTROY, 99, 0, b""))
        thread.join(5)
        assert not thread.is_alive()
    finally:
        kernel.close()
        daemon.close()
        os.close(ops.fd)
