"""The remote store behind a mount, through fsspec: listing once, then throttled whole-item fetches.

Supported URLs: a local directory (`/data/x` or `file:///data/x`), `s3://bucket/prefix` (s3fs;
the endpoint comes from the usual AWS settings, e.g. `AWS_ENDPOINT_URL`, or fsspec's
`FSSPEC_S3_ENDPOINT_URL`), and `http(s)://host/dir/` (fsspec's HTTP file system, which lists a
directory by the links of its index page, one HEAD per item for its size; or, when the server
sends nginx's JSON indexes, one GET per directory: http_index.py).

Datasets are immutable while mounted, so the listing (names, sizes) is read from the store once
at mount time and kept in memory; this is also what makes `ls` and `stat` on the mount free.

Retries: silod's `RetryPolicy` (breaker.py) is the only retry loop. The S3 and HTTP clients are
configured to try once with connect/read timeouts within the per-open deadline, so a dead
remote costs one deadline per open, not nested client retries (~31 s per open before).
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
import zlib
from urllib.parse import unquote, urlsplit
from collections.abc import Callable
from dataclasses import dataclass

from estimator.errors import UserError
from contract.credentials import SourceCredential
from contract.uri_policy import UriPolicy, UriRejected
from fuse_client import beneath, http_index, item_stream
from fuse_client.listing import DatasetListing, DuplicatePath, FileEntry, ListingBuilder, ListingFull  # noqa: F401 (re-exported)
from fuse_client.safe_http import DestinationRefused, HttpGuard
from fuse_client.breaker import RetryPolicy
from fuse_client.token_bucket import Throttle, TokenWaitExpired, chunk_size_for

log = logging.getLogger(__name__)


class RemoteFetchError(OSError):
    """The remote store kept failing for one item; the FUSE layer turns this into EIO."""


SUPPORTED_SCHEMES = ("", "file", "s3", "http", "https")  # "": a local directory


def storage_options(url: str, credential: SourceCredential | None, anonymous: bool = False) -> dict:
    """fsspec options for `url`: the tenant's credential when given; with `anonymous`, no
    credential at all for s3 (so the cluster's own, from the environment, is never used)."""
    if not url.startswith("s3://"):
        return {}
    if credential is not None:
        opts: dict = {"key": credential.access_key_id, "secret": credential.secret_access_key}
        client_kwargs = {k: v for k, v in (("endpoint_url", credential.endpoint_url),
                                           ("region_name", credential.region)) if v}
        if client_kwargs:
            opts["client_kwargs"] = client_kwargs
        return opts
    return {"anon": True} if anonymous else {}


def s3_endpoint(credential: SourceCredential | None) -> str | None:
    """The S3 endpoint the mount's client uses: the tenant credential's, else the environment's
    (fsspec's FSSPEC_S3_ENDPOINT_URL, then botocore's AWS_ENDPOINT_URL_S3 and AWS_ENDPOINT_URL);
    None for AWS's own endpoints."""
    if credential is not None and credential.endpoint_url:
        return credential.endpoint_url
    names = ["FSSPEC_S3_ENDPOINT_URL"]
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() != "true":
        names += ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"]
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def single_try_options(url: str, policy: RetryPolicy) -> dict:
    """fsspec options that make the remote's client try once, with timeouts inside the deadline."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    timeout = policy.client_timeout_s
    if scheme in ("s3", "s3a"):
        return {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"},
                                  "connect_timeout": timeout, "read_timeout": policy.read_timeout_s}}
    if scheme in ("http", "https"):
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)}}
    return {}


def _rel_beneath(base: str, url: str) -> str | None:
    """`url` relative to the directory URL `base`, or None if it is not beneath it once
    normalised: same scheme and host, and a path that, percent-decoded, has no `.` or `..`
    segment and starts with base's path. The rel part is returned as the server spelled it."""
    b, u = urlsplit(base), urlsplit(url)
    if (u.scheme.lower(), u.netloc.lower()) != (b.scheme.lower(), b.netloc.lower()) or u.query or u.fragment:
        return None
    if not u.path.startswith(b.path):
        return None
    rel = u.path[len(b.path):]
    decoded = unquote(rel).replace("\\", "/")
    if any(seg in (".", "..") for seg in decoded.split("/")) or "\0" in decoded or decoded.startswith("/"):
        return None
    return rel


class RemoteStore:
    """An fsspec file system rooted at the dataset URL."""

    def __init__(self, url: str, policy: RetryPolicy | None = None, credential: SourceCredential | None = None,
                 anonymous: bool = False, allow: UriPolicy | None = None,
                 limits: "ListingLimits | None" = None) -> None:
        """`allow`: the operator's allow-list; every HTTP request, redirect and connection of this
        store is held to it (without one, to the source's own prefix: safe_http.py), and a
        `file://` source under one of its prefixes is opened beneath that prefix (beneath.py)."""
        import fsspec

        self.url = url
        self.policy = policy or RetryPolicy()
        self.limits = limits or ListingLimits()
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in SUPPORTED_SCHEMES:
            # Checked before fsspec, which would otherwise try to connect (ftp://) or import a driver.
            raise UserError(f"--source {url!r}: scheme {scheme}:// is not supported; use a local directory, file://, s3:// or http(s)://")
        try:
            # The options make the client try once (retries and the deadline are ours); inside
            # the try because building them imports the scheme's client library (aiohttp).
            extra: dict = {}
            options = single_try_options(url, self.policy)
            if scheme in ("http", "https"):
                self.guard = HttpGuard.for_source(url, allow)
                extra["get_client"] = self.guard.get_client()
            elif scheme == "s3":
                # Every S3 request, connection and (never followed) redirect is held to the
                # allow-list too (safe_http.py); the endpoint is passed explicitly so that the one
                # the guard pins is the one the client uses.
                endpoint = s3_endpoint(credential)
                try:
                    self.guard = HttpGuard.for_s3(endpoint, allow)
                except UriRejected as exc:
                    raise UserError(f"--source {url!r}: S3 endpoint {endpoint!r} refused: {exc}") from None
                options["config_kwargs"]["http_session_cls"] = self.guard.s3_session_cls()
                if endpoint is not None:
                    extra["endpoint_url"] = endpoint
            self.fs, root = fsspec.core.url_to_fs(url, **options, **storage_options(url, credential, anonymous), **extra)
        except ImportError as exc:
            raise UserError(f"--source {url!r} needs an optional dependency ({exc}); for s3:// install silod with the S3 extra: pip install 'silod[s3]'") from exc
        except ValueError as exc:
            raise UserError(f"--source {url!r} is not a URL silod can read ({exc}); use a local directory, file://, s3:// or http(s)://") from exc
        if hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs retries some errors itself (5 by default); ours are the only ones
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.root = root.rstrip("/") if self.protocol not in ("http", "https") else root
        self._root_fd = -1
        if self.protocol in ("file", "local"):
            prefix = allow.explicit_prefix(url) if allow is not None and url.startswith("file://") else None
            try:
                self._root_fd = beneath.open_root(self.root, None if prefix is None else prefix[len("file://"):])
            except beneath.OutsideRoot as exc:
                raise UserError(f"--source {url!r} resolves outside the allowed prefix {prefix!r} ({exc})") from None
            except OSError as exc:
                raise UserError(f"--source {url!r} is not a directory in the store (or does not exist): "
                                f"{exc.strerror}") from None

    def close(self) -> None:
        streams = getattr(self, "_item_streams", None)
        if streams is not None:
            streams.shutdown()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def _open_local(self, rel: str, flags: int = os.O_RDONLY) -> int:
        return beneath.open_beneath(self._root_fd, self.root, rel, flags)

    def _full(self, rel: str) -> str:
        if self.protocol in ("http", "https"):
            return self.root.rstrip("/") + "/" + rel
        return posixpath.join(self.root, rel) if self.root else rel

    def list(self) -> DatasetListing:
        """Every file under the root with its size. Raises UserError if the store is unreachable.

        Entries go to a ListingBuilder (sorted on disk) as they are listed, and the listing is
        capped as it grows (--max-listing-entries, --max-listing-bytes): a source never makes the
        mount hold more than the caps allow, not even for a moment."""
        builder = ListingBuilder(self.limits.max_listing_bytes)
        try:
            try:
                if self.protocol in ("http", "https"):
                    self._list_http(builder)
                elif self.protocol in ("file", "local"):
                    self._list_local(builder)
                else:
                    self._list_s3(builder)
            except (UserError, ListingFull):
                raise
            except Exception as exc:  # connection refused, DNS, auth, ...: one clear line, exit 2
                raise UserError(f"--source {self.url!r} is unreachable: {type(exc).__name__}: {exc}") from exc
            n = builder.count()
            if not n:
                raise UserError(f"--source {self.url!r} contains no files")
            self._count_entries(n)
            return builder.build()
        except ListingFull:
            raise UserError(f"--source {self.url!r} lists paths (files and directories) of more than "
                            f"{self.limits.max_listing_bytes} bytes in all (--max-listing-bytes); the listing is "
                            "kept in memory, so a larger one needs a higher limit") from None
        finally:
            builder.close()

    def _list_s3(self, builder: ListingBuilder) -> None:
        """ListObjectsV2 page by page (1,000 keys each), stopping at the entry cap: the keys
        past it are never asked for (s3fs's find listed the whole prefix into memory first)."""
        from fsspec.asyn import sync

        # (no fs.isdir first: s3fs answers it by listing the whole prefix, every page)
        missing = UserError(f"--source {self.url!r} is not a directory in the store (or does not exist)")
        bucket, key, _ = self.fs.split_path(self.root)
        prefix = key.rstrip("/") + "/" if key else ""
        kwargs: dict = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
        seen = 0
        while True:
            try:
                page = self._listing_call(f"ListObjectsV2 {bucket}/{prefix} (after {seen} keys)",
                                          lambda: sync(self.fs.loop, self.fs._call_s3, "list_objects_v2", **kwargs))
            except FileNotFoundError:  # no such bucket
                raise missing from None
            if not seen and not page.get("Contents"):
                raise missing
            for obj in page.get("Contents", ()):
                name = obj["Key"]
                if name.endswith("/") or not name.startswith(prefix):  # a "directory" marker
                    continue
                seen += 1
                self._count_entries(seen)
                builder.add(name[len(prefix):], int(obj.get("Size") or 0))
            if not page.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def _list_local(self, builder: ListingBuilder) -> None:
        """A local (or NFS) directory, walked with scandir: about 2x faster than fsspec's find,
        which builds an info dict per file (most of a remount's time at 100k+ items). Symlinks
        are followed, as fsspec does; a directory reached twice (a symlink cycle) is walked once."""
        if not os.path.isdir(self.root):
            raise UserError(f"--source {self.url!r} is not a directory in the store (or does not exist)")
        root_stat = os.stat(self.root)
        seen = {(root_stat.st_dev, root_stat.st_ino)}
        pending = [("", self.root)]
        count = 0
        while pending:
            rel_dir, path = pending.pop()
            with os.scandir(path) as entries:
                for entry in entries:
                    rel = f"{rel_dir}{entry.name}"
                    if entry.is_symlink() and not self._beneath_root(rel):
                        continue
                    if entry.is_dir():
                        st = entry.stat()
                        if (st.st_dev, st.st_ino) not in seen:
                            seen.add((st.st_dev, st.st_ino))
                            pending.append((rel + "/", entry.path))
                    elif entry.is_file():
                        count += 1
                        self._count_entries(count)
                        builder.add(rel, entry.stat().st_size)

    def _beneath_root(self, rel: str) -> bool:
        """Whether the symlink `rel` resolves beneath the root (the open will check it again)."""
        try:
            os.close(self._open_local(rel, os.O_PATH))
            return True
        except beneath.OutsideRoot:
            log.warning("--source %s: %r leads outside the dataset root; left out", self.url, rel)
        except OSError as exc:
            log.warning("--source %s: %r cannot be resolved (%s); left out", self.url, rel, exc.strerror)
        return False

    def _count_entries(self, n: int) -> None:
        if n > self.limits.max_entries:
            raise UserError(f"--source {self.url!r} lists more than {self.limits.max_entries} entries "
                            "(--max-listing-entries); the listing is kept in memory, so a larger one needs a "
                            "higher limit")

    def _listing_call(self, what: str, fn: Callable[[], object]):
        """One request of the listing, retried with backoff while the remote has answered within
        the deadline: one 500 must not fail a mount. Not found and our own refusals are final."""
        policy = self.policy
        t0 = time.monotonic()
        for attempt in range(1, policy.attempts + 1):
            try:
                return fn()
            except (UserError, FileNotFoundError, UriRejected, PermissionError, DestinationRefused):
                raise
            except Exception as exc:
                status = getattr(exc, "status", None)
                if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
                    raise  # the request itself is refused: asking again changes nothing
                pause = policy.backoff(attempt)
                if attempt == policy.attempts or time.monotonic() + pause - t0 > policy.deadline_s:
                    raise
                log.warning("listing %s: %s failed (%s: %s); retrying in %.1f s", self.url, what, type(exc).__name__,
                            exc, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")

    def _get_index(self, url: str) -> tuple[bytes, str | None]:
        """The body (at most --max-index-bytes) and Content-Type of the index page `url`."""
        cap = self.limits.max_index_bytes

        async def get() -> tuple[bytes, str | None]:
            session = await self.fs.set_session()
            async with session.get(self.fs.encode_url(url), **self.fs.kwargs) as r:
                if r.status == 404:
                    raise FileNotFoundError(url)
                r.raise_for_status()
                body, got = bytearray(), 0  # one buffer: a list of parts and their join held it twice
                while True:
                    piece = await r.content.read(min(1 << 20, cap + 1 - got))
                    if not piece:
                        break
                    body += piece
                    got += len(piece)
                    if got > cap:
                        raise UserError(f"--source {self.url!r}: the directory index {url!r} is larger than "
                                        f"{cap} bytes (--max-index-bytes); it is read into memory, so a larger "
                                        "one needs a higher limit")
                return body, r.headers.get("Content-Type")

        from fsspec.asyn import sync

        return self._listing_call(f"GET {url}", lambda: sync(self.fs.loop, get))

    def _list_http(self, builder: ListingBuilder) -> None:
        base = self.root.rstrip("/") + "/"
        body, ctype = self._get_index(base)
        if http_index.looks_like_json_index(body):
            first = [body]
            del body  # (the page is up to --max-index-bytes: one reference, dropped once parsed)
            return self._list_http_json(builder, base, first)
        # Directories still to list wait in the builder's database (a page may link millions).
        builder.push(base)
        seen = 0
        while (url := builder.pop()) is not None:
            if body is None:
                body, ctype = self._get_index(url)
            links = http_index.html_links(body, ctype, url)
            body = None
            for name in links:
                rel = _rel_beneath(base, name)
                if rel is None:  # links that leave the dataset (parent directory, absolute links, %2e%2e)
                    if name.startswith(base):
                        log.warning("--source %s: index link %r leaves the dataset; left out", self.url, name)
                    continue
                if not rel:
                    continue
                if name.endswith("/"):
                    if builder.push(name):
                        seen += 1
                        self._count_entries(seen)
                    continue
                if builder.has(rel):  # linked twice (fsspec's ls dropped the second one too)
                    continue
                seen += 1
                self._count_entries(seen)
                size = self._listing_call(f"HEAD {name}", lambda: self.fs.info(name).get("size"))
                if size is None:
                    raise UserError(f"--source {self.url!r}: the server reports no size for {name!r}")
                builder.add(rel, int(size))

    def _list_http_json(self, builder: ListingBuilder, base: str, first: list[bytes]) -> None:
        """A server with JSON directory indexes (nginx `autoindex_format json`): one GET per
        directory. Paths are kept URL-encoded, as the links of an HTML index give them, so the
        mount shows the same names whichever index the server sends."""
        builder.push(base)
        body: bytes | None = first.pop()
        seen = 0
        while (url := builder.pop()) is not None:
            if body is None:
                body, _ = self._get_index(url)
            entries = http_index.iter_json_index(body, url, self.url, max_entries=self.limits.max_entries - seen)
            body = None  # the generator holds the decoded text while it runs
            rel_dir = url[len(base):]
            try:
                for entry in entries:
                    seen += 1
                    if entry.is_dir:
                        if not builder.push(f"{url}{entry.url_name}/"):
                            raise DuplicatePath(entry.name)
                    else:
                        builder.add(f"{rel_dir}{entry.url_name}", entry.size)
                builder.flush()  # a name listed twice is named with its own directory
            except DuplicatePath as exc:
                raise http_index.bad_index(self.url, url, f"lists {exc.path.rpartition('/')[2]!r} twice") from None

    def _open(self, rel: str, chunk: int, size: int | None = None):
        # The listing knows the size: passing it saves the HEAD request fsspec would send first.
        full = self._full(rel)
        if self.protocol in ("http", "https"):
            return self.fs.open(full, "rb", block_size=0, size=size)  # one streaming GET
        if self.protocol in ("s3", "s3a"):
            return self.fs.open(full, "rb", block_size=chunk, cache_type="none", size=size)  # one ranged GET per chunk
        if self.protocol in ("file", "local"):
            return os.fdopen(self._open_local(rel), "rb")
        return self.fs.open(full, "rb")

    def fetch(
        self,
        entry: FileEntry,
        write: Callable[[bytes, int], None],
        throttle: Throttle,
        on_remote_bytes: Callable[[int], None],
        reset: Callable[[], None],
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[Exception], None] = lambda exc: None,
        on_progress: Callable[[], None] = lambda: None,
        chunk_cap: Callable[[], int] = lambda: 4 * 1024 * 1024,
        on_buffer: Callable[[int], None] = lambda n: None,
    ) -> int:
        """Stream the whole item through `write(data, offset)`, paying tokens before each chunk.

        Returns the CRC-32 of the content. `on_progress()` is called (from any thread) as each
        piece of data arrives. A try that fails is retried after a backoff, resuming after the
        bytes already written when the remote can send a validated range (item_stream.py);
        otherwise (no ranges, or no validator to pin one to) the item is asked for whole again
        and read past the bytes already written, whose CRC must match; when the object changed
        meanwhile the output is discarded with `reset()` and the fetch restarts from byte 0.
        Tries go on while the remote has delivered something within the last `policy.deadline_s`
        (token waits do not count) and until `policy.attempts` tries in a row delivered nothing;
        then RemoteFetchError (EIO).
        Errors of `write` itself (the cache disk) are raised as they are: not the remote's.
        `on_buffer(n)` is told the bytes this fetch may hold in memory (+n before a read, -n once
        it is staged), so the fetch pool can count its in-flight bytes.
        """
        policy = self.policy
        last: Exception | None = None
        progress = [clock()]  # last time the remote delivered data (or we finished a token wait)
        state = _FetchState()
        failures = 0
        while failures < policy.attempts:
            if failures:
                pause = policy.backoff(failures)
                if clock() + pause - progress[0] >= policy.deadline_s:
                    break
                sleep(pause)
            before = state.offset
            try:
                return self._fetch_once(entry, write, throttle, on_remote_bytes, progress, clock, state, reset,
                                        on_progress, chunk_cap, on_buffer)
            except (InterruptedError, TokenWaitExpired, StagingWriteError):
                # unmounting / the job's own allocation / the cache disk: not the remote's
                raise
            except FileNotFoundError as exc:
                last = exc
                log.warning("fetching %s (try %d) failed: %s", entry.path, failures + 1, exc)
            except Exception as exc:
                last = exc
                on_error(exc)
                log.warning("fetching %s (try %d, %d of %d bytes staged) failed: %s: %s", entry.path, failures + 1,
                            state.offset, entry.size, type(exc).__name__, exc)
            failures = 1 if state.offset > before else failures + 1
            if clock() - progress[0] > policy.deadline_s:
                break
        reset()
        raise RemoteFetchError(5, f"remote store {self.url} keeps failing for {entry.path!r}: {type(last).__name__}: {last}")

    def probe(self, entry: FileEntry) -> None:
        """One cheap request that needs the remote to answer (read one byte of `entry`)."""
        with self._open(entry.path, 64 * 1024) as f:
            if entry.size and not f.read(1):
                raise IOError(f"{entry.path!r} is empty, the listing says {entry.size} bytes")

    def _fetch_once(self, entry, write, throttle: Throttle, on_remote_bytes, progress: list[float], clock,
                    state: "_FetchState", reset, on_progress, chunk_cap, on_buffer) -> int:
        if self.protocol in ("http", "https", "s3", "s3a"):
            return self._fetch_stream(entry, write, throttle, on_remote_bytes, progress, clock, state, reset,
                                      on_progress, chunk_cap, on_buffer)
        # A local (or NFS) file: a retry continues at the offset reached (the file is the same).
        size = entry.size
        with self._open(entry.path, 0, size) as f:
            if state.offset:
                f.seek(state.offset)
            while state.offset < size:
                want = min(chunk_size_for(throttle.rate), chunk_cap(), size - state.offset)
                before = clock()
                throttle.acquire(want)
                progress[0] += clock() - before  # waiting for our own tokens is not the remote's fault
                self._room(on_buffer, want, progress, clock)
                try:
                    data = f.read(want)
                    progress[0] = clock()
                    on_progress()
                    if not data:
                        raise IOError(f"{entry.path!r} ended at {state.offset} bytes, the listing says {size}")
                    self._stage(data, state, write, on_remote_bytes)
                finally:
                    on_buffer(-want)
        return state.crc

    @staticmethod
    def _room(on_buffer, n: int, progress: list[float], clock) -> None:
        """Wait for room for `n` fetched bytes (--max-inflight-bytes): not the remote's time."""
        before = clock()
        on_buffer(n)
        progress[0] += clock() - before

    @staticmethod
    def _stage(data: bytes, state: "_FetchState", write, on_remote_bytes) -> None:
        on_remote_bytes(len(data))
        try:
            write(data, state.offset)
        except OSError as exc:
            raise StagingWriteError(exc.errno, f"writing the staged copy failed: {exc.strerror or exc}") from exc
        state.crc = zlib.crc32(data, state.crc)
        state.offset += len(data)

    def _fetch_stream(self, entry, write, throttle: Throttle, on_remote_bytes, progress: list[float], clock,
                      state: "_FetchState", reset, on_progress, chunk_cap, on_buffer) -> int:
        """One streaming GET (ranged after the bytes already staged when that can be checked),
        read chunk by chunk with tokens paid before each; at most size + 1 bytes are read."""
        size = entry.size
        policy = self.policy
        streams = self._streams()
        # A ranged resume only when the range can be pinned to the staged version (If-Range,
        # IfMatch). Without a validator the item is asked for whole again (a range could not be
        # checked) and its first bytes are compared with the staged ones below: readers holding
        # them (streaming opens) read on when they match, instead of failing with the restart.
        resume = state.offset > 0 and state.validator is not None and (
            state.validator.usable if self.protocol in ("http", "https") else bool(state.validator.etag))

        def piece(n: int) -> None:
            progress[0] = clock()
            on_progress()

        allowance = item_stream.monotonic_allowance(progress, policy.deadline_s, policy.read_timeout_s, clock)
        full = self._full(entry.path)
        want = min(chunk_size_for(throttle.rate), chunk_cap(), size - state.offset)
        before = clock()
        throttle.acquire(want)
        progress[0] += clock() - before
        # A whole item in one chunk: open, read and close in one trip to the event loop.
        small = not state.offset and want >= size
        try:
            if small:
                self._room(on_buffer, size + 1, progress, clock)
                try:
                    opened, data, exc = streams.get(full, 0, None, size + 1, piece, allowance)
                except BaseException:
                    on_buffer(-(size + 1))
                    raise
            else:
                opened = streams.open(full, state.offset if resume else 0, state.validator if resume else None, allowance)
        except item_stream.ObjectChanged:
            state.restart(reset)
            state.validator = None
            raise
        progress[0] = clock()
        # The bytes of this answer that are staged already and are checked, not staged again.
        skip = 0
        # Whether the staged bytes carried a validator (for the log lines and the error below).
        validated = state.validator is not None and bool(state.validator.etag or state.validator.last_modified)
        if opened.start != state.offset:  # sent whole: a new version, no ranges, or not asked for one
            if opened.start == 0 and state.validator is not None and not state.validator.contradicts(opened.validator):
                # Perhaps the same version from byte 0 (a server without ranges, or no validator to
                # pin a range to): readers may hold the staged bytes already (streaming opens), so
                # they stay and the answer's first bytes are read past, checked against them (their
                # CRC) instead of restarting. Other bytes there restart the fetch (below).
                skip = state.offset
                log.info("%s: sent whole again (%s); reading past the %d bytes staged already, checking them",
                         entry.path, "no ranges, no other validator" if validated else "no validator to resume a range against",
                         skip)
            else:
                state.restart(reset)
        state.validator = opened.validator
        skip_crc = 0
        try:
            if small:
                small = False  # closed on the event loop already
                try:
                    self._stage_checked(entry, data[:size], state, write, on_remote_bytes)
                finally:
                    on_buffer(-(size + 1))
                if len(data) > size:
                    raise IOError(f"{entry.path!r} sends more than the listing's {size} bytes")
                if exc is not None:
                    raise exc
                if state.offset < size:
                    raise IOError(f"{entry.path!r} ended at {state.offset} bytes, the listing says {size}")
                return state.crc
            first = True
            while state.offset < size:
                if not first:
                    want = min(chunk_size_for(throttle.rate), chunk_cap(), size - state.offset + skip)
                    before = clock()
                    throttle.acquire(want)
                    progress[0] += clock() - before
                first = False
                self._room(on_buffer, want, progress, clock)
                try:
                    data, exc = streams.read(opened, want, piece, allowance)
                    got = len(data)
                    if skip:
                        head = data[:skip]
                        skip -= len(head)
                        skip_crc = zlib.crc32(head, skip_crc)
                        on_remote_bytes(len(head))
                        data = data[len(head):]
                        if not skip and skip_crc != state.crc:
                            staged = state.offset
                            state.restart(reset)
                            state.validator = None
                            raise IOError(f"{entry.path!r} was sent again "
                                          f"{'with the same validator' if validated else 'without a validator'} "
                                          f"but other bytes in its first {staged}: fetching it again from byte 0")
                    self._stage_checked(entry, data, state, write, on_remote_bytes)
                finally:
                    on_buffer(-want)
                if exc is not None:
                    raise exc
                if got < want:
                    raise IOError(f"{entry.path!r} ended at {state.offset} bytes, the listing says {size}")
            extra, exc = streams.read(opened, 1, piece, allowance)
            if extra:
                raise IOError(f"{entry.path!r} sends more than the listing's {size} bytes")
            return state.crc
        finally:
            if not small:
                streams.close(opened)

    def _stage_checked(self, entry, data: bytes, state: "_FetchState", write, on_remote_bytes) -> None:
        if data:
            self._stage(data, state, write, on_remote_bytes)

    def _streams(self) -> item_stream.ItemStreams:
        streams = getattr(self, "_item_streams", None)
        if streams is None:
            streams = self._item_streams = item_stream.ItemStreams(self.fs, self.protocol, self.policy.client_timeout_s,
                                                                   getattr(self, "guard", None))
        return streams


@dataclass(frozen=True)
class ListingLimits:
    """What a source may make the mount hold while listing: the listing lives in memory for the
    mount's lifetime (about path length + 16 bytes per item: listing.py) and index pages are
    parsed whole, so both are capped (a hostile or broken
    source otherwise decides how much memory the mount, a root process, takes)."""

    max_index_bytes: int = 32 * 1024 * 1024  # one directory index page
    max_entries: int = 1_500_000  # files and directories of the whole listing
    max_listing_bytes: int = 64 * 1024 * 1024  # the paths of the listing's files and directories, summed


class StagingWriteError(OSError):
    """Writing a fetched item's staged copy failed (a full or failing cache disk): the cache's
    problem, never counted against the remote."""


@dataclass
class _FetchState:
    """What one item's fetch has staged so far, carried from one try to the next."""

    offset: int = 0
    crc: int = 0
    validator: item_stream.Validator | None = None

    def restart(self, reset: Callable[[], None]) -> None:
        if self.offset:
            reset()
        self.offset = 0
        self.crc = 0
