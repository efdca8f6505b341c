"""The scheduler service: jobs and datasets in a database, a scheduling loop, and the edges it
drives (a cluster backend that runs jobs, a data manager that enforces cache and remote IO).

One round, as explicit stages:
  1. events   - apply what the backend reported (progress, finished, failed);
  2. snapshot - read the active jobs and their datasets into an immutable `Snapshot`;
  3. plan     - `SchedulingCore(policy, SiloDEstimator()).plan(snapshot)` (pure, no I/O);
  4. persist  - write the new allocation and one audit row per changed value, in one
                transaction, re-checking states that may have changed during planning;
  5. execute  - stop preempted/cancelled jobs, start newly chosen ones, push cache and IO
                to the data manager.

Rounds run on a timer (the round length) and as soon as possible after an event (submit,
cancel, finish, policy change); bursts of events coalesce into one round. Reads (the API's
GETs) never take the write lock; writes are serialised by one lock in the process because
SQLite has a single writer anyway and PostgreSQL rows are few and hot.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sqlalchemy import Engine, delete, func, insert, select
from sqlalchemy.orm import Session, sessionmaker

from estimator.errors import UserError
from policies.estimators import SiloDEstimator
from policies.registry import available_policies, get_policy
from policies.types import ClusterCapacity, DatasetView, JobView, Snapshot
from scheduler.backends.base import ClusterBackend, ClusterDescription, DatasetInfo, JobAllocation, JobEvent, JobSpec
from scheduler.core import RoundPlan, SchedulingCore
from scheduler.db.models import (
    ACTIVE_STATES,
    AllocationChange,
    CacheAllocationRow,
    Dataset,
    Job,
    JobAllocationRow,
    JobState,
    Round,
    Setting,
)
from traces.catalog import lookup_model

log = logging.getLogger("silod.service")

MAX_BYTES = 1e21  # larger sizes are typos (a zettabyte dataset), not data
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
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


@dataclass(frozen=True, slots=True)
class NewDataset:
    name: str
    uri: str
    size: float
    item_count: int | None = None


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
    # The pods to run (backends that create workloads, i.e. Kubernetes: a workloads.PodTemplate).
    pod_template: Any = None


@dataclass(frozen=True, slots=True)
class DatasetRecord:
    name: str
    uri: str
    size: float
    item_count: int | None
    owner: str
    created_at: float


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
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
class ServiceConfig:
    capacity: ClusterCapacity
    policy: str | None = None  # None: the persisted policy, else fifo
    round_seconds: float = 360.0
    poll_seconds: float = 1.0  # how often the backend is polled for events between rounds
    min_event_gap_s: float = 2.0  # event-triggered rounds at most this often (bursts coalesce)
    gpu_speed: float = 1.0  # multiplies catalog f* (per V100) for this cluster's GPUs


@dataclass
class _Pending:
    """Backend actions decided in the persist transaction, executed after commit."""

    stop: list[str] = field(default_factory=list)
    start: list[tuple[JobSpec, JobAllocation]] = field(default_factory=list)
    cache: dict[str, float] = field(default_factory=dict)
    io: dict[str, float] = field(default_factory=dict)


class SchedulerService:
    def __init__(
        self,
        engine: Engine,
        backend: ClusterBackend,
        config: ServiceConfig,
        pusher: StoragePusher | None = None,
        datamanager_url: str | None = None,
    ):
        self.engine = engine
        self.backend = backend
        self.config = config
        self.pusher = pusher
        self.datamanager_url = datamanager_url
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self._write_lock = threading.RLock()
        self._round_lock = threading.Lock()  # one round at a time (timer thread vs direct calls)
        self._wake = threading.Event()
        self._wake_reasons: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_round: tuple[Snapshot, RoundPlan, float] | None = None
        self._last_round_time: float | None = None
        self._pushed_cache: dict[str, float] = {}
        self._pushed_io: dict[str, float] = {}
        self.last_push_error: str | None = None
        self.rounds_total = 0
        self.round_durations: list[float] = []  # recent, for /metrics
        self._description = backend.describe()
        name = config.policy or self._stored_policy() or "fifo"
        self.core = SchedulingCore(get_policy(name), SiloDEstimator())
        self.policy_name = name
        self._save_setting("policy", name)

    # ------------------------------------------------------------------ settings / policy

    def _stored_policy(self) -> str | None:
        with self.sessions() as s:
            row = s.get(Setting, "policy")
            return row.value if row and row.value in available_policies() else None

    def _save_setting(self, key: str, value: str) -> None:
        with self._write_lock, self.sessions.begin() as s:
            row = s.get(Setting, key)
            if row is None:
                s.add(Setting(key=key, value=value))
            else:
                row.value = value

    def set_policy(self, who: Principal, name: str) -> str:
        if not who.is_admin:
            raise ForbiddenError("only the admin may change the scheduling policy")
        if name not in available_policies():
            raise ServiceError(f"unknown policy {name!r}; choose one of: {', '.join(available_policies())}", field="name")
        policy = get_policy(name)
        with self._round_lock:
            # Keep the round planner: its record of GPU time received stays valid across policies.
            self.core.policy = policy
            self.policy_name = name
        self._save_setting("policy", name)
        self.trigger("policy")
        return name

    # ------------------------------------------------------------------ datasets

    def register_dataset(self, who: Principal, req: NewDataset) -> tuple[DatasetRecord, bool]:
        """Register a dataset; re-registering identical fields is a no-op (returns created=False)."""
        check_name(req.name, "name")
        if not (0 < req.size <= MAX_BYTES) or not math.isfinite(req.size):
            raise ServiceError(f"size {req.size!r} must be > 0 and <= 1e21 bytes", field="size")
        with self._write_lock, self.sessions.begin() as s:
            existing = s.scalar(select(Dataset).where(Dataset.name == req.name))
            if existing is not None:
                same = (existing.uri, existing.size, existing.item_count) == (req.uri, req.size, req.item_count)
                if not same:
                    raise ConflictError(f"dataset {req.name!r} is already registered with different uri/size", field="name")
                return self._dataset_record(existing), False
            row = Dataset(
                name=req.name, uri=req.uri, size=float(req.size), item_count=req.item_count,
                owner=who.user, created_at=time.time(),
            )
            s.add(row)
            s.flush()
            return self._dataset_record(row), True

    @staticmethod
    def _dataset_record(d: Dataset) -> DatasetRecord:
        return DatasetRecord(d.name, d.uri, d.size, d.item_count, d.owner, d.created_at)

    def list_datasets(self) -> list[DatasetRecord]:
        with self.sessions() as s:
            return [self._dataset_record(d) for d in s.scalars(select(Dataset).order_by(Dataset.name))]

    def get_dataset(self, name: str) -> DatasetRecord:
        with self.sessions() as s:
            d = s.scalar(select(Dataset).where(Dataset.name == name))
            if d is None:
                raise NotFoundError(f"no dataset named {name!r}", field="name")
            return self._dataset_record(d)

    # ------------------------------------------------------------------ jobs

    def submit_job(self, who: Principal, req: NewJob) -> JobRecord:
        check_name(req.name, "name")
        if req.pod_template is not None and not callable(getattr(self.backend, "create_workload", None)):
            raise ServiceError(f"pod_template needs a backend that creates workloads (kubernetes), not"
                               f" {self.backend.name}", field="pod_template")
        check_name(req.dataset, "dataset")
        cap = self.config.capacity
        if req.gpus < 1:
            raise ServiceError(f"gpus = {req.gpus}; a job needs at least 1 GPU", field="gpus")
        if req.gpus > cap.gpus:
            raise ServiceError(f"gpus = {req.gpus} but the cluster has only {cap.gpus} GPUs", field="gpus")
        if req.ideal_throughput is not None:
            ideal = float(req.ideal_throughput)
            if not (0 < ideal <= MAX_BYTES):
                raise ServiceError("ideal_throughput must be > 0 and <= 1e21 bytes/s", field="ideal_throughput")
        elif req.model is not None:
            try:
                spec = lookup_model(req.model)
            except UserError as exc:
                raise ServiceError(str(exc), field="model") from exc
            ideal = spec.ideal_per_gpu * req.gpus * self.config.gpu_speed
        else:
            raise ServiceError("give ideal_throughput (bytes/s, e.g. \"114MB/s\") or a catalog model", field="ideal_throughput")
        with self._write_lock, self.sessions.begin() as s:
            ds = s.scalar(select(Dataset).where(Dataset.name == req.dataset))
            if ds is None:
                raise ServiceError(f"unknown dataset {req.dataset!r}; register it first with POST /v1/datasets", field="dataset")
            if req.epochs is not None and req.steps is None:
                if not (0 < req.epochs <= 1e6):
                    raise ServiceError("epochs must be > 0 and <= 1e6", field="epochs")
                total = req.epochs * ds.size
            elif req.steps is not None and req.step_bytes is not None and req.epochs is None:
                total = req.steps * req.step_bytes
            else:
                raise ServiceError("give either epochs, or steps together with step_bytes", field="epochs")
            if not (0 < total <= MAX_BYTES):
                raise ServiceError(f"the job would read {total:.3g} bytes; must be > 0 and <= 1e21", field="epochs")
            job = Job(
                name=req.name, owner=who.user, gpus=req.gpus, dataset_id=ds.id, model=req.model,
                ideal_throughput=ideal, epochs=req.epochs, steps=req.steps, step_bytes=req.step_bytes,
                total_bytes=total, consumed_bytes=0.0, priority=req.priority, state=JobState.QUEUED,
                submit_time=time.time(), message="",
            )
            job.allocation = None  # known empty: no lazy SELECT when the record is built
            job.dataset = ds
            s.add(job)
            s.flush()
            record = self._job_record(job)
        if req.pod_template is not None:
            self._create_workload(record, req.pod_template)
        self.trigger("submit")
        return record

    def _create_workload(self, record: JobRecord, template: Any) -> None:
        """Backends that run pods from a template (Kubernetes) create the job's workload now; a
        refusal fails the job and is the caller's error (4xx)."""
        try:
            self.backend.create_workload(record, template)  # type: ignore[attr-defined]
            return
        except UserError as exc:
            message = str(exc)
        self.apply_events([JobEvent(record.id, "failed", message=message)])
        raise ServiceError(message, field="pod_template")

    @staticmethod
    def _job_record(j: Job) -> JobRecord:
        a = j.allocation
        return JobRecord(
            id=str(j.id), name=j.name, owner=j.owner, gpus=j.gpus, dataset=j.dataset.name, model=j.model,
            ideal_throughput=j.ideal_throughput, epochs=j.epochs, steps=j.steps, step_bytes=j.step_bytes,
            total_bytes=j.total_bytes, consumed_bytes=j.consumed_bytes,
            remaining_bytes=max(j.total_bytes - j.consumed_bytes, 0.0), priority=j.priority,
            state=JobState(j.state).value, submit_time=j.submit_time, start_time=j.start_time,
            finish_time=j.finish_time, message=j.message,
            allocated_gpus=a.gpus if a else 0, gpu_share=a.gpu_share if a else 0.0,
            remote_io=a.remote_io if a else None,
        )

    @staticmethod
    def _parse_job_id(job_id: str) -> int | None:
        # Ids are decimal integers; anything else cannot exist (404, not 422: ids are opaque).
        if not job_id.isascii() or not job_id.isdigit() or len(job_id) > 18:
            return None
        return int(job_id)

    def _load_job(self, s: Session, who: Principal, job_id: str) -> Job:
        pk = self._parse_job_id(job_id)
        job = s.get(Job, pk) if pk is not None else None
        # Another user's job is reported as missing: its existence is not theirs to know.
        if job is None or (not who.is_admin and job.owner != who.user):
            raise NotFoundError(f"no job with id {job_id!r}", field="job_id")
        return job

    def get_job(self, who: Principal, job_id: str) -> JobRecord:
        with self.sessions() as s:
            return self._job_record(self._load_job(s, who, job_id))

    _RECORD_COLUMNS = (
        Job.id, Job.name, Job.owner, Job.gpus, Dataset.name, Job.model, Job.ideal_throughput, Job.epochs, Job.steps,
        Job.step_bytes, Job.total_bytes, Job.consumed_bytes, Job.priority, Job.state, Job.submit_time,
        Job.start_time, Job.finish_time, Job.message, JobAllocationRow.gpus, JobAllocationRow.gpu_share,
        JobAllocationRow.remote_io,
    )

    def list_jobs(
        self, who: Principal, state: str | None = None, owner: str | None = None, limit: int = 1000, offset: int = 0
    ) -> list[JobRecord]:
        # Plain columns, not ORM objects: listing is the hottest read and ORM loading tripled its cost.
        q = (
            select(*self._RECORD_COLUMNS)
            .join(Dataset, Job.dataset_id == Dataset.id)
            .outerjoin(JobAllocationRow, JobAllocationRow.job_id == Job.id)
            .order_by(Job.id)
        )
        if not who.is_admin:
            q = q.where(Job.owner == who.user)
        elif owner is not None:
            q = q.where(Job.owner == owner)
        if state is not None:
            if state == "active":
                q = q.where(Job.state.in_(ACTIVE_STATES))
            else:
                try:
                    q = q.where(Job.state == JobState(state))
                except ValueError:
                    valid = ", ".join([*(s.value for s in JobState), "active"])
                    raise ServiceError(f"unknown state {state!r}; choose one of: {valid}", field="state") from None
        q = q.limit(limit).offset(offset)
        with self.sessions() as s:
            return [
                JobRecord(
                    id=str(r[0]), name=r[1], owner=r[2], gpus=r[3], dataset=r[4], model=r[5], ideal_throughput=r[6],
                    epochs=r[7], steps=r[8], step_bytes=r[9], total_bytes=r[10], consumed_bytes=r[11],
                    remaining_bytes=max(r[10] - r[11], 0.0), priority=r[12], state=JobState(r[13]).value,
                    submit_time=r[14], start_time=r[15], finish_time=r[16], message=r[17],
                    allocated_gpus=r[18] or 0, gpu_share=r[19] or 0.0, remote_io=r[20],
                )
                for r in s.execute(q)
            ]

    def cancel_job(self, who: Principal, job_id: str) -> JobRecord:
        with self._write_lock, self.sessions.begin() as s:
            job = self._load_job(s, who, job_id)
            if not JobState(job.state).active:
                raise ConflictError(f"job {job_id} is already {JobState(job.state).value}", field="job_id")
            job.state = JobState.CANCELLED
            job.finish_time = time.time()
            job.message = f"cancelled by {who.user}"
            record = self._job_record(job)
        self.trigger("cancel")
        return record

    # ------------------------------------------------------------------ cluster / allocations

    def cluster(self) -> ClusterRecord:
        with self.sessions() as s:
            counts = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
            gpus_used = s.scalar(select(func.coalesce(func.sum(JobAllocationRow.gpus), 0))) or 0
            io_used = s.scalar(
                select(func.coalesce(func.sum(JobAllocationRow.remote_io), 0.0)).where(JobAllocationRow.running)
            ) or 0.0
            cache_used = s.scalar(select(func.coalesce(func.sum(CacheAllocationRow.bytes), 0.0))) or 0.0
        return ClusterRecord(
            description=self._description,
            capacity=self.config.capacity,
            gpus_used=int(gpus_used),
            cache_used=float(cache_used),
            remote_io_used=float(io_used),
            jobs_by_state={JobState(k).value: int(v) for k, v in counts.items()},
            backend=self.backend.name,
            datamanager=self.datamanager_url,
            last_round_time=self._last_round_time,
            last_push_error=self.last_push_error,
        )

    def allocations(self, who: Principal) -> AllocationsRecord:
        with self.sessions() as s:
            last = s.scalar(select(Round).order_by(Round.id.desc()).limit(1))
            q = select(JobAllocationRow, Job.owner).join(Job).order_by(JobAllocationRow.job_id)
            if not who.is_admin:
                q = q.where(Job.owner == who.user)
            jobs = tuple(
                JobAllocationRecord(str(a.job_id), owner, a.gpus, a.gpu_share, a.running, a.remote_io)
                for a, owner in s.execute(q)
            )
            cache = tuple(
                CacheAllocationRecord(name, b, size)
                for b, name, size in s.execute(
                    select(CacheAllocationRow.bytes, Dataset.name, Dataset.size).join(Dataset).order_by(Dataset.name)
                )
            )
        return AllocationsRecord(
            round_id=last.id if last else None, time=last.time if last else None,
            policy=self.policy_name, jobs=jobs, cache=cache,
        )

    def allocation_history(
        self, who: Principal, subject: str | None = None, limit: int = 100
    ) -> list[ChangeRecord]:
        if not who.is_admin:
            raise ForbiddenError("only the admin may read the allocation audit trail")
        q = select(AllocationChange).order_by(AllocationChange.id.desc()).limit(limit)
        if subject is not None:
            q = q.where(AllocationChange.subject == subject)
        with self.sessions() as s:
            return [
                ChangeRecord(c.id, c.round_id, c.time, c.subject_kind, c.subject, c.resource, c.old_value, c.new_value)
                for c in s.scalars(q)
            ]

    # ------------------------------------------------------------------ the loop

    def trigger(self, reason: str) -> None:
        """Ask for a round as soon as possible (coalesced with other pending requests)."""
        self._wake_reasons.add(reason)
        self._wake.set()

    def start(self) -> None:
        """Recover from a previous run, then start the loop thread."""
        self.recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="silod-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        next_round = time.monotonic()  # the first round runs at once
        last_event_round = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = max(0.0, min(next_round - now, self.config.poll_seconds))
            self._wake.wait(timeout)
            if self._stop.is_set():
                break
            try:
                if self.apply_events(self.backend.poll()):
                    self.trigger("finish")
                now = time.monotonic()
                reason = None
                if now >= next_round:
                    reason = "timer"
                elif self._wake.is_set() and now - last_event_round >= self.config.min_event_gap_s:
                    reason = ",".join(sorted(self._wake_reasons)) or "event"
                elif self._wake.is_set():
                    # Too soon after the last event round: sleep off the gap, then run.
                    time.sleep(self.config.min_event_gap_s - (now - last_event_round))
                    continue
                if reason is None:
                    continue
                self._wake.clear()
                self._wake_reasons.clear()
                self.run_round(reason)
                last_event_round = time.monotonic()
                if reason == "timer":
                    next_round = last_event_round + self.config.round_seconds
            except Exception:  # the loop must survive a bad round; the next one retries
                log.exception("scheduling round failed")
                time.sleep(min(self.config.poll_seconds, 1.0))

    def recover(self) -> None:
        """After a restart the backend is a new object. A job the database records as running
        that the backend still runs (re-adopted, see `ClusterBackend.running_jobs`) stays
        RUNNING: no stop, no restart, its progress keeps arriving through poll(). Every other job
        recorded as running is stopped (idempotent for the backend) and queued again; the first
        round restarts it from its recorded progress. A job of ours that the backend runs although
        the database does not record it as running (the service died between committing a
        preemption or a cancel and carrying it out) is stopped, so that the backend runs exactly
        what the database says."""
        try:
            alive = {str(j) for j in self.backend.running_jobs()}
        except Exception:  # a backend that cannot tell: restart everything, as without the hook
            log.exception("backend %s could not list its running jobs; requeueing every running job", self.backend.name)
            alive = set()
        orphans: list[str] = []
        with self._write_lock, self.sessions.begin() as s:
            now = time.time()
            rows = s.scalars(select(JobAllocationRow).where(JobAllocationRow.running)).all()
            kept: set[str] = set()
            for row in rows:
                job = s.get(Job, row.job_id)
                if str(row.job_id) in alive and job is not None and job.state == JobState.RUNNING:
                    kept.add(str(row.job_id))
                    log.info("job %s: still running in the backend after the restart; kept", row.job_id)
                    continue
                self.backend.stop(str(row.job_id))
                changes = self._changes(None, now, "job", str(row.job_id), {"running": (1.0, 0.0), "gpus": (row.gpus, 0)})
                s.execute(insert(AllocationChange), changes)
                row.running = False
                row.gpus = 0
                if job is not None and job.state == JobState.RUNNING:
                    job.state = JobState.QUEUED
                    job.message = "requeued after a scheduler restart"
            ours = {pk: jid for jid in alive - kept if (pk := self._parse_job_id(jid)) is not None}
            if ours:
                known = set(s.scalars(select(Job.id).where(Job.id.in_(list(ours)))).all())
                orphans = sorted(ours[pk] for pk in known)
            unknown = sorted(alive - kept - set(orphans))
            if unknown:
                log.warning("the backend runs jobs this service does not know, left alone: %s", ", ".join(unknown))
        for jid in orphans:
            log.warning("job %s: running in the backend but not recorded as running; stopping it", jid)
            self.backend.stop(jid)

    def apply_events(self, events: Iterable[JobEvent]) -> bool:
        """Record backend events. True when a job finished or failed (a round should follow)."""
        events = list(events)
        if not events:
            return False
        ended = False
        with self._write_lock, self.sessions.begin() as s:
            for ev in events:
                pk = self._parse_job_id(ev.job_id)
                job = s.get(Job, pk) if pk is not None else None
                if job is None:
                    log.warning("event for unknown job %r ignored", ev.job_id)
                    continue
                if ev.consumed_bytes is not None and math.isfinite(ev.consumed_bytes):
                    # Cumulative and monotone: a repeated or reordered event never loses progress.
                    job.consumed_bytes = min(max(job.consumed_bytes, float(ev.consumed_bytes)), job.total_bytes)
                if not JobState(job.state).active:
                    continue
                if ev.kind == "finished":
                    job.state = JobState.FINISHED
                    job.finish_time = ev.time or time.time()
                    job.consumed_bytes = job.total_bytes if ev.consumed_bytes is None else job.consumed_bytes
                    job.message = ev.message
                    ended = True
                elif ev.kind == "failed":
                    job.state = JobState.FAILED
                    job.finish_time = ev.time or time.time()
                    job.message = ev.message or "failed"
                    ended = True
        return ended

    def build_snapshot(self, now: float | None = None) -> Snapshot:
        """An immutable view of the active jobs, read in one transaction."""
        now = time.time() if now is None else now
        q = (
            select(
                Job.id, Job.gpus, Dataset.name, Job.ideal_throughput, Job.total_bytes, Job.consumed_bytes,
                Job.submit_time, Job.state, Job.priority, Dataset.size,
            )
            .join(Dataset, Job.dataset_id == Dataset.id)
            .where(Job.state.in_(ACTIVE_STATES))
            .order_by(Job.submit_time, Job.id)
        )
        jobs: list[JobView] = []
        datasets: dict[str, DatasetView] = {}
        cached = self.measured_cache()
        with self.sessions() as s:
            for jid, gpus, ds, ideal, total, consumed, submit, state, prio, size in s.execute(q):
                jobs.append(
                    JobView(
                        job_id=str(jid), gpus=gpus, dataset=ds, ideal_throughput=ideal,
                        remaining_bytes=max(total - consumed, 0.0), submit_time=submit,
                        running=state == JobState.RUNNING, priority=prio,
                    )
                )
                datasets[ds] = DatasetView(ds, size, cached=None if cached is None else float(cached.get(ds, 0.0)))
        return Snapshot(time=now, jobs=tuple(jobs), datasets=datasets, capacity=self.config.capacity)

    def measured_cache(self) -> dict[str, float] | None:
        """Bytes of each dataset in cache now, as the system measures them (`DatasetView.cached`).

        From the data manager's `GET /v1/status` when one is configured (one call), else from
        the backend if it can tell (`dataset_cached_bytes()`, e.g. the local backend's mounts),
        else None: unknown, and policies then assume their allocations are filled. A dataset
        missing from a measurement has nothing in cache (0), so a cold cache is planned as cold.
        A data manager that cannot be reached, or answers without per-dataset figures, counts as
        no measurement (the backend's is used)."""
        if self.pusher is not None:
            try:
                measured = cached_bytes_from_status(self.pusher.status())
            except Exception as exc:  # the round goes on; the push will report the outage too
                log.warning("data manager status unavailable, cache fill unknown this round: %s", exc)
                measured = None
            if measured is not None:
                return measured
        probe = getattr(self.backend, "dataset_cached_bytes", None)
        if callable(probe):
            try:
                return {str(k): float(v) for k, v in dict(probe()).items()}
            except Exception:
                log.exception("backend %s could not report cached bytes", self.backend.name)
        return None

    def run_round(self, reason: str = "manual") -> RoundResult:
        """One scheduling round (see the module docstring). Safe to call from any thread."""
        with self._round_lock:
            t0 = time.perf_counter()
            now = time.time()
            if self._last_round is not None:
                prev_snap, prev_plan, prev_time = self._last_round
                self.core.record(prev_snap, prev_plan, max(now - prev_time, 0.0))
            snapshot = self.build_snapshot(now)
            plan = self.core.plan(snapshot) if snapshot.jobs else None
            pending, round_id, changes = self._persist(snapshot, plan, reason, now, t0)
            self._execute(pending)
            self._last_round = (snapshot, plan, now) if plan is not None else None
            self._last_round_time = now
            duration = time.perf_counter() - t0
            self.rounds_total += 1
            self.round_durations = (self.round_durations + [duration])[-100:]
            return RoundResult(
                round_id=round_id, reason=reason, active=len(snapshot.jobs),
                running=plan.running if plan else (), started=tuple(spec.job_id for spec, _ in pending.start),
                stopped=tuple(pending.stop), changes=changes, duration_s=duration, plan=plan,
            )

    @staticmethod
    def _changes(
        round_id: int | None, now: float, kind: str, subject: str, diffs: Mapping[str, tuple[float | None, float | None]]
    ) -> list[dict[str, Any]]:
        """Audit rows (as insert parameters) for the values that changed."""
        return [
            dict(
                round_id=round_id, time=now, subject_kind=kind, subject=subject, resource=resource,
                old_value=None if old is None else float(old), new_value=None if new is None else float(new),
            )
            for resource, (old, new) in diffs.items()
            if old != new
        ]

    def _persist(
        self, snapshot: Snapshot, plan: RoundPlan | None, reason: str, now: float, t0: float
    ) -> tuple[_Pending, int, int]:
        pending = _Pending()
        audit: list[dict[str, Any]] = []
        running = set(plan.running) if plan else set()
        managed = plan is not None and plan.manages_storage
        with self._write_lock, self.sessions.begin() as s:
            rnd = Round(
                time=now, policy=self.policy_name, reason=reason[:64], active_jobs=len(snapshot.jobs),
                running_jobs=len(running), changes=0, duration_s=0.0,
                objective=plan.allocation.objective if plan else None,
            )
            s.add(rnd)
            s.flush()
            rid = rnd.id
            ids = [int(j.job_id) for j in snapshot.jobs]
            # Current states as plain tuples: loading 1,000 ORM jobs would dominate the round.
            states: dict[int, JobState] = {}
            for chunk in range(0, len(ids), 500):  # bounded IN lists
                states.update(s.execute(select(Job.id, Job.state).where(Job.id.in_(ids[chunk : chunk + 500]))).all())
            transitions: list[tuple[int, bool, JobAllocation, str]] = []  # (job, run?, allocation, dataset)
            allocs = {a.job_id: a for a in s.scalars(select(JobAllocationRow))}
            for view in snapshot.jobs:
                jid = int(view.job_id)
                state = states.get(jid)
                # A job cancelled while the policy was thinking must not be started now.
                active = state is not None and JobState(state).active
                run = active and view.job_id in running
                share = plan.allocation.gpu_share.get(view.job_id, 0.0) if (plan and active) else 0.0
                io: float | None
                if managed and plan is not None and plan.remote_io is not None:
                    io = float(plan.remote_io.get(view.job_id, 0.0)) if run else 0.0
                else:
                    io = None
                gpus = view.gpus if run else 0
                row = allocs.pop(jid, None)
                if not active:
                    if row is not None:
                        allocs[jid] = row  # handled below with the other departed jobs
                    continue
                old = (row.gpus, row.gpu_share, row.remote_io, 1.0 if row.running else 0.0) if row else (None, None, None, None)
                new = (gpus, share, io, 1.0 if run else 0.0)
                if old != new:
                    audit += self._changes(
                        rid, now, "job", view.job_id,
                        {"gpus": (old[0], new[0]), "gpu_share": (old[1], new[1]), "remote_io": (old[2], new[2]),
                         "running": (old[3], new[3])},
                    )
                    if row is None:
                        row = JobAllocationRow(job_id=jid, gpus=gpus, gpu_share=share, remote_io=io, running=run, round_id=rid, updated_at=now)
                        s.add(row)
                    else:
                        row.gpus, row.gpu_share, row.remote_io, row.running = gpus, share, io, run
                        row.round_id, row.updated_at = rid, now
                was_running = state == JobState.RUNNING
                if run != was_running:
                    cache = plan.cache.get(view.dataset) if (plan and plan.cache is not None) else None
                    transitions.append((jid, run, JobAllocation(view.job_id, gpus, share, cache, io), view.dataset))
                # IO goes to the data manager for running jobs, and 0 for jobs that just stopped;
                # a job that never ran has nothing to release.
                if io is not None and (run or old[3] == 1.0):
                    pending.io[view.job_id] = io
            self._apply_transitions(s, transitions, now, pending)
            # Jobs that left the active states (finished, failed, cancelled) or were not in the
            # snapshot because they ended before it: release everything they held.
            ended = s.execute(
                select(Job.id, Job.state).where(Job.id.in_(list(allocs)))
            ).all() if allocs else []
            ended_ids = {jid for jid, state in ended if not JobState(state).active}
            for jid, row in allocs.items():
                if jid not in ended_ids:
                    continue  # submitted after the snapshot: next round decides
                audit += self._changes(
                    rid, now, "job", str(jid),
                    {"gpus": (row.gpus, 0), "gpu_share": (row.gpu_share, 0.0),
                     "remote_io": (row.remote_io, None), "running": (1.0 if row.running else 0.0, 0.0)},
                )
                if row.running:
                    pending.stop.append(str(jid))
                if row.remote_io is not None:
                    pending.io[str(jid)] = 0.0
                s.delete(row)
            # Cache per dataset: datasets with no active job get their cache back.
            rows = {
                name: row
                for row, name in s.execute(select(CacheAllocationRow, Dataset.name).join(Dataset))
            }
            if plan is not None and plan.cache is not None:
                wanted = {name: float(plan.cache.get(name, 0.0)) for name in snapshot.datasets}
            else:
                wanted = {}
            ds_ids = dict(s.execute(select(Dataset.name, Dataset.id).where(Dataset.name.in_(list(wanted)))).all()) if wanted else {}
            for name, nbytes in wanted.items():
                row = rows.pop(name, None)
                old = row.bytes if row else None
                if old != nbytes:
                    audit += self._changes(rid, now, "dataset", name, {"cache": (old, nbytes)})
                    if row is None:
                        s.add(CacheAllocationRow(dataset_id=ds_ids[name], bytes=nbytes, round_id=rid, updated_at=now))
                    else:
                        row.bytes, row.round_id, row.updated_at = nbytes, rid, now
                pending.cache[name] = nbytes
            for name, row in rows.items():
                audit += self._changes(rid, now, "dataset", name, {"cache": (row.bytes, 0.0)})
                pending.cache[name] = 0.0
                s.delete(row)
            if audit:  # one executemany instead of thousands of ORM objects
                s.execute(insert(AllocationChange), audit)
            rnd.changes = len(audit)
            rnd.duration_s = time.perf_counter() - t0
        return pending, rid, len(audit)

    @staticmethod
    def _apply_transitions(
        s: Session, transitions: list[tuple[int, bool, JobAllocation, str]], now: float, pending: _Pending
    ) -> None:
        """Start/stop state changes; only these jobs are loaded as ORM objects."""
        ids = [jid for jid, *_ in transitions]
        jobs: dict[int, Job] = {}
        for chunk in range(0, len(ids), 500):
            for job in s.scalars(select(Job).where(Job.id.in_(ids[chunk : chunk + 500]))).unique():
                jobs[job.id] = job
        for jid, run, alloc, _dataset in transitions:
            job = jobs[jid]
            if run:
                job.state = JobState.RUNNING
                job.start_time = job.start_time or now
                job.message = ""
                d = job.dataset
                spec = JobSpec(
                    job_id=str(jid), name=job.name, owner=job.owner, gpus=job.gpus,
                    dataset=DatasetInfo(d.name, d.uri, d.size, d.item_count),
                    ideal_throughput=job.ideal_throughput, total_bytes=job.total_bytes,
                    consumed_bytes=job.consumed_bytes, model=job.model, epochs=job.epochs,
                )
                pending.start.append((spec, alloc))
            else:
                job.state = JobState.QUEUED
                job.message = "preempted"
                pending.stop.append(str(jid))

    def _execute(self, pending: _Pending) -> None:
        """Backend and data-manager actions for a committed round. Failures are recorded, not raised."""
        for job_id in pending.stop:
            try:
                self.backend.stop(job_id)
            except Exception:  # stop must be idempotent; a failing backend must not stop the loop
                log.exception("backend failed to stop job %s", job_id)
        self._push_storage(pending)
        failed: dict[str, str] = {}
        for spec, alloc in pending.start:
            try:
                self.backend.start(spec, alloc)
            except Exception as exc:  # the job fails, the service carries on
                log.warning("backend failed to start job %s: %s", spec.job_id, exc)
                failed[spec.job_id] = f"backend could not start the job: {exc}"
        if failed:
            self.apply_events(JobEvent(job_id, "failed", message=msg) for job_id, msg in failed.items())
            self.trigger("finish")

    def _push_storage(self, pending: _Pending) -> None:
        if self.pusher is None:
            return
        errors = []
        for name, nbytes in pending.cache.items():
            if self._pushed_cache.get(name) == nbytes:
                continue
            try:
                self.pusher.allocate_cache_size(name, nbytes)
                self._pushed_cache[name] = nbytes
            except Exception as exc:  # retried next round: the dict keeps the old value
                errors.append(f"cache {name}: {exc}")
        for job_id, rate in pending.io.items():
            if self._pushed_io.get(job_id) == rate:
                continue
            try:
                self.pusher.allocate_remote_io(job_id, rate)
                self._pushed_io[job_id] = rate
            except Exception as exc:
                errors.append(f"remote IO {job_id}: {exc}")
        self.last_push_error = "; ".join(errors)[:2000] if errors else None
        if errors:
            log.warning("data manager push failed: %s", self.last_push_error)

    def close(self) -> None:
        self.stop()
        try:
            closer = getattr(self.pusher, "close", None)  # e.g. WorkConservingPusher's thread
            if callable(closer):
                try:
                    closer()
                except Exception:
                    log.exception("closing the data-manager pusher")
            self.backend.close()
        finally:
            self.engine.dispose()


