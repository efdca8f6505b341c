"""Typed answers of the silod REST API, as the client sees them.

These mirror the server's response schemas (scheduler/service/api/schemas.py) without importing
the server: a client installs with pydantic and httpx only. Fields the server adds later are
kept, not rejected (``extra="allow"``), so an older client keeps working against a newer server;
tests/test_sdk.py checks every field the server's OpenAPI schema declares is declared here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class Health(_Answer):
    status: str
    database: str


class Ready(_Answer):
    status: str
    scheduling: str


class Dataset(_Answer):
    name: str
    uri: str
    size: float
    item_count: int | None = None
    owner: str
    created_at: float
    key: str
    credential: str | None = None
    shared_with: list[str] = Field(default_factory=list)
    cache_mode: str = "source"
    cache_expansion: float | None = None


class SourceCredential(_Answer):
    access_key_id: str
    secret_access_key: str
    endpoint_url: str | None = None
    region: str | None = None


class Access(_Answer):
    kind: str
    starting_percent: float | None = None
    alpha: float | None = None
    step: int | None = None
    batch: int | None = None


class Bottleneck(_Answer):
    bound: str
    throughput: float
    speedup_gpu: float
    speedup_cpu: float
    speedup_cache: float
    speedup_remote_io: float


class MeasuredParameters(_Answer):
    """Declared against measured f* and per-core rate (docs/input-pipeline.md)."""

    declared_ideal_throughput: float
    ideal_throughput: float
    ideal_evidence_s: float
    declared_cpu_rate: float | None = None
    cpu_rate: float | None = None
    cpu_evidence_s: float = 0.0
    observed_throughput: float | None = None
    max_observed_throughput: float = 0.0
    bound: str = ""
    client_ideal_throughput: float | None = None
    client_at: float | None = None
    updated_at: float | None = None
    #: The mount's mean per-miss service time (seconds, open request to last byte) and the mean
    #: size of those missed items: the loader term's L and s.
    miss_service_s: float | None = None
    miss_item_bytes: float | None = None


class Loader(_Answer):
    """A job's data loader (Jobs.submit(loader=...)): `workers` processes (a DataLoader's
    num_workers), `item_bytes` one item's size (None: the mount measures it)."""

    workers: int
    item_bytes: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"workers": self.workers, **({} if self.item_bytes is None else {"item_bytes": self.item_bytes})}


class Measured(_Answer):
    read_bytes: int
    hit_bytes: int
    miss_bytes: int
    hits: int
    misses: int
    #: Misses the pods' mounts delivered whole, their summed service time (microseconds, open
    #: request to last byte) and their bytes: the loader term's L for a Kubernetes pod's job.
    miss_service_count: int = 0
    miss_service_us: int = 0
    miss_service_bytes: int = 0
    pods: int
    updated_at: float


class Job(_Answer):
    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
    dataset_owner: str
    model: str | None = None
    ideal_throughput: float
    epochs: float | None = None
    steps: int | None = None
    step_bytes: float | None = None
    total_bytes: float
    consumed_bytes: float
    remaining_bytes: float
    priority: int
    state: str
    submit_time: float
    start_time: float | None = None
    finish_time: float | None = None
    message: str = ""
    allocated_gpus: int
    gpu_share: float
    remote_io: float | None = None
    access: Access
    cpu_rate: float | None = None
    autocache_expansion: float | None = None
    post_cpu_rate: float | None = None
    allocated_cpus: float | None = None
    bottleneck: Bottleneck | None = None
    cache_mode: str | None = None
    cache_expansion: float | None = None
    measured_parameters: MeasuredParameters | None = None
    #: The model's bound and predicted throughput (bytes/s) as of the last round the job ran in:
    #: what bound an ended job; None = never diagnosed.
    last_bound: str | None = None
    last_predicted_throughput: float | None = None
    last_bound_at: float | None = None
    measured: Measured | None = None
    loader: Loader | None = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def progress(self) -> float:
        return self.consumed_bytes / self.total_bytes if self.total_bytes else 0.0


#: States a job never leaves.
TERMINAL_STATES = frozenset({"finished", "failed", "cancelled"})


class Credential(_Answer):
    name: str
    owner: str
    kind: str
    access_key_id: str
    endpoint_url: str | None = None
    region: str | None = None
    created_at: float


class Token(_Answer):
    id: int
    owner: str
    is_admin: bool
    label: str
    source: str
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None


