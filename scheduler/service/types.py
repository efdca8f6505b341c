"""The service's vocabulary: who calls (Principal), what they ask (NewDataset, NewJob), what they
get back (records), its configuration, and the errors the API turns into status codes. Shared by
the catalogue, the scheduling loop and the API; no I/O here."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from estimator.access import EPOCH, AccessPattern, parse_access
from estimator.model import MAX_LOADER_ITEM_BYTES, MAX_LOADER_WORKERS
from estimator.pipeline import InputPipeline
from estimator.errors import UserError
from policies.types import ClusterCapacity
from scheduler.backends.base import ClusterDescription
from scheduler.core.planner import RoundPlan
from contract.uri_policy import UriPolicy

#: The default ceiling on a job's declared f* per GPU (bytes/s, times --gpu-speed): about 9x the
#: catalog's fastest model on its reference GPU (resnet50, 114 MB/s per V100; traces/catalog.py).
#: An admin raises it per tenant (PUT /v1/quotas/{tenant} {"ideal_per_gpu": ...}) or for all
#: (--default-quota fstar=RATE).
DEFAULT_IDEAL_PER_GPU = 1e9
MAX_BYTES = 1e21  # larger sizes are typos (a zettabyte dataset), not data
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
ADMIN = "admin"


# --- errors the API turns into status codes (all are UserErrors, so the CLI prints them) ---


class ServiceError(UserError):
    status = 422

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class NotFoundError(ServiceError):
    status = 404


class ConflictError(ServiceError):
    status = 409


class ForbiddenError(ServiceError):
    status = 403


class UpstreamUnavailable(ServiceError):
    """A service silod depends on (the Kubernetes API server) cannot answer now: retry later."""

    status = 503


def check_name(value: str, what: str) -> str:
    """Names end up in paths (mount points, cache directories, pod names): no '/', no '..'."""
    if not isinstance(value, str) or not NAME_RE.match(value) or ".." in value:
        raise ServiceError(
            f"{what} {value!r} is not a valid name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '/' or '..'",
            field=what,
        )
    return value


# --- the data-manager edge ---


@runtime_checkable
class StoragePusher(Protocol):
    """What the service needs from the data manager (datamanager.client implements it)."""

    def allocate_cache_size(self, dataset: str, bytes: float) -> Any: ...  # noqa: A002 - the data manager's name

    def allocate_remote_io(self, job_id: str, bytes_per_s: float, workers: int = 1) -> Any: ...

    def status(self) -> Any: ...


# --- inputs and outputs of the service layer ---


@dataclass(frozen=True, slots=True)
class Principal:
    user: str
    is_admin: bool = False
    #: a node agent identified by its pod's service-account token (TokenReview): the node its pod
    #: runs on, as the API server says (http_guard/agent_identity.py); None for every other caller
    node: str | None = None
    #: a job's report token (api_tokens.job_id): it may post that job's step reports and nothing
    #: else (the API's guard refuses every other route before reading a body)
    job_id: str | None = None


@dataclass(frozen=True, slots=True)
class NewDataset:
    name: str
    uri: str
    size: float
    item_count: int | None = None
    credential: str | None = None  # a credential of the same tenant (POST /v1/credentials)


@dataclass(frozen=True, slots=True)
class NewJob:
    name: str
    gpus: int
    dataset: str
    epochs: float | None = None
    steps: int | None = None
    step_bytes: float | None = None
    ideal_throughput: float | None = None
    model: str | None = None
    priority: int = 0
    dataset_owner: str | None = None  # another tenant's dataset, shared by an explicit grant
    access: AccessPattern = EPOCH  # how the job reads (estimator/access.py)
    pipeline: InputPipeline | None = None  # CPU preprocessing stage (estimator/pipeline.py); None = not CPU-bound
    # The pods to run (backends that create workloads, i.e. Kubernetes: a workloads.PodTemplate).
    pod_template: Any = None
    # The local backend's training program: (command, env) run on the mounted dataset; None runs
    # the built-in stand-in worker.
    program: JobProgram | None = None
    # The job's data loader (types.JobLoader); None: not declared (the paper's model).
    loader: JobLoader | None = None


# (Most loader workers a job may declare, and the largest item: estimator/model.py, which the
# trace reader shares.)


@dataclass(frozen=True, slots=True)
class JobLoader:
    """A job's data loader as it declares it (e.g. a torch DataLoader's num_workers): with the
    mount's measured per-miss service time L it gives the estimator's loader term m = W s / L
    (estimator.loader_miss_rate). `item_bytes`: one item's size; None: the mean size of the
    missed items the mount measured."""

    workers: int
    item_bytes: float | None = None

    def __post_init__(self) -> None:
        w = self.workers
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_LOADER_WORKERS:
            raise UserError(f"loader.workers = {w!r}: give the loader's worker processes, a whole number"
                            f" from 1 to {MAX_LOADER_WORKERS}")
        b = self.item_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                              or not 0 < b <= MAX_LOADER_ITEM_BYTES):
            raise UserError(f"loader.item_bytes = {b!r}: give one item's size in bytes, > 0 and at most 1 TiB"
                            " (or leave it out: the mount measures it)")


def loader_from_row(workers: int | None, item_bytes: float | None) -> JobLoader | None:
    """The JobLoader of a job's row columns (None: not declared)."""
    return None if workers is None else JobLoader(int(workers), None if item_bytes is None else float(item_bytes))


