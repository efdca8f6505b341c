"""A bound on failed token guesses per client network (issue 47: 64 anonymous clients guessed 431
tokens/s against one API worker).

Each client network (the IPv4 address, or the IPv6 /64: one host holds a whole /64) has a token
bucket of failures: `burst` failures at once, then `rate` per second. Once it is empty, a request
from there that carries a token is answered 429 with Retry-After *without* checking the token, so
a guess made then learns nothing, however right it was. Requests with a valid token never draw
from the bucket; a caller that mistyped a token a few times is not locked out.

The buckets live in one fixed table that every API worker of `silod serve --workers N` maps from
the same file (`FailedAuthLimiter.create_table`): the kernel spreads a client's connections over
the workers, so a table per process allowed N times the rate. A failure is counted under an
exclusive `flock` of the file; the check on every request reads its slot without a lock (a read
racing a write can misjudge that one request, never the count). Slots are found by a keyed hash
of the network (the key is random per table, so no client can aim at another's slot) with a few
probes; a network that finds its probes taken replaces the fullest bucket among them, which only
gives that network a full bucket back, as forgetting it would. Behind a proxy every client shares
the proxy's address: that is then one bucket for all.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

_SALT = 16  # bytes of hash key at the table's start
_SLOT = struct.Struct("<Qdd")  # network hash (0: empty), tokens left, when (time.monotonic, system-wide)
_PROBES = 8
_HASHES_MAX = 65_536  # client addresses whose slot hash is remembered
DEFAULT_SLOTS = 16_384  # 384 KiB; more networks than this failing at once share their probes' fullest slots


def client_network(host: str | None) -> str:
    """The key a client's failures are counted under."""
    if not host:
        return "-"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # a unix socket path or a test client's name
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _table_bytes(slots: int) -> int:
    return _SALT + slots * _SLOT.size


class FailedAuthLimiter:
    """The failure buckets; in this process's memory, or in the table file at `path` (made by
    `create_table`) shared by every process that opens it."""

    def __init__(self, burst: float = 20.0, rate: float = 2.0, slots: int = DEFAULT_SLOTS,
                 clock: Callable[[], float] = time.monotonic, path: Path | str | None = None) -> None:
        if not (burst >= 1 and rate > 0 and slots >= _PROBES and slots & (slots - 1) == 0):
            raise ValueError("burst >= 1, rate > 0 and slots a power of two >= 8")
        self.burst, self.rate, self.clock = float(burst), float(rate), clock
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is None:
            self._buf: bytearray | mmap.mmap = bytearray(_table_bytes(slots))
            self._buf[:_SALT] = os.urandom(_SALT)
        else:
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            size = os.fstat(self._fd).st_size
            if size < _table_bytes(_PROBES) or (size - _SALT) % _SLOT.size:
                os.close(self._fd)
                raise ValueError(f"{path} is not a failed-token table ({size} bytes)")
            self._buf = mmap.mmap(self._fd, size)
            slots = (size - _SALT) // _SLOT.size
            if slots & (slots - 1):
                raise ValueError(f"{path} is not a failed-token table ({slots} slots)")
        self._mask = slots - 1
        self._salt = bytes(self._buf[:_SALT])
        self._hashes: dict[str | None, int] = {}

    @staticmethod
    def create_table(path: Path | str, slots: int = DEFAULT_SLOTS) -> Path:
        """A new, empty table file at `path` (0600, replacing any older one) for processes to share."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, os.urandom(_SALT))
            os.ftruncate(fd, _table_bytes(slots))
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        if self._fd is not None:
            self._buf.close()
            os.close(self._fd)
            self._fd = None

    def _hash(self, host: str | None) -> int:
        # Every request with a token asks (retry_after): parsing the address is most of its cost
        # (~6 of 7 us), so the hash is kept per host; bounded, like the token cache.
        h = self._hashes.get(host)
        if h is None:
            digest = hashlib.blake2b(client_network(host).encode(), digest_size=8, key=self._salt).digest()
            h = int.from_bytes(digest, "little") or 1
            if len(self._hashes) >= _HASHES_MAX:
                self._hashes.clear()
            self._hashes[host] = h
        return h

    def _offsets(self, h: int) -> list[int]:
        return [_SALT + ((h + i) & self._mask) * _SLOT.size for i in range(_PROBES)]

    def _level(self, tokens: float, at: float, now: float) -> float:
        return min(self.burst, tokens + max(now - at, 0.0) * self.rate)

    def retry_after(self, host: str | None) -> float:
        """Seconds until a request carrying a token from `host` may be checked (0: now)."""
        h = self._hash(host)
        for off in self._offsets(h):
            key, tokens, at = _SLOT.unpack_from(self._buf, off)
            if key == h:
                level = self._level(tokens, at, self.clock())
                return 0.0 if level >= 1.0 else (1.0 - level) / self.rate
            if key == 0:  # slots are never emptied: the network has no bucket yet
                return 0.0
        return 0.0

    def failed(self, host: str | None) -> None:
        """Count one failed token check from `host`."""
        h = self._hash(host)
        with self._lock:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                now = self.clock()
                victim, victim_level = -1, -1.0
                for off in self._offsets(h):
                    key, tokens, at = _SLOT.unpack_from(self._buf, off)
                    if key == h or key == 0:
                        level = self.burst if key == 0 else self._level(tokens, at, now)
                        victim = off
                        break
                    level = self._level(tokens, at, now)
                    if level > victim_level:
                        victim, victim_level = off, level
                else:
                    level = self.burst  # the fullest bucket gives way: forgetting it lost nothing but a full bucket
                _SLOT.pack_into(self._buf, victim, h, max(level - 1.0, 0.0), now)
            finally:
                if self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)


def retry_after_header(seconds: float) -> list[tuple[bytes, bytes]]:
    return [(b"retry-after", str(max(1, math.ceil(seconds))).encode())]


__all__ = ["DEFAULT_SLOTS", "FailedAuthLimiter", "client_network", "retry_after_header"]
