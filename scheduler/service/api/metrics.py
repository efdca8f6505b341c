"""Prometheus metrics, read from the service at scrape time.

A collector (rather than gauges updated by the loop) keeps the figures consistent with the
database even when several processes read it, and costs nothing between scrapes. Each app has
its own registry so that several services in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from scheduler.service.db.models import JobState
from scheduler.service.scheduler_process import SchedulerService


class ServiceCollector(Collector):
    def __init__(self, service: SchedulerService):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        c = self.service.cluster()
        jobs = GaugeMetricFamily("silod_jobs", "Jobs by state", labels=["state"])
        for state in JobState:
            jobs.add_metric([state.value], c.jobs_by_state.get(state.value, 0))
        yield jobs
        for name, help_text, total, used in (
            ("gpus", "GPUs", c.capacity.gpus, c.gpus_used),
            ("cache_bytes", "Dataset cache, bytes", c.capacity.cache, c.cache_used),
            ("remote_io_bytes_per_second", "Remote IO, bytes/s", c.capacity.remote_io, c.remote_io_used),
        ):
            yield GaugeMetricFamily(f"silod_{name}_total", f"{help_text} in the cluster", value=total)
            yield GaugeMetricFamily(f"silod_{name}_allocated", f"{help_text} allocated", value=used)
        cpus_used, bound = self.service.cpu_and_bottlenecks()
        if c.capacity.manages_cpu:
            yield GaugeMetricFamily("silod_cpus_total", "CPU cores for input pipelines in the cluster", value=c.capacity.cpus)
            yield GaugeMetricFamily("silod_cpus_allocated", "CPU cores allocated to running jobs", value=cpus_used)
        by_bound = GaugeMetricFamily("silod_running_jobs_bound", "Running jobs by the resource that bounds them now",
                                     labels=["resource"])
        for resource, n in bound.items():
            by_bound.add_metric([resource], n)
        yield by_bound
        yield CounterMetricFamily("silod_rounds", "Scheduling rounds run by this process", value=self.service.rounds_total)
        durations = self.service.round_durations
        yield GaugeMetricFamily(
            "silod_round_duration_seconds_last", "Wall time of the last scheduling round",
            value=durations[-1] if durations else 0.0,
        )
        yield GaugeMetricFamily(
            "silod_datamanager_push_failing", "1 when the last push to the data manager failed",
            value=1.0 if c.last_push_error else 0.0,
        )


def make_registry(service: SchedulerService) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    return registry


def metrics_response(registry: CollectorRegistry) -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
