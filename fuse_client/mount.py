"""`silod mount`: wire listing, cache, throttle, accounting and the manager link to a FUSE mount.

Threads of a mount process:
- `silod-fuse-loop` runs libfuse's loop, whose worker threads (up to --fuse-threads) run the
  FUSE operations (fs.py); a hit is served entirely on its worker thread;
- `silod-fetch-*` (up to --fetch-workers) run remote fetches, one per item in flight
  (dataplane.py), so misses never occupy the threads that serve hits;
- `silod-verify` (only after a crash) checksums the cached items in the background;
- `silod-probe` (only while the circuit breaker is open) asks the remote until it answers;
- the main thread waits for SIGINT/SIGTERM and unmounts cleanly (see `_serve`);
- `silod-control` applies allocation changes (eviction) and writes the stats file twice a second;
- `silod-manager-link` (with --manager) heartbeats and pulls the allocation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from estimator.errors import UserError
from fuse_client.accounting import JobAccounting
from fuse_client.cache_store import UNLIMITED_BYTES, DatasetCache, RecoveryReport
from fuse_client.lru_cache import CacheMode
from contract.names import validate_name
from fuse_client.pod_attribution import PodAttribution

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
# Default FUSE worker threads: a data loader with 8-16 workers per GPU and 8 GPUs has up to ~128
# opens in flight, several nodes' worth of jobs may share a mount's dataset, and under libfuse a
# slow miss occupies a thread until its fetch completes. Threads start on demand (an idle mount
# has a few), so the bound is memory (~0.1 MB per waiting open), not a pool sized to the loader:
# 768 opens may wait at once before EAGAIN (fs.waiting_open_cap).
DEFAULT_FUSE_THREADS = 1024
BACKENDS = ("auto", "raw", "libfuse")
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class MountConfig:
    mountpoint: Path
    source: str
    dataset: str
    job: str
    cache_dir: Path
    cache_size: int | None  # None: leave the node's shared allocation as it is
    io_rate: float  # bytes/s; inf = unthrottled
    manager: str | None
    stats_file: Path | None
    kernel_cache: bool = True
    node: str = socket.gethostname()
    cache_mode: CacheMode | None = None  # None: leave the node's mode for the dataset as it is
    allow_other: bool = False  # the node agent's mounts: pods of other uids read them through bind mounts
    fuse_threads: int = DEFAULT_FUSE_THREADS
    pod_stats: bool = False  # count reads per pod (caller's cgroup) into the stats file's "pods"
    fetch_workers: int = 16
    slow_fetches: int = 64  # the slow lane of the fetch pool (fetch_lanes.py)
    max_index_bytes: int = 32 * 1024 * 1024  # one directory index page of an http(s) source
    max_listing_entries: int = 1_500_000
    max_listing_bytes: int = 64 * 1024 * 1024  # the listed paths, summed (the listing's memory)
    max_inflight_bytes: int | None = None  # fetched data in memory at once; None: what the lanes hold
    memory_staging_bytes: int = 256 * 1024 * 1024  # misses staged in memory while the cache disk refuses
    # Misses of items this large are read while they arrive (dataplane.py); None: never.
    stream_min_bytes: int | None = 8 * 1024 * 1024
    open_deadline_s: float = 5.0
    breaker_threshold: int = 5
    probe_interval_s: float = 1.0
    fuse_backend: str = "auto"  # auto | raw | libfuse (see fuse_client/frontend.py)
    passthrough: bool = True  # raw backend: open cached items in FUSE passthrough mode


def validate_mountpoint(path: Path) -> None:
    if not path.exists():
        raise UserError(f"mount point {str(path)!r} does not exist; create an empty directory first")
    if not path.is_dir():
        raise UserError(f"mount point {str(path)!r} is not a directory")
    if os.path.ismount(path):
        raise UserError(f"mount point {str(path)!r} is already a mount point; unmount it first (fusermount3 -u)")
    if any(os.scandir(path)):
        raise UserError(f"mount point {str(path)!r} is not empty; mount onto an empty directory")


def check_fuse_available() -> None:
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse is missing; load the fuse module or run the container with --device /dev/fuse")
    if shutil.which("fusermount3") is None and os.geteuid() != 0:
        raise UserError("fusermount3 is not installed; install the fuse3 package")


class ControlLoop:
    """Applies the current allocation to the shared cache and writes the stats file."""

    def __init__(self, cfg: MountConfig, cache: DatasetCache, accounting: JobAccounting, throttle, dataset_bytes: int) -> None:
        self.cfg = cfg
        self.cache = cache
        self.accounting = accounting
        self.throttle = throttle
        self.dataset_bytes = dataset_bytes
        self._lock = threading.Lock()
        self._cache_bytes: int | None = cfg.cache_size
        self._pending_cache = cfg.cache_size is not None
        self._cache_mode: CacheMode | None = cfg.cache_mode
        self._pending_mode = cfg.cache_mode is not None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.link = None  # the ManagerLink with --manager; its `connected` goes into the stats
        self.recovery: RecoveryReport | None = None
        self.breaker = None  # the resolver's CircuitBreaker, reported in the stats
        self.resolver = None  # the ItemResolver: its fetch lanes and memory staging go into the stats
        self.verifier: BackgroundVerifier | None = None
        self.frontend = None  # the serving front end (frontend.Frontend), reported in the stats
        self._last_sweep = 0.0
        # Identifies this mount process in the stats file: counters restart from 0 in a new one,
        # which is how the node agent knows to carry the old totals over (agent/reporter.py).
        self.instance = uuid.uuid4().hex

    # Called by ManagerLink with what the manager says; None fields keep the current value.
    def on_allocation(self, pulled) -> None:
        if pulled.remote_io_bytes_per_s is not None:
            rate = float(pulled.remote_io_bytes_per_s)
            if rate != self.throttle.rate:
                try:
                    self.cache.save_io_rate(self.cfg.job, rate)
                except (OSError, sqlite3.Error) as exc:  # a full cache disk: the rate still applies
                    log.warning("saving the IO rate of job %s in the cache index failed: %s", self.cfg.job, exc)
            self.throttle.set_rate(rate)
        mode = getattr(pulled, "cache_mode", None)
        if mode is not None:
            with self._lock:
                if mode != self._cache_mode:
                    self._cache_mode = CacheMode(mode)
                    self._pending_mode = True
        if pulled.cache_bytes is not None:
            with self._lock:
                if pulled.cache_bytes != self._cache_bytes:
                    self._cache_bytes = int(pulled.cache_bytes)
                    self._pending_cache = True
            if self._thread is None:
                self.apply_cache_allocation()

    def apply_cache_allocation(self) -> None:
        with self._lock:
            pending, value = self._pending_cache, self._cache_bytes
            self._pending_cache = False
            mode_pending, mode = self._pending_mode, self._cache_mode
            self._pending_mode = False
        if mode_pending and mode is not None:
            evicted = self.cache.set_mode(mode)
            if evicted:
                self.accounting.items_evicted(evicted)
            log.info("cache mode of %s is now %s", self.cfg.dataset, mode.value)
        else:
            self.cache.refresh_mode()  # another mount of the dataset may have switched it
        self.cache.flush_recency()
        if pending and value is not None:
            evicted = self.cache.set_allocation(min(value, UNLIMITED_BYTES))
            if evicted:
                self.accounting.items_evicted(evicted)
                log.info("cache allocation of %s is now %d bytes; evicted %d bytes", self.cfg.dataset, value, evicted)
        else:
            # Another mount of the dataset may have lowered the shared allocation.
            evicted = self.cache.enforce_allocation()
            if evicted:
                self.accounting.items_evicted(evicted)

    def stats(self) -> dict:
        snap = self.accounting.snapshot(time.monotonic())
        usage = self.cache.usage()
        out = asdict(snap)
        out.update(
            cached_bytes=usage.cached_bytes,
            items_cached=usage.items_cached,
            cache_allocation_bytes=None if usage.allocation_bytes >= UNLIMITED_BYTES else usage.allocation_bytes,
            cache_mode=self.cache.mode.value,
            effective_cached_bytes=max(0, usage.cached_bytes - snap.ineffective_cached_bytes),
            io_rate_bytes_per_s=None if math.isinf(self.throttle.rate) else self.throttle.rate,
            dataset=self.cfg.dataset,
            job=self.cfg.job,
            dataset_bytes=self.dataset_bytes,
            manager_connected=None if self.link is None else self.link.connected,
            cache_verify_pending=self.cache.verify_pending,
            # Fetched items admitted, and the index transactions that admitted them (group commit).
            cache_admission_commits=self.cache.admission_commits,
            cache_verified_items=None if self.verifier is None else self.verifier.checked,
            updated_at=time.time(),
            # CPU seconds this mount process has used (all its threads): what serving misses
            # costs the cores a job's own compute shares (benchmarks/bench_pytorch_estimator.py).
            process_cpu_s=time.process_time(),
            instance=self.instance,
        )
        if self.cfg.pod_stats:
            out["pods"] = self.accounting.pod_snapshot()
        if self.breaker is not None:
            out.update(
                remote_breaker_state=self.breaker.state.value,
                remote_breaker_opened_total=self.breaker.times_opened,
                remote_breaker_rejected_opens=self.breaker.rejected,
                remote_consecutive_failures=self.breaker.consecutive_failures,
                remote_last_error=self.breaker.last_error or None,
            )
        if self.resolver is not None:
            out["fetch_lanes"] = self.resolver.lanes_snapshot()
            out.update(self.resolver.memory_staging.snapshot(), cache_dir=str(self.cfg.cache_dir))
        if self.frontend is not None:
            out.update(self.frontend.stats())
        if self.recovery is not None:
            out.update(recovery_clean=self.recovery.clean if self.recovery.ran else None,
                       recovery_seconds=self.recovery.seconds)
        return out

    def write_stats(self) -> None:
        if self.cfg.stats_file is None:
            return
        data = json.dumps(self.stats(), indent=1).encode()
        tmp = self.cfg.stats_file.with_name(f".{self.cfg.stats_file.name}.{os.getpid()}.tmp")
        # 0600: the stats name the dataset's files and reads (issue 47: they were 0644).
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
        os.replace(tmp, self.cfg.stats_file)  # readers see the old or the new file, never a torn one

    def tick(self) -> None:
        try:
            if self.cache.verify_pending:
                self.cache.refresh_verify_pending()  # another mount may have finished verifying
            self.apply_cache_allocation()
            now = time.time()
            if now - self._last_sweep > 5:
                self.cache.sweep_transient(now)
                self._last_sweep = now
        except Exception:
            log.exception("applying the cache allocation failed; will retry")
        try:
            self.write_stats()
        except Exception:
            log.exception("writing the stats file failed; will retry")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="silod-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(STATS_INTERVAL_S):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class BackgroundVerifier:
    """After a crash: checksum every cached item once, in key order, then clear verify_pending.

    Hits verify their own item first (dataplane.py), so this only bounds how long the cache
    stays in the post-crash state; progress is in the stats (`cache_verified_items`).
    """

    def __init__(self, cache: DatasetCache, batch: int = 256) -> None:
        self.cache = cache
        self.batch = batch
        self.checked = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silod-verify", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        after = ""
        try:
            while not self._stop.is_set():
                last, checked, dropped = self.cache.verify_batch(after, self.batch)
                self.checked += checked
                self.dropped += dropped
                if last is None:
                    self.cache.finish_verification()
                    log.info("cache of %s verified after a crash: %d items checked, %d dropped",
                             self.cache.root.name, self.checked, self.dropped)
                    return
                after = last
        except Exception:
            log.exception("background verification of the cache failed; hits keep verifying lazily")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _unmount(mountpoint: Path) -> None:
    for cmd in (["fusermount3", "-u", str(mountpoint)], ["fusermount3", "-u", "-z", str(mountpoint)], ["umount", "-l", str(mountpoint)]):
        try:
            if subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            continue


def _serve(fuse_main, mountpoint: Path, on_signal) -> None:
    """Run the FUSE loop in a worker thread and handle SIGINT/SIGTERM in Python's main thread.

    libfuse installs its own SIGINT/SIGTERM handlers only where the disposition is SIG_DFL and
    only stops its loop when the signal happens to hit the thread blocked in the loop; a worker
    blocked in a throttled fetch would also keep it alive. So: Python handlers (installed first,
    so libfuse leaves them alone) wake blocked fetches and unmount; unmounting ends the loop.
    With files still open the unmount is lazy and the loop serves them until they are closed.

    The handler only records the signal: an exception raised by a signal handler inside
    Thread.join marks the joined thread as finished although it still runs (CPython 3.11's
    `_wait_for_tstate_lock`), which made this process exit under its still-open files.
    """
    error: list[BaseException] = []
    done = threading.Event()
    received: list[int] = []

    def run() -> None:
        try:
            fuse_main()
        except BaseException as exc:  # surfaced in the main thread below
            error.append(exc)
        finally:
            done.set()

    def handler(signum, frame) -> None:
        received.append(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=run, name="silod-fuse-loop")
    thread.start()
    handled = 0
    try:
        while not done.wait(0.1):
            if len(received) > handled:
                handled = len(received)
                log.info("received %s; unmounting %s", signal.Signals(received[-1]).name, mountpoint)
                on_signal()
                _unmount(mountpoint)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    thread.join()
    if error:
        raise error[0]


# --stream-min-size's range: below 64 KiB a miss is one chunk anyway (nothing to read early);
# above 1 TiB it is no threshold but a typo (`off` says "never").
STREAM_MIN_LOW, STREAM_MIN_HIGH = 64 * 1024, 1 << 40


def parse_stream_min(text: str) -> int | None:
    """--stream-min-size: a size, or `off` (None: no streaming opens)."""
    from estimator.units import UnitError, parse_size

    if text.strip().lower() == "off":
        return None
    try:
        return int(parse_size(text, what="--stream-min-size"))
    except UnitError as exc:
        raise UnitError(f"{exc}; or off to turn streaming opens off") from None


def validate_tuning(cfg: MountConfig) -> None:
    if not 1 <= cfg.fuse_threads <= 4096:
        raise UserError(f"--fuse-threads {cfg.fuse_threads}: must be between 1 and 4096")
    if not 1 <= cfg.fetch_workers <= 1024:
        raise UserError(f"--fetch-workers {cfg.fetch_workers}: must be between 1 and 1024")
    if not 0 <= cfg.slow_fetches <= 4096:
        raise UserError(f"--slow-fetches {cfg.slow_fetches}: must be between 0 and 4096")
    if cfg.max_index_bytes < 1024:
        raise UserError(f"--max-index-bytes {cfg.max_index_bytes}: must be at least 1 KiB")
    if cfg.max_listing_entries < 1:
        raise UserError(f"--max-listing-entries {cfg.max_listing_entries}: must be >= 1")
    if cfg.max_inflight_bytes is not None and cfg.max_inflight_bytes < 64 * 1024:
        raise UserError(f"--max-inflight-bytes {cfg.max_inflight_bytes}: must be at least 64 KiB")
    if cfg.max_listing_bytes < 1024:
        raise UserError(f"--max-listing-bytes {cfg.max_listing_bytes}: must be at least 1 KiB")
    if cfg.stream_min_bytes is not None and not STREAM_MIN_LOW <= cfg.stream_min_bytes <= STREAM_MIN_HIGH:
        raise UserError(f"--stream-min-size {cfg.stream_min_bytes} bytes: must be between 64 KiB and 1 TiB "
                        f"(write e.g. 8MiB), or off to open every miss only once its last byte is staged")
    if cfg.memory_staging_bytes < 0:
        raise UserError(f"--memory-staging {cfg.memory_staging_bytes}: must be >= 0 bytes")
    if not (0 < cfg.open_deadline_s <= 3600):
        raise UserError(f"--open-deadline {cfg.open_deadline_s}: must be > 0 and <= 3600 seconds")
    if not 1 <= cfg.breaker_threshold <= 10_000:
        raise UserError(f"--breaker-threshold {cfg.breaker_threshold}: must be between 1 and 10000")
    if not (0 < cfg.probe_interval_s <= 3600):
        raise UserError(f"--probe-interval {cfg.probe_interval_s}: must be > 0 and <= 3600 seconds")
    if cfg.fuse_backend not in BACKENDS:
        raise UserError(f"--fuse-backend {cfg.fuse_backend!r}: must be one of {', '.join(BACKENDS)}")
    if not cfg.io_rate > 0:  # a rate of 0 would block every uncached read forever
        raise UserError(f"--io-rate {cfg.io_rate:g}: must be above 0 (leave it out for an unthrottled mount)")


def validate_paths(cfg: MountConfig) -> None:
    """The cache must not live under the mount (the mount would hide it, and its own reads of
    the cache would re-enter the FUSE server: a deadlock in D state), nor the mount under the
    cache; the stats file must be writable. Checked before anything is mounted."""
    mnt = Path(os.path.realpath(cfg.mountpoint))
    cache = Path(os.path.realpath(cfg.cache_dir))
    if cache == mnt or cache.is_relative_to(mnt):
        raise UserError(f"--cache-dir {str(cfg.cache_dir)!r} is inside the mount point {str(cfg.mountpoint)!r}; "
                        "put the cache outside it")
    if mnt.is_relative_to(cache):
        raise UserError(f"mount point {str(cfg.mountpoint)!r} is inside --cache-dir {str(cfg.cache_dir)!r}; "
                        "mount outside the cache directory")
    if cfg.stats_file is not None:
        stats = cfg.stats_file
        if not stats.parent.is_dir():
            raise UserError(f"--stats-file {str(stats)!r}: directory {str(stats.parent)!r} does not exist")
        if stats.is_dir():
            raise UserError(f"--stats-file {str(stats)!r} is a directory; name a file")
        # Written as a temporary file renamed over it (ControlLoop.write_stats): try exactly that.
        probe = stats.with_name(f".{stats.name}.{os.getpid()}.tmp")
        try:
            with open(probe, "wb"):
                pass
            os.replace(probe, probe)
        except OSError as exc:
            raise UserError(f"--stats-file {str(stats)!r} cannot be written ({exc.strerror}); "
                            "name a file in a writable directory") from None
        finally:
            try:
                probe.unlink()
            except OSError:
                pass


def run_mount(cfg: MountConfig) -> int:
    """Mount and serve until unmounted or signalled. Raises UserError on bad input before mounting."""
    # Every open is a hand-off between threads (FUSE reader, open pool, fetch pool, fsspec's
    # I/O loop); a thread woken for one waits for the GIL up to the switch interval (5 ms by
    # default) whenever another holds it, and a miss crosses several such hand-offs.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    validate_name(cfg.dataset, "--dataset")
    validate_name(cfg.job, "--job")
    validate_tuning(cfg)
    validate_paths(cfg)
    validate_mountpoint(cfg.mountpoint)
    check_fuse_available()

    from fuse_client.breaker import CircuitBreaker, RetryPolicy
    from fuse_client.dataplane import ItemResolver
    from fuse_client.frontend import Frontend
    from fuse_client.operations import DatasetOperations
    from fuse_client.manager_link import ClientRegistration, ManagerLink
    from contract.credentials import ANONYMOUS_ENV, SourceCredential
    from fuse_client.remote import ListingLimits, RemoteStore
    from fuse_client.token_bucket import Throttle
    from contract.uri_policy import ENV as ALLOWED_URIS_ENV, UriPolicy

    from fuse_client import listing_snapshot

    allow = None
    if os.environ.get(ALLOWED_URIS_ENV):  # the operator's allow-list, with the host resolved now
        allow = UriPolicy.from_env()
        allow.check(cfg.source, resolve=True)
    # Token waits are bounded too: a paused job's opens fail after the deadline (token_bucket.py).
    throttle = Throttle(cfg.io_rate, deadline_s=cfg.open_deadline_s)
    # The tenant's credential (or anonymous access) from the backend, never ambient cluster keys.
    # Every request, redirect and connection of the store is held to `allow` (safe_http.py).
    store = RemoteStore(cfg.source, RetryPolicy(deadline_s=cfg.open_deadline_s), credential=SourceCredential.from_env(),
                        anonymous=os.environ.get(ANONYMOUS_ENV) == "1", allow=allow,
                        limits=ListingLimits(cfg.max_index_bytes, cfg.max_listing_entries, cfg.max_listing_bytes))
    snapshot = listing_snapshot.snapshot_path(cfg.cache_dir / cfg.dataset)
    listing = listing_snapshot.load(snapshot, cfg.source) if snapshot.parent.is_dir() else None
    if listing is not None:
        try:
            # Our own credentials must still reach the source before we trust an old listing.
            store.probe(next(iter(listing.files.values())))
        except Exception as exc:
            log.info("not using the listing snapshot of %s: %s", cfg.source, exc)
            listing = None
    listed_now = listing is None
    if listed_now:
        listing = store.list()
    # Only now, with every input checked, touch the local disk.
    try:
        cfg.cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--cache-dir {str(cfg.cache_dir)!r} cannot be created: {exc.strerror}") from exc
    cache = DatasetCache(cfg.cache_dir, cfg.dataset)
    recovery = cache.attach()
    if recovery.ran and not recovery.clean:
        log.warning("cache of %s was not unmounted cleanly: repaired %d items in flight, verifying the rest "
                    "lazily and in the background (%s)", cfg.dataset, recovery.journaled, recovery)
    accounting = JobAccounting(num_items=len(listing.files))
    control = ControlLoop(cfg, cache, accounting, throttle, listing.total_bytes)
    control.recovery = recovery
    control.apply_cache_allocation()

    link = None
    if cfg.manager:
        reg = ClientRegistration(
            client_id=f"{cfg.node}-{cfg.job}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            node=cfg.node, dataset=cfg.dataset, job=cfg.job, source=cfg.source,
            mountpoint=str(cfg.mountpoint), pid=os.getpid(),
        )
        link = ManagerLink(cfg.manager, reg, control.stats, control.on_allocation)
        control.link = link
        saved = cache.saved_io_rate(cfg.job) if math.isinf(cfg.io_rate) else None
        if saved is not None:  # until the manager answers: its last word, not unthrottled
            throttle.set_rate(saved)
            log.info("job %s starts at its last IO rate from the data manager, %s B/s", cfg.job, saved)
        link.register()

    breaker = CircuitBreaker(cfg.source, threshold=cfg.breaker_threshold, probe_interval_s=cfg.probe_interval_s)
    resolver = ItemResolver(store, cache, throttle, accounting, breaker=breaker, fetch_workers=cfg.fetch_workers,
                            slow_fetches=cfg.slow_fetches, memory_staging_bytes=cfg.memory_staging_bytes,
                            max_inflight_bytes=cfg.max_inflight_bytes, stream_min_bytes=cfg.stream_min_bytes)
    control.breaker = breaker
    control.resolver = resolver
    if recovery.ran and cache.verify_pending:
        control.verifier = BackgroundVerifier(cache)
        control.verifier.start()
    ops = DatasetOperations(listing, resolver, kernel_cache=cfg.kernel_cache,
                            attribution=PodAttribution() if cfg.pod_stats else None)
    frontend = Frontend(cfg, ops, cache.root)
    control.frontend = frontend
    try:
        frontend.prepare()  # the raw backend mounts here (and may fall back); libfuse mounts in serve()
        if frontend.raw is not None:  # its kept backing files of items this mount evicts close at once
            cache.on_evicted = frontend.raw.on_evicted
        log.info("serving %s with the %s front end", cfg.mountpoint, frontend.describe())
        control.tick()
        control.start()
        if link is not None:
            link.start()
        threading.Thread(target=_refresh_snapshot, args=(store, snapshot, cfg.source, listing, listed_now),
                         name="silod-listing", daemon=True).start()
        _serve(frontend.serve, cfg.mountpoint, throttle.close)
    finally:
        frontend.close()
        throttle.close()
        resolver.close()
        control.stop()
        if control.verifier is not None:
            control.verifier.stop()
        if link is not None:
            link.stop()
        control.write_stats()
        # Mark the index clean only once no fetch can still touch it (they abort on the closed
        # throttle within the open deadline); otherwise the next mount repairs the journal.
        drained = _wait_until(lambda: resolver.fetches_running() == 0, cfg.open_deadline_s + 1)
        if cache.detach(clean=drained):
            log.info("cache of %s marked clean", cfg.dataset)
        cache.close()
    return 0


def _refresh_snapshot(store, path: Path, source: str, serving, listed_now: bool) -> None:
    """Save the listing for the next mount; if we started from a snapshot, list again first."""
    from fuse_client import listing_snapshot

    try:
        current = serving if listed_now else store.list()
        if not listed_now and not listing_snapshot.same(serving, current):
            log.warning("the source %s changed since the last mount (%d items now, %d served); this mount keeps "
                        "the listing it started with, the next mount sees the change", source, len(current.files), len(serving.files))
        if listed_now or not listing_snapshot.same(serving, current):
            listing_snapshot.save(path, source, current)
    except Exception as exc:
        log.warning("could not refresh the listing snapshot of %s: %s", source, exc)


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

