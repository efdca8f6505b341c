"""One item's bytes from an HTTP or S3 remote as a stream that can be resumed.

Why not fsspec's file objects: `cat_file` returns only when the whole item is in memory (an item
trickling at 1 KB/s shows no progress for minutes, and a source that sends more than the listing
says grows the mount's memory without limit), and s3fs's file object sends one ranged GET per
chunk without pinning the object's version (an object replaced mid-fetch is cached as a mix of
two versions). Here one GET streams the item; each piece that arrives is reported at once (the
caller stamps liveness per piece, not per chunk); at most `size + 1` bytes are ever read; and a
retry continues from the bytes already staged with a ranged GET that is validated against the
first response's ETag / Last-Modified (HTTP `If-Range`) or ETag (S3 `IfMatch`): if the object
changed, the server sends it whole (or refuses) and the fetch restarts from byte 0.

HTTP(S) requests run on the fetching thread itself (blocking_http.py: a keep-alive pool whose
every request, redirect and connection is held to the allow-list like fsspec's session is), and
the body is read straight into the buffer that is staged. S3 requests run on fsspec's event loop
with s3fs's own session (safe_http.py guards it); the caller's thread waits for each step.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from fsspec.asyn import sync

from fuse_client import blocking_http

_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


class ObjectChanged(OSError):
    """A resumed request found another version of the object: restart from byte 0."""


@dataclass
class Validator:
    """What identifies the version of the object whose bytes are staged."""

    etag: str | None = None
    last_modified: str | None = None

    @property
    def usable(self) -> bool:
        # A weak ETag may not be used in If-Range (RFC 9110 13.1.5): fall back to the date.
        return bool(self.strong_etag or self.last_modified)

    @property
    def strong_etag(self) -> str | None:
        return self.etag if self.etag and not self.etag.startswith("W/") else None

    def contradicts(self, other: "Validator | None") -> bool:
        """True when `other` names another version for sure: another ETag, or (no ETag on one
        side) another Last-Modified. Nothing to compare contradicts nothing: a caller that reads
        past staged bytes on this answer checks those bytes themselves (remote.py)."""
        if other is None:
            return False
        if self.etag and other.etag:
            return self.etag != other.etag
        return bool(self.last_modified and other.last_modified and self.last_modified != other.last_modified)


class Opened:
    """An open response body: `start` is the offset its first byte has in the object."""

    def __init__(self, start: int, validator: Validator, read: Callable, close: Callable[[], None],
                 content=None) -> None:
        self.start = start
        self.validator = validator
        self._read = read
        self._close = close
        self._content = content  # the aiohttp StreamReader, to salvage what arrived before a cut

    def _salvage(self, n: int) -> list[bytes]:
        """The bytes that arrived before the connection failed, up to `n`. aiohttp's read()
        raises the connection's error before handing out what is still buffered, and on a fast
        link that is everything since the last read: without this, a cut loses up to a socket
        buffer of data that a resumed fetch then asks for again."""
        content, parts = self._content, []
        take = getattr(content, "_read_nowait_chunk", None)
        if take is None:
            return parts
        try:
            while n > 0 and content._buffer:
                piece = take(n)
                parts.append(piece)
                n -= len(piece)
        except Exception:  # internals changed: nothing salvaged, the retry asks again
            pass
        return parts

    async def read_upto(self, n: int, on_piece: Callable[[int], None], timeout: Callable[[], float]) -> tuple[bytes, BaseException | None]:
        """Up to `n` bytes (fewer only at the end of the body), calling `on_piece(len)` as each
        piece arrives. A failure after some bytes returns them with the error, so that they
        can be staged before the retry resumes after them."""
        parts: list[bytes] = []
        got = 0
        try:
            while got < n:
                # asyncio.timeout, not wait_for: no task per piece (a 64 MiB item is ~1,000 pieces)
                async with asyncio.timeout(max(0.001, timeout())):
                    piece = await self._read(n - got)
                if not piece:
                    break
                parts.append(piece)
                got += len(piece)
                on_piece(len(piece))
        except (asyncio.TimeoutError, TimeoutError):
            return b"".join(parts), TimeoutError(f"no byte arrived in time ({got} of {n} bytes of this chunk)")
        except Exception as exc:  # a reset connection, a truncated body: keep what arrived
            for piece in self._salvage(n - got):
                parts.append(piece)
                on_piece(len(piece))
            return b"".join(parts), exc
        return (parts[0] if len(parts) == 1 else b"".join(parts)), None

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # a broken connection is closed already
            pass


class HttpOpened:
    """An open HTTP response body read on the calling thread (blocking_http.py)."""

    def __init__(self, start: int, validator: Validator, response) -> None:
        self.start = start
        self.validator = validator
        self._response = response

    def read_upto(self, n: int, on_piece: Callable[[int], None], timeout: Callable[[], float]) -> tuple[memoryview, BaseException | None]:
        """Up to `n` bytes (fewer only at the end of the body) read into one new buffer, each
        arrival reported to `on_piece`; a failure after some bytes returns them with the error."""
        buf = memoryview(bytearray(n))
        got = 0
        try:
            while got < n:
                k = self._response.readinto1(buf[got:], timeout, on_piece)
                if not k:
                    break
                got += k
        except (socket.timeout, TimeoutError):
            return buf[:got], TimeoutError(f"no byte arrived in time ({got} of {n} bytes of this chunk)")
        except Exception as exc:  # a reset connection, a truncated body: keep what arrived
            return buf[:got], exc
        return buf[:got], None

    def close(self) -> None:
        try:
            self._response.close()
        except Exception:  # a broken connection is closed already
            pass


class ItemStreams:
    """Ranged, validated streaming GETs on an fsspec HTTP or S3 file system."""

    def __init__(self, fs, protocol: str, connect_timeout_s: float, guard=None) -> None:
        """`guard`: the HttpGuard of an HTTP(S) source (its item GETs then run on the calling
        thread through a blocking_http pool held to it); S3 sources go through `fs`."""
        self.fs = fs
        self.protocol = protocol
        self.connect_timeout_s = connect_timeout_s
        self._http = None
        if protocol in ("http", "https"):
            if guard is None:
                raise ValueError("an HTTP(S) source's item streams need its allow-list guard")
            self._http = blocking_http.HttpPool(guard, connect_timeout_s)

    # -- called from the fetching thread -----------------------------------------------------

    def open(self, full: str, offset: int, validator: Validator | None,
             timeout: Callable[[], float]) -> "Opened | HttpOpened":
        if self._http is not None:
            return self._open_http_blocking(full, offset, validator, timeout)
        return sync(self.fs.loop, self._open, full, offset, validator, timeout)

    def read(self, opened, n: int, on_piece: Callable[[int], None], timeout: Callable[[], float]) -> tuple[bytes | memoryview, BaseException | None]:
        if isinstance(opened, HttpOpened):
            return opened.read_upto(n, on_piece, timeout)
        return sync(self.fs.loop, opened.read_upto, n, on_piece, timeout)

    def get(self, full: str, offset: int, validator: Validator | None, n: int, on_piece: Callable[[int], None],
            timeout: Callable[[], float]) -> tuple["Opened | HttpOpened", bytes | memoryview, BaseException | None]:
        """open + read_upto(n) + close (S3: in one trip to the event loop; small items: one
        call instead of three cross-thread round trips)."""
        if self._http is not None:
            opened = self._open_http_blocking(full, offset, validator, timeout)
            try:
                data, exc = opened.read_upto(n, on_piece, timeout)
            finally:
                opened.close()
            return opened, data, exc
        return sync(self.fs.loop, self._get, full, offset, validator, n, on_piece, timeout)

    def close(self, opened) -> None:
        """Close the response (S3: on the event loop, aiohttp objects are not thread-safe); an
        unread rest is dropped with the connection, never drained."""
        if isinstance(opened, HttpOpened):
            opened.close()
            return
        sync(self.fs.loop, self._aclose, opened)

    def shutdown(self) -> None:
        """Close the idle connections of the HTTP pool."""
        if self._http is not None:
            self._http.close()

    def _open_http_blocking(self, url: str, offset: int, validator: Validator | None,
                            timeout: Callable[[], float]) -> HttpOpened:
        headers = dict(self.fs.kwargs.get("headers") or {})
        if offset:
            assert validator is not None and validator.usable
            headers["Range"] = f"bytes={offset}-"
            headers["If-Range"] = validator.strong_etag or validator.last_modified
        try:
            r = self._http.get(url, headers, timeout)
        except (socket.timeout, TimeoutError) as exc:
            raise TimeoutError(f"{url}: no answer in time") from exc
        try:
            got, start = _check_http_answer(url, r.status, r.headers, offset, validator)
        except BaseException:
            r.close_quietly()
            raise
        return HttpOpened(start, got, r)

    @staticmethod
    async def _aclose(opened: Opened) -> None:
        opened.close()

    # -- on the event loop -------------------------------------------------------------------

    async def _get(self, full, offset, validator, n, on_piece, timeout):
        opened = await self._open(full, offset, validator, timeout)
        try:
            data, exc = await opened.read_upto(n, on_piece, timeout)
        finally:
            opened.close()
        return opened, data, exc

    async def _open(self, full: str, offset: int, validator: Validator | None, timeout: Callable[[], float]) -> Opened:
        async with asyncio.timeout(max(0.001, timeout())):
            return await self._open_s3(full, offset, validator)

    async def _open_s3(self, full: str, offset: int, validator: Validator | None) -> Opened:
        fs = self.fs
        bucket, key, version = fs.split_path(full)
        kw: dict = {"Bucket": bucket, "Key": key}
        if version:
            kw["VersionId"] = version
        if offset:
            assert validator is not None and validator.etag
            kw["Range"] = f"bytes={offset}-"
            kw["IfMatch"] = validator.etag
        try:
            resp = await fs._call_s3("get_object", **kw)
        except Exception as exc:
            if offset and ("PreconditionFailed" in str(exc) or "412" in str(exc)):
                raise ObjectChanged(f"s3://{bucket}/{key} changed while it was fetched") from exc
            raise
        body = resp["Body"]
        start = 0
        if offset:
            m = _CONTENT_RANGE.match(resp.get("ContentRange", "") or "")
            if m is None or int(m.group(1)) != offset:
                body.close()
                raise IOError(f"s3://{bucket}/{key}: asked for bytes from {offset}, got ContentRange "
                              f"{resp.get('ContentRange')!r}")
            start = offset
        raw = getattr(body, "_raw_stream", None)
        return Opened(start, Validator(resp.get("ETag"), str(resp.get("LastModified") or "") or None),
                      body.read, body.close, getattr(raw, "content", None))


def _check_http_answer(url: str, status: int, headers, offset: int, validator: Validator | None) -> tuple[Validator, int]:
    """The answer's validator and the offset of its first byte; an error for anything but 200 or
    the 206 asked for (a 206 of another version: ObjectChanged)."""
    if status == 404:
        raise FileNotFoundError(url)
    if status not in (200, 206):
        raise IOError(f"{url}: HTTP {status}")
    got = Validator(headers.get("ETag"), headers.get("Last-Modified"))
    start = 0
    if status == 206:
        m = _CONTENT_RANGE.match(headers.get("Content-Range", ""))
        if m is None or int(m.group(1)) != offset:
            raise IOError(f"{url}: asked for bytes from {offset}, the server sent "
                          f"Content-Range {headers.get('Content-Range')!r}")
        if validator is not None and validator.strong_etag and got.etag and got.etag != validator.etag:
            raise ObjectChanged(f"{url} changed while it was fetched (ETag {validator.etag} -> {got.etag})")
        start = offset
    return got, start


def monotonic_allowance(progress: list[float], deadline_s: float, read_timeout_s: float,
                        clock: Callable[[], float] = time.monotonic) -> Callable[[], float]:
    """How long the next wait for a byte may last: the per-read timeout, and never past the
    moment the remote will have delivered nothing for the deadline."""
    def allowance() -> float:
        return min(read_timeout_s, progress[0] + deadline_s - clock())

    return allowance
