"""`silod mount`: registered on the shared typer app by scheduler/cli.py.

Heavy imports (mfusepy, fsspec) happen inside the command so `silod --help` stays fast.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import typer

from contract.log_level import parse_log_level


def _node_name(value: str) -> str:
    from estimator.errors import UserError

    if not re.match(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", value):
        raise UserError(f"--node {value!r} is not a node name: lower-case letters, digits, '-' and '.' (RFC 1123)")
    return value


def register(app: typer.Typer) -> None:
    @app.command("mount")
    def mount(
        mountpoint: Path = typer.Argument(..., help="Empty directory to mount the dataset on."),
        source: str = typer.Option(..., "--source", help="Dataset URL: a directory, file://, s3://bucket/prefix, http(s)://."),
        dataset: str = typer.Option(..., "--dataset", help="Dataset name; jobs with the same name share its cache."),
        job: str = typer.Option(..., "--job", help="Job id; remote IO is throttled per job."),
        cache_dir: Path = typer.Option(..., "--cache-dir", help="Local cache directory (shared by mounts on this node)."),
        cache_size: Optional[str] = typer.Option(None, "--cache-size", help="Cache allocation of the dataset, e.g. 20GB; default: keep the node's current value (unlimited on a fresh cache)."),
        cache_mode: Optional[str] = typer.Option(None, "--cache-mode", help="uniform (SiloD's, for epoch-based jobs) or lru (irregular jobs, e.g. curriculum learning); default: keep the node's current mode (uniform on a fresh cache)."),
        io_rate: Optional[str] = typer.Option(None, "--io-rate", help="Remote IO allocation of this job, e.g. 200MB/s; default: unthrottled."),
        manager: Optional[str] = typer.Option(None, "--manager", help="Data manager URL; allocations are then pulled from it every 0.5 s."),
        stats_file: Optional[Path] = typer.Option(None, "--stats-file", help="JSON stats, rewritten atomically twice a second."),
        kernel_cache: bool = typer.Option(True, "--kernel-cache/--no-kernel-cache", help="Let the kernel keep pages of cached items across opens (re-reads at page-cache speed; a kept item is accounted as read in full at open)."),
        fuse_threads: int = typer.Option(1024, "--fuse-threads", help="Most FUSE worker threads (started on demand; libfuse's max_threads). Under libfuse an open waiting for the remote holds one, and at most this less a quarter wait at once (768 by default; beyond that EAGAIN); the raw server queues waiting opens without holding a reader."),
        fetch_workers: int = typer.Option(16, "--fetch-workers", help="Most remote fetches in flight at once (a pool separate from the FUSE threads)."),
        slow_fetches: int = typer.Option(64, "--slow-fetches", help="Most fetches in the slow lane: a fetch running for over 1 s moves there (reading in 256 KiB chunks) and frees its --fetch-workers slot, so items that trickle never hold back healthy ones."),
        memory_staging: str = typer.Option("256MB", "--memory-staging", help="While the cache disk refuses writes (full, failing), misses are staged in memory up to this many bytes at once and served uncached; beyond it they fail with EIO."),
        stream_min_size: str = typer.Option("8MiB", "--stream-min-size", help="A miss of an item this large or larger returns from its open once its first bytes are staged, and each read waits only for its own bytes (the reader works while the rest arrives); smaller misses open after their last byte. 64KiB-1TiB, or off: every miss opens after its last byte."),
        max_index_bytes: str = typer.Option("32MiB", "--max-index-bytes", help="Largest directory index page of an http(s) source (read whole into memory); a larger one fails the mount with a message."),
        max_listing_entries: int = typer.Option(1_500_000, "--max-listing-entries", help="Most files and directories the source may list (the listing stays in memory: about path length + 16 bytes per item); more fails the mount with a message."),
        max_inflight_bytes: str = typer.Option("", "--max-inflight-bytes", help="Most fetched data the fetch pool holds in memory at once (a chunk waits for room before it is read); default: --fetch-workers x 4 MiB + --slow-fetches x 256 KiB."),
        max_listing_bytes: str = typer.Option("64MiB", "--max-listing-bytes", help="Most bytes the listed paths (files and directories) may take, summed (the listing stays in memory); more fails the mount with a message."),
        open_deadline: float = typer.Option(5.0, "--open-deadline", help="Seconds an open may wait for a remote that delivers nothing (connect, first byte, stalls, retries) before it fails with EIO. Token waits are not a stall: a paused job (rate 0) fails uncached opens with EAGAIN once the pause is this old; at a rate r a wait may last this plus its bytes / r."),
        breaker_threshold: int = typer.Option(5, "--breaker-threshold", help="Consecutive failed opens after which opens of uncached items fail at once with EIO until the remote answers a probe."),
        probe_interval: float = typer.Option(1.0, "--probe-interval", help="Seconds between probes of a remote whose circuit breaker is open."),
        log_level: str = typer.Option("WARNING", "--log-level", help="Python logging level."),
        fuse_backend: str = typer.Option("auto", "--fuse-backend", help="auto: the raw /dev/fuse server with FUSE passthrough (cached items read by the kernel itself) when running as root on Linux >= 6.9 and the kernel negotiates it, else libfuse; raw: always the raw server (root); libfuse: mfusepy over the system libfuse."),
        passthrough: bool = typer.Option(True, "--passthrough/--no-passthrough", help="Raw backend: open cached items in FUSE passthrough mode (reads bypass this process; each such open is accounted as a read of the whole item)."),
        allow_other: bool = typer.Option(False, "--allow-other", help="Let other users read the mount (the node agent bind-mounts it into pods; needs root)."),
        pod_stats: bool = typer.Option(False, "--pod-stats", help="Also count reads per pod (the calling process's kubepods cgroup) into the stats file's \"pods\" (the node agent's mounts)."),
        node: Optional[str] = typer.Option(None, "--node", help="Node name the mount registers with the data manager under (a node-bound agent token acts only for its node); default: the host name."),
    ) -> None:
        """Mount a dataset read-only with uniform (or LRU) caching and per-job remote-IO throttling."""
        import logging

        from estimator.errors import UserError
        from estimator.units import parse_rate, parse_size
        from fuse_client.lru_cache import parse_mode
        from fuse_client.mount import MountConfig, parse_stream_min, run_mount

        level = parse_log_level(log_level).upper()
        try:
            mode = None if cache_mode is None else parse_mode(cache_mode)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        cfg = MountConfig(
            mountpoint=mountpoint.absolute(),
            source=source,
            dataset=dataset,
            job=job,
            cache_dir=cache_dir.absolute(),
            cache_size=None if cache_size is None else int(parse_size(cache_size, what="--cache-size")),
            io_rate=math.inf if io_rate is None else parse_rate(io_rate, what="--io-rate"),
            manager=manager,
            stats_file=None if stats_file is None else stats_file.absolute(),
            kernel_cache=kernel_cache,
            cache_mode=mode,
            allow_other=allow_other,
            pod_stats=pod_stats,
            fuse_threads=fuse_threads,
            fetch_workers=fetch_workers,
            slow_fetches=slow_fetches,
            max_index_bytes=int(parse_size(max_index_bytes, what="--max-index-bytes")),
            max_listing_entries=max_listing_entries,
            max_listing_bytes=int(parse_size(max_listing_bytes, what="--max-listing-bytes")),
            max_inflight_bytes=int(parse_size(max_inflight_bytes, what="--max-inflight-bytes")) if max_inflight_bytes else None,
            memory_staging_bytes=int(parse_size(memory_staging, what="--memory-staging")),
            stream_min_bytes=parse_stream_min(stream_min_size),
            open_deadline_s=open_deadline,
            breaker_threshold=breaker_threshold,
            probe_interval_s=probe_interval,
            fuse_backend=fuse_backend,
            passthrough=passthrough,
            **({} if node is None else {"node": _node_name(node)}),
        )
        raise typer.Exit(run_mount(cfg))