@dataclass(frozen=True, slots=True)
class JobProgram:
    """What a local-backend job runs instead of the stand-in worker (scheduler/backends/local_worker.py)."""

    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> str:
        return json.dumps({"command": list(self.command), "env": dict(self.env)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> JobProgram | None:
        if not text:
            return None
        data = json.loads(text)
        return cls(tuple(data["command"]), tuple(sorted((data.get("env") or {}).items())))


@dataclass(frozen=True, slots=True)
class DatasetRecord:
    name: str
    uri: str
    size: float
    item_count: int | None
    owner: str
    created_at: float
    key: str  # storage_key: its name in the data manager and the cache
    credential: str | None = None
    shared_with: tuple[str, ...] = ()
    #: autocaching: "preprocessed" when the scheduler chose to cache its readers' preprocessed
    #: data (cache_expansion bytes per source byte), else "source"
    cache_mode: str = "source"
    cache_expansion: float | None = None


@dataclass(frozen=True, slots=True)
class Bottleneck:
    """Which resource bounds a running job now and the predicted speed-up (new / now) of one
    more unit of each (estimator.pipeline.diagnose): a GPU, a core, +10% cache, +10% link."""

    bound: str  # gpu | cpu | cache | remote_io
    throughput: float  # bytes/s the model predicts with the job's allocation
    speedup_gpu: float
    speedup_cpu: float
    speedup_cache: float
    speedup_remote_io: float


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
    dataset_owner: str
    model: str | None
    ideal_throughput: float
    epochs: float | None
    steps: int | None
    step_bytes: float | None
    total_bytes: float
    consumed_bytes: float
    remaining_bytes: float
    priority: int
    state: str
    submit_time: float
    start_time: float | None
    finish_time: float | None
    message: str
    allocated_gpus: int
    gpu_share: float
    remote_io: float | None
    access: AccessPattern = EPOCH
    cpu_rate: float | None = None
    autocache_expansion: float | None = None
    post_cpu_rate: float | None = None
    allocated_cpus: float | None = None  # cores while running; None = CPU not modelled
    bottleneck: Any = None  # a Bottleneck while it runs, else None
    #: GET one job: what its dataset's cache holds ("source" | "preprocessed", autocaching) and,
    #: preprocessed, the bytes cached per source byte; None in listings
    cache_mode: str | None = None
    cache_expansion: float | None = None
    # Declared vs measured f* and per-core rate (scheduler/service/measured_params.MeasuredParams);
    # None until the data plane measured it or its client reported.
    measured_parameters: Any = None
    # The model's diagnosis as of the last round the job ran in (diagnosis.record_bounds): what
    # bound an ended job; None = never diagnosed.
    last_bound: str | None = None
    last_predicted_throughput: float | None = None
    last_bound_at: float | None = None
    loader: JobLoader | None = None  # as declared


@dataclass(frozen=True, slots=True)
class JobAllocationRecord:
    job_id: str
    owner: str
    gpus: int
    gpu_share: float
    running: bool
    remote_io: float | None


@dataclass(frozen=True, slots=True)
class CacheAllocationRecord:
    dataset: str
    owner: str
    key: str
    bytes: float
    size: float


@dataclass(frozen=True, slots=True)
class AllocationsRecord:
    round_id: int | None
    time: float | None
    policy: str
    jobs: tuple[JobAllocationRecord, ...]
    cache: tuple[CacheAllocationRecord, ...]


@dataclass(frozen=True, slots=True)
class ChangeRecord:
    id: int
    round_id: int | None
    time: float
    subject_kind: str
    subject: str
    resource: str
    old_value: float | None
    new_value: float | None


@dataclass(frozen=True, slots=True)
class ClusterRecord:
    description: ClusterDescription
    capacity: ClusterCapacity
    gpus_used: int
    cache_used: float
    remote_io_used: float
    jobs_by_state: Mapping[str, int]
    backend: str
    datamanager: str | None
    last_round_time: float | None
    last_push_error: str | None


@dataclass(frozen=True, slots=True)
class RoundResult:
    round_id: int
    reason: str
    active: int
    running: tuple[str, ...]
    started: tuple[str, ...]
    stopped: tuple[str, ...]
    changes: int
    duration_s: float
    plan: RoundPlan | None


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """Limits of one tenant; None is no limit. `gpus`, `running_jobs` and `cache_bytes` bound what
    the tenant holds at any time (the round admits its jobs within them); `queued_jobs` bounds
    its waiting jobs at submission (429)."""

    gpus: int | None = None
    cache_bytes: float | None = None
    running_jobs: int | None = None
    queued_jobs: int | None = None
    #: the most f* per GPU a job of the tenant may declare (bytes/s per GPU): a declaration is a
    #: claim that orders the SJF queue before anything is measured, so it is bounded (issue 47).
    #: None: the service's default quota's, else DEFAULT_IDEAL_PER_GPU x the cluster's GPU speed.
    ideal_per_gpu: float | None = None
    #: the least and the most work (bytes: epochs x dataset size, or steps x step_bytes) a job of
    #: the tenant may declare. Declared work orders the SJF queue before the job has run (the
    #: shortest goes first and preempts), so it is a bounded claim like f* (issue 47). None: the
    #: service's default quota's (`--default-quota min_work=SIZE,max_work=SIZE`), else no bound.
    min_work: float | None = None
    max_work: float | None = None

    FIELDS = ("gpus", "cache_bytes", "running_jobs", "queued_jobs", "ideal_per_gpu", "min_work", "max_work")


#: Waiting jobs a tenant without its own quota may have (`--default-quota queued=N`, or
#: `queued=none` for no limit below the object limit `jobs`; PUT /v1/quotas/{tenant} per tenant).
DEFAULT_QUEUED_JOBS = 1_000
DEFAULT_QUOTA = TenantQuota(queued_jobs=DEFAULT_QUEUED_JOBS)


@dataclass(frozen=True, slots=True)
class ObjectLimits:
    """How many objects one tenant may make the service hold (issue 20: datasets and grants were
    unbounded, and every one is in the owner's listing). Counted in the write transaction that
    adds one, so exact across API workers; a 403 naming the limit past it."""

    datasets: int = 10_000  # datasets one tenant registers
    credentials: int = 1_000  # credentials one tenant stores
    grants: int = 256  # tenants one dataset is shared with (each grantee is in the dataset's record)
    #: active (queued or running) jobs of one tenant (issue 47: every active job is in each
    #: round and in its owner's listings; one tenant's 12,000 slowed every tenant's reads). A
    #: 403 past it; an admin's quota `queued_jobs` (429) is the softer, per-tenant limit.
    jobs: int = 10_000


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    capacity: ClusterCapacity
    default_quota: TenantQuota = DEFAULT_QUOTA  # tenants without their own
    uri_policy: UriPolicy = field(default_factory=UriPolicy)  # which dataset URIs may be registered
    policy: str | None = None  # None: the persisted policy, else fifo
    round_seconds: float = 360.0
    poll_seconds: float = 1.0  # how often the backend is polled for events between rounds
    min_event_gap_s: float = 2.0  # event-triggered rounds at most this often (bursts coalesce)
    gpu_speed: float = 1.0  # multiplies catalog f* (per V100) for this cluster's GPUs
    #: Users whose tokens belong to node agents (`silod serve --node-agent USER`): they may read
    #: any tenant's dataset record (to mount it for that tenant's pods), and nothing else more.
    node_agents: frozenset[str] = frozenset()
    #: Node agents bound to one node (`--node-agent USER=NODE`): only these may report
    #: consumption, and only for their node (scheduler/service/consumption.py).
    agent_nodes: tuple[tuple[str, str], ...] = ()
    #: Checks agent pods' service-account tokens with the API server (http_guard/agent_identity.py,
    #: `silod serve --agent-service-account NS:NAME`); None: only static tokens identify agents.
    agent_reviewer: Any = None
    #: tenant T's namespace is this prefix + T (`--backend-opt namespace-prefix=P`): where an agent
    #: pod's credential look-up checks for T's pods mounting the dataset on its node
    tenant_namespace_prefix: str = ""
    #: Seals tenants' secrets at rest (scheduler/service/sealed.py); None: credentials cannot be
    #: added (a service built without a state directory or SILOD_SECRET_KEYS).
    secrets: Any = None
    objects: ObjectLimits = field(default_factory=ObjectLimits)

    def agent_node(self, user: str) -> str | None:
        return dict(self.agent_nodes).get(user)


def parse_node_agents(values: list[str] | None) -> tuple[frozenset[str], tuple[tuple[str, str], ...]]:
    """`--node-agent USER` (any node; dataset look-ups only) or `USER=NODE` (also consumption
    reports for NODE). Returns (users, ((user, node), ...))."""
    users: set[str] = set()
    bound: dict[str, str] = {}
    for v in values or ():
        user, sep, node = str(v).partition("=")
        user, node = user.strip(), node.strip()
        if not user or (sep and not node):
            raise ServiceError(f"--node-agent {v!r}: give USER or USER=NODE", field="node_agent")
        if user in bound and sep and bound[user] != node:
            raise ServiceError(f"--node-agent {user} is bound to two nodes ({bound[user]}, {node}); one token user"
                               f" per node", field="node_agent")
        users.add(user)
        if sep:
            bound[user] = node
    return frozenset(users), tuple(sorted(bound.items()))




# --- a job's access pattern in the jobs table (migration 0002_job_access_pattern) ---


def access_columns(access: AccessPattern) -> dict[str, Any]:
    """The Job columns that store an access pattern."""
    c = access.curriculum
    return {
        "access": access.kind.value,
        "curriculum_starting_percent": None if c is None else c.starting_percent,
        "curriculum_alpha": None if c is None else c.alpha,
        "curriculum_step": None if c is None else c.step,
        "curriculum_batch": None if c is None else c.batch,
    }


def pipeline_columns(pipeline: InputPipeline | None) -> dict[str, Any]:
    """The Job columns that store a CPU preprocessing stage (migration 0005)."""
    return {
        "cpu_rate": None if pipeline is None else pipeline.cpu_rate,
        "autocache_expansion": None if pipeline is None else pipeline.autocache_expansion,
        "post_cpu_rate": None if pipeline is None else pipeline.post_cpu_rate,
    }


# Memoised: a round calls these for each of tens of thousands of active jobs, which share a few
# patterns. The results are frozen (immutable) and typed=True keeps 1 and 1.0 apart, so a cached
# result is exactly what a call would build; a call that raises is never cached.
@functools.lru_cache(maxsize=4096, typed=True)
def pipeline_from_row(cpu_rate: Any, expansion: Any, post: Any) -> InputPipeline | None:
    return None if cpu_rate is None else InputPipeline(float(cpu_rate), expansion, post)


@functools.lru_cache(maxsize=4096, typed=True)
def access_from_row(kind: str | None, starting_percent: Any, alpha: Any, step: Any, batch: Any) -> AccessPattern:
    """The access pattern stored by access_columns (None or "epoch": the default)."""
    if kind in (None, "epoch"):
        return EPOCH
    return parse_access(kind, starting_percent, alpha, step, batch)
