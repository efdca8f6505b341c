"""The performance model: pure, numpy-vectorised functions, no I/O."""

from estimator.model import (
    cache_efficiency,
    dataset_cache_efficiencies,
    dataset_cache_efficiency,
    hit_ratio,
    io_perf,
    loader_miss_rate,
    loader_perf,
    remote_demand,
    can_reuse_new_cache,
    silod_loader_perf,
    silod_perf,
    window_io_perf,
)
from estimator.pipeline import (
    RESOURCES,
    Diagnosis,
    cores_needed,
    cpu_perf,
    cpu_seconds_per_byte,
    diagnose,
    pipeline_hit_ratio,
    pipeline_perf,
)

__all__ = [
    "cache_efficiency",
    "dataset_cache_efficiencies",
    "dataset_cache_efficiency",
    "hit_ratio",
    "io_perf",
    "loader_miss_rate",
    "loader_perf",
    "remote_demand",
    "can_reuse_new_cache",
    "silod_loader_perf",
    "silod_perf",
    "window_io_perf",
    "RESOURCES",
    "Diagnosis",
    "cores_needed",
    "cpu_perf",
    "cpu_seconds_per_byte",
    "diagnose",
    "pipeline_hit_ratio",
    "pipeline_perf",
]
