"""Prometheus exposition of the data manager's state, rendered from the state on each scrape.

A custom collector on a private registry (not the global one): gauges always equal the current
state, nothing goes stale when a client disappears, and several apps can live in one process
(tests).
"""

from __future__ import annotations

import math

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# Histogram buckets a client may report (fuse_client.accounting.LATENCY_BUCKETS_S has 17 + Inf).
_MAX_BUCKETS = 64


def _number(value) -> float | None:
    """A finite, non-negative number from a client's stats, or None (stats are untrusted input)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int past a float's range (stats stored before the API refused them)
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _histogram(value) -> tuple[list[tuple[str, float]], float] | None:
    """Validated Prometheus buckets [(le, cumulative)] and sum from a stats histogram, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("buckets"), list):
        return None
    buckets: list[tuple[str, float]] = []
    last = 0.0
    for pair in value["buckets"][:_MAX_BUCKETS]:
        if not isinstance(pair, list) or len(pair) != 2:
            return None
        le, count = pair
        count = _number(count)
        if count is None or count < last:
            return None
        if le == "+Inf":
            buckets.append(("+Inf", count))
            break
        le = _number(le)
        if le is None:
            return None
        buckets.append((repr(float(le)), count))
        last = count
    total = _number(value.get("sum_s"))
    if not buckets or buckets[-1][0] != "+Inf" or total is None:
        return None
    return buckets, total


_OPEN_MODES = ("passthrough", "kernel_cache", "daemon")  # FrontendCounters.<mode>_opens in the stats
_BACKENDS = ("raw", "libfuse")


def _data_plane_metrics(clients: list[dict]):
    """Per mount (node, dataset, job): bytes by kind, open latency, remote errors, breaker state."""
    labels = ["node", "dataset", "job"]
    read = CounterMetricFamily("silod_job_read_bytes", "Bytes the job read through its mount, by where they came from.", labels=[*labels, "source"])
    remote = CounterMetricFamily("silod_job_remote_fetched_bytes", "Bytes the job's mount fetched from the remote store.", labels=labels)
    errors = CounterMetricFamily("silod_job_remote_errors", "Failed remote requests of the job's mount (each retry and probe counts).", labels=labels)
    failed = CounterMetricFamily("silod_job_failed_opens", "Opens answered with EIO (remote failures and circuit-breaker rejections).", labels=labels)
    breaker = GaugeMetricFamily("silod_remote_breaker_open", "1 while the mount's circuit breaker for its remote is open (opens of uncached items fail fast).", labels=labels)
    latency = HistogramMetricFamily("silod_job_open_latency_seconds", "Latency of opens through the mount, hits and misses apart.", labels=[*labels, "result"])
    # How the kernel serves the mount's reads: passthrough and kernel-cache opens are read by the
    # kernel (accounted whole at open); daemon opens and READ requests go through the mount process.
    opens = CounterMetricFamily("silod_job_opens", "Opens through the mount by how the kernel serves their reads (passthrough: the kernel reads the cached file itself).", labels=[*labels, "mode"])
    reads = CounterMetricFamily("silod_job_fuse_read_requests", "READ requests that reached the mount process (0 for passthrough opens).", labels=labels)
    # A full or failing cache disk is the cache's problem, not the remote's: named by its directory.
    disk = CounterMetricFamily("silod_job_cache_disk_errors", "Writes the mount's cache disk refused (full, failing); those misses were staged in memory and served uncached.", labels=[*labels, "cache_dir"])
    staged = CounterMetricFamily("silod_job_memory_staged_items", "Misses the mount staged in memory because its cache disk refused them.", labels=labels)
    frontend = GaugeMetricFamily("silod_mount_info", "1 per mount, labelled with its FUSE front end (raw or libfuse) and whether passthrough is on.", labels=[*labels, "fuse_backend", "passthrough"])
    for c in clients:
        stats = c.get("stats") or {}
        if not isinstance(stats, dict):
            continue
        key = [str(c.get("node")), str(c.get("dataset")), str(c.get("job"))]
        for source in ("hit", "miss"):
            if (v := _number(stats.get(f"{source}_bytes"))) is not None:
                read.add_metric([*key, source], v)
            if (h := _histogram(stats.get(f"open_latency_{source}"))) is not None:
                latency.add_metric([*key, source], buckets=h[0], sum_value=h[1])
        for mode in _OPEN_MODES:
            if (v := _number(stats.get(f"{mode}_opens"))) is not None:
                opens.add_metric([*key, mode], v)
        backend, passthrough = stats.get("fuse_backend"), stats.get("passthrough")
        if backend in _BACKENDS and isinstance(passthrough, bool):
            frontend.add_metric([*key, backend, str(passthrough).lower()], 1.0)
        for family, name in ((remote, "remote_bytes"), (errors, "remote_errors"), (failed, "failed_opens"), (reads, "read_requests")):
            if (v := _number(stats.get(name))) is not None:
                family.add_metric(key, v)
        if (v := _number(stats.get("cache_disk_errors"))) is not None:
            disk.add_metric([*key, str(stats.get("cache_dir"))], v)
        if (v := _number(stats.get("memory_staged_items"))) is not None:
            staged.add_metric(key, v)
        state = stats.get("remote_breaker_state")
        if state in ("open", "closed"):
            breaker.add_metric(key, 1.0 if state == "open" else 0.0)
    yield from (read, remote, errors, failed, breaker, latency, opens, reads, frontend, disk, staged)


