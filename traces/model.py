"""The typed form of a workload trace, whatever file format it came from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from estimator.access import EPOCH, AccessPattern
from estimator.pipeline import InputPipeline


#: Latest submit time a trace may give, seconds from its start: the simulator's horizon (ten
#: years, SimConfig.max_sim_time_s). A job submitted later never runs, and the simulation used to
#: end at once with "0 jobs" and exit 0.
MAX_SUBMIT_S = 10 * 365 * 86400.0


@dataclass(frozen=True, slots=True)
class TraceJob:
    job_id: str
    submit_time: float  # seconds from trace start
    num_gpus: int
    model: str
    dataset: str  # jobs with the same dataset name share one dataset and its cache
    ideal_throughput: float  # f* at num_gpus on the reference GPU (V100), bytes/s
    epochs: float  # passes over the dataset; may be < 1 (for curriculum: bytes read / dataset size)
    access: AccessPattern = EPOCH  # how the job reads (estimator/access.py); epoch = regular
    #: CPU preprocessing stage (trace columns cpu_rate, autocache_expansion, post_cpu_rate);
    #: None = not CPU-bound (estimator/pipeline.py).
    pipeline: InputPipeline | None = None
    #: f* the user declared, when it differs from the real one (`ideal_throughput`): the
    #: scheduler starts from it and corrects it from what the job reads (estimator/measured.py).
    #: None: the declaration is exact. Python API and experiments only (no trace column).
    declared_throughput: float | None = None
    #: Bytes/s of misses the job's data loader absorbs (estimator.loader_perf: each missed byte
    #: costs 1/m beside its compute; m = W s / L, estimator.loader_miss_rate). None: a loader that
    #: hides every miss (the paper's model). Python API and experiments only (no trace column).
    loader_miss_rate: float | None = None

    def total_bytes(self, dataset_size: float) -> float:
        return self.epochs * dataset_size

    def ideal_duration(self, dataset_size: float) -> float:
        return self.total_bytes(dataset_size) / self.ideal_throughput


@dataclass(frozen=True, slots=True)
class Trace:
    jobs: tuple[TraceJob, ...]  # sorted by submit_time
    dataset_sizes: Mapping[str, float]  # bytes per dataset name
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    #: Bytes per item of the datasets whose item size was given (trace column `item_size`); the
    #: simulator needs it for curriculum jobs, whose pacing counts items and iterations.
    item_sizes: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset_sizes", MappingProxyType(dict(self.dataset_sizes)))
        object.__setattr__(self, "item_sizes", MappingProxyType(dict(self.item_sizes)))

    def __reduce__(self):
        # The read-only mapping views cannot be pickled; plain dicts travel to worker processes
        # (a Dask cluster is shipped the parsed trace) and __post_init__ wraps them again.
        return (Trace, (self.jobs, dict(self.dataset_sizes), self.source, self.notes, dict(self.item_sizes)))

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def max_gpus(self) -> int:
        return max((j.num_gpus for j in self.jobs), default=0)
