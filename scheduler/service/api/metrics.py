"""Prometheus metrics, read from the service at scrape time.

A collector (rather than gauges updated by the loop) keeps the figures consistent with the
database even when several processes read it, and costs nothing between scrapes. Each app has
its own registries so that several services in one process (tests) do not collide.

Two views: the cluster totals, which a scrape without a token gets (when SILOD_METRICS_TOKEN is
not set), and the totals with every per-job and per-dataset series, which name tenants, their
jobs and datasets: only for the metrics token or an admin's (issue 20: an anonymous scrape read
every tenant's names, which /v1/cluster hides from other tenants).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from sqlalchemy import func, select

from scheduler.service.db.models import Job, JobState
from scheduler.service.overview import Overview
from scheduler.service.scheduler_process import SchedulerService
from scheduler.service.types import Principal


class ServiceCollector(Collector):
    def __init__(self, service: SchedulerService, per_job: bool):
        self.service = service
        self.per_job = per_job  # the per-job and per-dataset series (names of tenants, jobs, datasets)

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
        with self.service.sessions() as s:
            admitted = s.scalar(select(func.count()).select_from(Job).where(Job.start_time.is_not(None))) or 0
        yield CounterMetricFamily("silod_jobs_admitted", "Jobs that have been started at least once",
                                  value=int(admitted))
        if self.per_job:
            # Only the waiting jobs that get series are read (12,000 queued jobs are 500 rows here).
            yield from overview_metrics(self.service.overview(Principal("metrics", is_admin=True),
                                                              queue_limit=MAX_WAITING_SERIES))
        else:
            # overview.py's waiting jobs: the active ones that do not hold GPUs, i.e. the queued
            yield GaugeMetricFamily("silod_queue_length", QUEUE_LENGTH_HELP, value=c.jobs_by_state.get(JobState.QUEUED.value, 0))


# Per-job and per-dataset gauges (docs/observability.md lists them; deploy/grafana's dashboard
# and tests/test_observability.py check the dashboard against this table).
JOB_GAUGES = {
    "silod_job_gpus": "GPUs the job holds (0 while it waits)",
    "silod_job_remote_io_allocated_bytes_per_second": "Remote IO cap allocated to the running job",
    "silod_job_cache_allocated_bytes": "Cache allocated to the running job's dataset (shared by its readers)",
    "silod_job_hit_ratio": "Measured cache hit ratio of the running job's reads (bytes)",
    "silod_job_throughput_bytes_per_second": "Measured read throughput of the running job",
    "silod_job_ideal_throughput_bytes_per_second": "f*: the job's throughput when IO is not the bottleneck",
    "silod_job_predicted_throughput_bytes_per_second": "SiloDPerf of the running job's allocation",
    "silod_job_progress_ratio": "Share of the job's work done",
    "silod_job_queue_position": "Position of the waiting job in the queue (1 = next)",
}
DATASET_GAUGES = {
    "silod_dataset_cache_allocated_bytes": "Cache allocated to the dataset",
    "silod_dataset_cached_bytes": "Bytes of the dataset in cache, as measured",
    "silod_dataset_size_bytes": "Size of the dataset",
}
# Waiting jobs beyond the first ones in line get no per-job series: a queue of 10,000 jobs would
# otherwise be 20,000 series per scrape. silod_queue_length still counts them all.
MAX_WAITING_SERIES = 500
BOUND_GAUGE = "silod_job_bound"  # 1 for the resource that limits the running job: gpu | cpu | cache | remote_io


def overview_metrics(o: Overview) -> Iterator[Metric]:
    labels = ["job", "name", "tenant", "dataset"]
    fam = {n: GaugeMetricFamily(n, h, labels=labels) for n, h in JOB_GAUGES.items()}
    bound = GaugeMetricFamily(BOUND_GAUGE, "1 for the resource that limits the running job by the model",
                              labels=[*labels, "resource"])
    for j in o.running:
        lv = [j.id, j.name, j.owner, j.dataset]
        fam["silod_job_gpus"].add_metric(lv, j.gpus)
        fam["silod_job_ideal_throughput_bytes_per_second"].add_metric(lv, j.ideal_throughput)
        fam["silod_job_progress_ratio"].add_metric(lv, j.progress)
        fam["silod_job_predicted_throughput_bytes_per_second"].add_metric(lv, j.predicted_throughput)
        for name, value in (("silod_job_remote_io_allocated_bytes_per_second", j.remote_io),
                            ("silod_job_cache_allocated_bytes", j.cache_bytes),
                            ("silod_job_hit_ratio", j.hit_ratio),
                            ("silod_job_throughput_bytes_per_second", j.throughput)):
            if value is not None:  # unknown is absent, not 0 (a 0 hit ratio is a real figure)
                fam[name].add_metric(lv, value)
        bound.add_metric([*lv, j.bound], 1.0)
    for q in o.queue[:MAX_WAITING_SERIES]:
        lv = [q.id, q.name, q.owner, q.dataset]
        fam["silod_job_gpus"].add_metric(lv, 0)
        fam["silod_job_queue_position"].add_metric(lv, q.position)
    yield from fam.values()
    yield bound
    dfam = {n: GaugeMetricFamily(n, h, labels=["dataset", "tenant", "key"]) for n, h in DATASET_GAUGES.items()}
    for d in o.datasets:
        lv = [d.name, d.owner, d.key]
        dfam["silod_dataset_cache_allocated_bytes"].add_metric(lv, d.allocated)
        dfam["silod_dataset_size_bytes"].add_metric(lv, d.size)
        if d.cached is not None:
            dfam["silod_dataset_cached_bytes"].add_metric(lv, d.cached)
    yield from dfam.values()
    yield GaugeMetricFamily("silod_queue_length", QUEUE_LENGTH_HELP, value=o.queued_total)


QUEUE_LENGTH_HELP = "Jobs waiting for GPUs"


def make_registry(service: SchedulerService, per_job: bool = True) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service, per_job))
    return registry


def metrics_response(registry: CollectorRegistry) -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
