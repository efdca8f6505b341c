"""The interface between the scheduling service and the machines that run jobs.

The service (scheduler/service/scheduler_process.py) decides *what* runs with which resources; a backend makes it
happen on some cluster (local processes, Kubernetes pods) and reports back what the jobs did.
The contract is deliberately small so that backends stay independent of the database, the API
and the policies:

- ``describe()``: the nodes and capacities the backend can offer (used for the cluster view
  and, when no cluster flags are given, for the scheduler's capacity).
- ``start(job, allocation)``: launch a job that the round planner chose. Called once per
  (re)start; a job that keeps running across rounds is not started again.
- ``stop(job_id)``: stop (preempt or cancel) a job; must be idempotent and must not raise for
  an unknown or already-finished job.
- ``poll()``: events since the last poll (progress, finished, failed). Progress is *cumulative*
  bytes consumed by the job since it was submitted, so a lost or repeated event never
  corrupts the job's remaining work.
- ``running_jobs()`` (optional; default: none): ids of the jobs this backend object runs right
  now, including jobs it re-adopted from a previous service process. After a restart the
  service keeps those running instead of stopping and requeueing them.

Cache and remote-IO allocations are enforced by the data manager, not by the backend: the
service pushes them through a ``StoragePusher``. ``JobAllocation`` still carries them so that a
backend running without a data manager can pass static limits to its FUSE mounts.

A backend module (``scheduler.backends.<name>``) exposes ``create_backend(config) ->
ClusterBackend``; ``load_backend`` imports it by name.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from estimator.errors import UserError
from contract.credentials import SourceCredential
from policies.types import ClusterCapacity

BACKEND_NAMES = ("local", "kubernetes")


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    """A registered dataset as a backend needs it to mount it."""

    name: str
    uri: str  # remote source, e.g. s3://bucket/prefix, file:///data/x, http://host/path
    size: float  # bytes
    item_count: int | None = None
    # The owning tenant's credential for `uri`; None: read anonymously (s3), never with the
    # cluster's own credentials. A backend hands it to the mount process only (see
    # fuse_client.remote.SourceCredential.to_env / ANONYMOUS_ENV).
    credential: SourceCredential | None = None


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a backend needs to run one job. Immutable: the service builds a fresh one per start."""

    job_id: str
    name: str
    owner: str
    gpus: int
    dataset: DatasetInfo
    ideal_throughput: float  # f*, bytes/s at `gpus` GPUs
    total_bytes: float  # work of the whole job: epochs * dataset size (or steps * step bytes)
    consumed_bytes: float  # already done before this start (a restarted job resumes here)
    model: str | None = None
    epochs: float | None = None
    # Source bytes/s one core preprocesses (the job's declared CPU stage); None = not CPU-bound.
    # A backend that runs the work itself (the local workers) does that much CPU work per byte.
    cpu_rate: float | None = None
    # The local backend's training program (scheduler.service.types.JobProgram: command, env) run
    # on the mounted dataset instead of the stand-in worker; None: the stand-in.
    program: Any = None
    # A token the program reports its step times with (SILOD_TOKEN), minted by the service per start.
    report_token: str | None = None


@dataclass(frozen=True, slots=True)
class JobAllocation:
    """Resources granted to a job for the coming round(s)."""

    job_id: str
    gpus: int
    gpu_share: float  # the policy's time-average share (0..1); informational for backends
    cache_bytes: float | None  # cache of the job's dataset (shared by all its readers); None = unmanaged
    remote_io: float | None  # bytes/s cap for this job while running; None = unmanaged
    cpus: float | None = None  # CPU cores for its input pipeline; None = the cluster does not model CPU


# "unschedulable": the backend cannot place the job's pods on any node even with the cluster
# empty (message: why); the service holds it back from the policy (no GPUs) until that changes.
EventKind = Literal["progress", "finished", "failed", "unschedulable"]


@dataclass(frozen=True, slots=True)
class JobEvent:
    """Something a job did. `consumed_bytes` is cumulative since submission (None = unknown)."""

    job_id: str
    kind: EventKind
    consumed_bytes: float | None = None
    time: float | None = None  # unix seconds; None = when the service receives it
    message: str = ""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    gpus: int
    cache: float  # bytes of local disk this node contributes to the dataset cache
    labels: Mapping[str, str] = field(default_factory=dict)
    cache_source: str | None = None  # Kubernetes: "agent" | "annotation" | "share" (where `cache` comes from)

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))


