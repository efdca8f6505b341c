"""Prometheus exposition of the data manager's state, rendered from the state on each scrape.

A custom collector on a private registry (not the global one): gauges always equal the current
state, nothing goes stale when a client disappears, and several apps can live in one process
(tests).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily


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


def render_metrics(store) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StateCollector(store))
    return generate_latest(registry), CONTENT_TYPE_LATEST