class NewToken(Token):
    token: str = Field(description="shown once; only its HMAC is stored")


class Quota(_Answer):
    tenant: str
    gpus: int | None = None
    cache_bytes: float | None = None
    running_jobs: int | None = None
    queued_jobs: int | None = None
    ideal_per_gpu: float | None = None
    min_work: float | None = None
    max_work: float | None = None


class Usage(_Answer):
    total: float
    used: float


class Node(_Answer):
    name: str
    gpus: int
    cache: float
    labels: dict[str, str] = Field(default_factory=dict)
    #: Kubernetes: where `cache` comes from: "agent" (its node agent's fresh report), "annotation"
    #: (silod.io/cache-capacity) or "share" (an even share of --cache); None on other backends
    cache_source: str | None = None


class Cluster(_Answer):
    backend: str
    nodes: list[Node]
    gpus: Usage
    cache: Usage
    remote_io: Usage
    jobs: dict[str, int]
    datamanager: str | None = None
    last_round_time: float | None = None
    last_push_error: str | None = None


class JobAllocation(_Answer):
    job_id: str
    owner: str
    gpus: int
    gpu_share: float
    running: bool
    remote_io: float | None = None


class CacheAllocation(_Answer):
    dataset: str
    owner: str
    key: str
    bytes: float
    size: float


class Allocations(_Answer):
    round_id: int | None = None
    time: float | None = None
    policy: str
    jobs: list[JobAllocation]
    cache: list[CacheAllocation]


class Change(_Answer):
    id: int
    round_id: int | None = None
    time: float
    subject_kind: str
    subject: str
    resource: str
    old_value: float | None = None
    new_value: float | None = None


class Policy(_Answer):
    name: str
    available: list[str]


class Round(_Answer):
    round_id: int
    reason: str
    active: int
    running: list[str]
    started: list[str]
    stopped: list[str]
    changes: int
    duration_s: float


class IgnoredPod(_Answer):
    pod_uid: str
    reason: str


class ConsumptionResult(_Answer):
    accepted: int
    ignored: list[IgnoredPod]


class QueuedJob(_Answer):
    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
    priority: int
    submit_time: float
    position: int
    reason: str


class RunningJob(_Answer):
    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
    ideal_throughput: float
    progress: float
    cache_bytes: float | None = None
    dataset_bytes: float
    remote_io: float | None = None
    hit_ratio: float | None = None
    throughput: float | None = None
    predicted_throughput: float
    bound: str


class DatasetCache(_Answer):
    name: str
    owner: str
    key: str
    size: float
    allocated: float
    cached: float | None = None


class Overview(_Answer):
    time: float
    policy: str
    gpus_total: int
    gpus_used: int
    cache_total: float
    cache_allocated: float
    remote_io_total: float
    remote_io_allocated: float
    queued_total: int
    running_total: int
    queue: list[QueuedJob]
    running: list[RunningJob]
    datasets: list[DatasetCache]
    history: list[dict[str, float | None]] = Field(default_factory=list)
    measured_at: float | None = None
    #: None while rounds run normally; else what keeps the scheduler from placing jobs now,
    #: e.g. "scheduler starting: compiling policy kernels, 12 s"
    scheduling: str | None = None


# --- request bodies the client builds -----------------------------------------------------------

class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict:
        return self.model_dump(exclude_none=True, exclude_defaults=True, mode="json")


class Toleration(_Request):
    """A pod spec's toleration (Kubernetes spells the fields the same, but tolerationSeconds)."""

    key: str | None = None
    operator: str | None = None  # Equal | Exists
    value: str | None = None
    effect: str | None = None  # NoSchedule | PreferNoSchedule | NoExecute
    toleration_seconds: int | None = None


class Affinity(_Request):
    """A pod spec's affinity; each part as Kubernetes spells it (requiredDuringScheduling...)."""

    node_affinity: dict | None = None
    pod_affinity: dict | None = None
    pod_anti_affinity: dict | None = None


class Resources(_Request):
    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)


class PodTemplate(_Request):
    """`Jobs.submit(pod_template=...)` on Kubernetes: the pods of a job (a dict works as well).
    Scheduling fields are checked by the server as its admission webhook checks a workload."""

    image: str
    command: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cpu: str | None = None
    memory: str | None = None
    pods: int = 1
    data_path: str = "/data"
    run_as_user: int = 1000
    tolerations: list[Toleration] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)
    affinity: Affinity | None = None
    resources: Resources | None = None