class _StateCollector:
    def __init__(self, store) -> None:
        self.store = store

    def collect(self):
        status = self.store.status()
        alloc = GaugeMetricFamily("silod_dataset_cache_allocated_bytes", "Cache allocated to the dataset (per node cache).", labels=["dataset"])
        for name, ds in status["datasets"].items():
            if ds["allocated_bytes"] is not None:
                alloc.add_metric([name], ds["allocated_bytes"])
        yield alloc
        cached = GaugeMetricFamily("silod_dataset_cached_bytes", "Bytes of the dataset in the node's cache.", labels=["node", "dataset"])
        items = GaugeMetricFamily("silod_dataset_cached_items", "Items of the dataset in the node's cache.", labels=["node", "dataset"])
        effective = GaugeMetricFamily("silod_job_effective_cached_bytes", "Cached bytes that will serve hits to the job in its current epoch.", labels=["node", "dataset", "job"])
        rate = GaugeMetricFamily("silod_job_remote_rate_bytes_per_second", "Observed remote fetch rate of the job's mount.", labels=["node", "job"])
        tput = GaugeMetricFamily("silod_job_read_throughput_bytes_per_second", "Observed read throughput of the job's mount.", labels=["node", "job"])
        for node, n in status["nodes"].items():
            for ds_name, ds in n["datasets"].items():
                cached.add_metric([node, ds_name], ds["cached_bytes"])
                items.add_metric([node, ds_name], ds["items_cached"])
                for job, j in ds["jobs"].items():
                    if j["effective_cached_bytes"] is not None:
                        effective.add_metric([node, ds_name, job], j["effective_cached_bytes"])
                    if j["remote_rate_bytes_per_s"] is not None:
                        rate.add_metric([node, job], j["remote_rate_bytes_per_s"])
                    if j["throughput_bytes_per_s"] is not None:
                        tput.add_metric([node, job], j["throughput_bytes_per_s"])
        yield from (cached, items, effective, rate, tput)
        io = GaugeMetricFamily("silod_job_remote_io_allocated_bytes_per_second", "Remote IO allocated to the job (all workers).", labels=["job"])
        for job_id, j in status["jobs"].items():
            if j["remote_io_bytes_per_s"] is not None:
                io.add_metric([job_id], j["remote_io_bytes_per_s"])
        yield io
        live = GaugeMetricFamily("silod_clients_live", "FUSE clients that sent a heartbeat recently.")
        live.add_metric([], sum(1 for c in status["clients"] if c["live"]))
        yield live
        yield from _data_plane_metrics(status["clients"])


def render_metrics(store) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StateCollector(store))
    return generate_latest(registry), CONTENT_TYPE_LATEST