def cached_bytes_from_status(status: Any) -> dict[str, float] | None:
    """Bytes in cache per dataset from the data manager's `GET /v1/status` (datamanager/state.py),
    or None when the answer has no per-dataset figures.

    A dataset's cache allocation applies to its cache on every node that mounts it, so the
    filled part of the allocation is the fullest node's cache (`nodes.*.datasets.*.cached_bytes`),
    not the sum over nodes (the same items cached on two nodes fill no more of it). Without the
    per-node view, `datasets.*.cached_bytes_all_nodes` is used."""
    if not isinstance(status, Mapping) or not isinstance(status.get("datasets"), Mapping):
        return None
    out: dict[str, float] = {}
    nodes = status.get("nodes")
    if isinstance(nodes, Mapping):
        for node in nodes.values():
            for name, entry in ((node or {}).get("datasets") or {}).items():
                value = float((entry or {}).get("cached_bytes") or 0.0)
                out[name] = max(out.get(name, 0.0), value)
    else:
        for name, entry in status["datasets"].items():
            out[name] = float((entry or {}).get("cached_bytes_all_nodes") or 0.0)
    for name in status["datasets"]:
        out.setdefault(name, 0.0)  # known to the manager, mounted nowhere: nothing cached
    return out


def count_rows(engine: Engine, model: type) -> int:
    """Rows in a table (tests and benchmarks)."""
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def purge_audit(engine: Engine, before: float) -> int:
    """Delete audit rows older than `before` (unix seconds); the trail otherwise grows forever."""
    with Session(engine) as s, s.begin():
        return s.execute(delete(AllocationChange).where(AllocationChange.time < before)).rowcount or 0