@dataclass(frozen=True, slots=True)
class ClusterDescription:
    nodes: tuple[NodeInfo, ...]
    remote_io: float  # bytes/s, cluster egress from remote storage

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def cache(self) -> float:
        return sum(n.cache for n in self.nodes)


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """Everything `silod serve` knows that a backend may need to construct itself."""

    capacity: ClusterCapacity  # from --gpus/--cache/... or --cluster FILE
    state_dir: Path  # a directory the backend may own (logs, mount points, cache dirs)
    datamanager_url: str | None = None  # FUSE mounts use it as --manager when set
    options: Mapping[str, str] = field(default_factory=dict)  # backend-specific (--backend-opt k=v)
    # The operator's allow-list (`silod serve --allow-uri`); a backend that starts FUSE mounts
    # hands it to them as SILOD_ALLOWED_URIS, so they hold every request and connection to the
    # same list the API checked at registration (a mount without one trusts its own --source).
    allowed_uris: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


class ClusterBackend(ABC):
    """Runs jobs on a cluster. Methods are called from one service thread; they should not block
    for long (launch asynchronously and report through poll())."""

    name: str = "backend"

    @abstractmethod
    def describe(self) -> ClusterDescription:
        """Nodes and capacities this backend offers."""

    @abstractmethod
    def start(self, job: JobSpec, allocation: JobAllocation) -> None:
        """Launch `job` with `allocation`. Raise only for failures the service should record
        as the job failing; the service marks the job failed with the message."""

    @abstractmethod
    def stop(self, job_id: str) -> None:
        """Stop `job_id` (preemption or cancellation). Idempotent; never raises for unknown ids."""

    @abstractmethod
    def poll(self) -> list[JobEvent]:
        """Events since the previous call, oldest first."""

    def update(self, job_id: str, allocation: JobAllocation) -> None:  # noqa: B027 - optional hook
        """Optional hook: the allocation of a job that keeps running changed (today: its CPU
        cores). A backend that enforces cores applies the new limit to the running job; the
        default ignores it (cache and remote IO go to the data manager, not here)."""

    def running_jobs(self) -> set[str]:
        """Optional hook: ids of the jobs that run now, including jobs re-adopted after a restart
        of the service (the job ids the service passed to `start`).

        The service calls it once when it recovers: a job the database says was running and the
        backend still runs stays running (no stop, no restart); any other job recorded as
        running is stopped and queued again. The default, for backends that cannot tell, is an
        empty set: every job is restarted from its recorded progress."""
        return set()

    def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release resources at service shutdown (running jobs may be left to a restart)."""


def capacity_description(capacity: ClusterCapacity) -> ClusterDescription:
    """A ClusterDescription built from the flags: nodes of `gpus_per_node` GPUs, cache split evenly.

    Backends that do not discover their nodes (e.g. local processes) can return this."""
    nodes = []
    remaining = capacity.gpus
    count = capacity.nodes
    for i in range(count):
        gpus = min(capacity.gpus_per_node, remaining)
        remaining -= gpus
        nodes.append(NodeInfo(name=f"node-{i}", gpus=gpus, cache=capacity.cache / count))
    return ClusterDescription(nodes=tuple(nodes), remote_io=capacity.remote_io)


def load_backend(name: str, config: BackendConfig) -> ClusterBackend:
    """Import `scheduler.backends.<name>` and call its `create_backend(config)`.

    A backend that is not installed (or not written yet) is a UserError with the reason, never a
    silent fallback to something that does not run jobs."""
    if name not in BACKEND_NAMES and name != "null":
        raise UserError(f"unknown backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")
    module_name = f"scheduler.backends.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise UserError(f"backend {name!r} is not available in this installation ({module_name} is missing)") from exc
        extra = {"kubernetes": "kubernetes"}.get(name)
        hint = f"; install it with pip install 'silod[{extra}]'" if extra else ""
        raise UserError(f"backend {name!r} cannot be loaded: missing module {exc.name!r}{hint}") from exc
    except ImportError as exc:
        raise UserError(f"backend {name!r} cannot be loaded: {exc}") from exc
    factory = getattr(module, "create_backend", None)
    if factory is None:
        raise UserError(f"backend module {module_name} has no create_backend(config) function")
    backend = factory(config)
    if not isinstance(backend, ClusterBackend):
        raise UserError(f"{module_name}.create_backend returned {type(backend).__name__}, not a ClusterBackend")
    return backend
