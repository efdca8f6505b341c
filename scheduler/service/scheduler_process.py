"""The scheduling side of the service: a round over the database's jobs, driving a cluster
backend (runs jobs) and the data manager (enforces cache and remote IO).

One round, as explicit stages:
  1. events   - apply what the backend reported (progress, bounded by f*; finished, failed);
  2. snapshot - read the active jobs, their datasets and the quotas in one read transaction
                (round_jobs.py: a job's view is rebuilt only when its row changed);
                admit each tenant's jobs within its quota (quota_admission.py);
  3. plan     - `SchedulingCore(policy, SiloDEstimator()).plan(snapshot)` (pure, no I/O);
                then each tenant's cache within its quota;
  4. persist  - diff against the stored allocation outside any transaction, write only the
                changes (and one audit row per changed value) in one short transaction,
                re-checking the states of the jobs it touches (round_persistence.py);
  5. execute  - stop preempted/cancelled jobs, push cache and IO to the data manager
                (storage_push.py), start newly chosen jobs.

The parts around it have their own modules: the catalogue (datasets, grants, credentials,
jobs, quotas, idempotency: catalogue.py), the loop and its leader lease (loop_runner.py,
control.py), recovery after a restart (recovery.py), the read views (views.py). In
`silod serve` this class lives in the scheduling process; API workers use api_service.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from sqlalchemy import Engine, delete, func, select
from sqlalchemy.orm import Session, object_session, sessionmaker

from estimator.errors import UserError
from policies.estimators import SiloDEstimator
from policies.registry import available_policies, get_policy, resolve_policy_name
from scheduler.service.overview import measurements_from_backend, measurements_from_datamanager
from policies.types import ClusterCapacity, DatasetView, JobView, Snapshot
from scheduler.backends.base import ClusterBackend, JobEvent
from scheduler.service import control
from scheduler.service.api.auth import revoke_job_tokens
from scheduler.service.catalogue import Catalogue, parse_job_id
from scheduler.service.loop import LoopRunner
from scheduler.service.recovery import recover
from scheduler.service.storage_push import StoragePush
from scheduler.service.views import ClusterStatus, ReadViews
from scheduler.core.planner import RoundPlan, SchedulingCore
from scheduler.service.db.models import (
    AllocationChange,
    Dataset,
    CacheAllocationRow,
    Job,
    JobAllocationRow,
    JobMeasurementRow,
    JobState,
    Quota,
    Setting,
)

log = logging.getLogger("silod.service")

PROGRESS_SLACK = 1.25  # a job reads at most its f*; 25% for clock skew and measurement noise
PROGRESS_BURST_S = 2.0  # and a couple of seconds' worth that a report may lag behind
OBSERVE_INTERVAL_S = 2.0  # how often the overview's measurements and utilisation sample refresh
HISTORY_SAMPLES = 300  # utilisation samples kept for the web view's chart (10 minutes at 2 s)

from contract.names import dataset_id_of_key, storage_key
from scheduler.service.types import (  # noqa: F401 - re-exported: callers import these from here
    ADMIN, MAX_BYTES, ConflictError, ForbiddenError, NotFoundError, ServiceError, check_name,
    StoragePusher, Principal, NewDataset, NewJob, DatasetRecord, JobRecord,
    JobAllocationRecord, CacheAllocationRecord, AllocationsRecord, ChangeRecord, ClusterRecord, RoundResult,
    ServiceConfig,
    TenantQuota,
    access_from_row,
    pipeline_from_row,
)
from scheduler.service.quota_admission import admit, clamp_cache
from scheduler.service.round_jobs import RoundJobs
from scheduler.service.diagnosis import record_bounds
from scheduler.service.round_persistence import Pending, diff_round, read_current, write_round
from scheduler.service.measured_params import MeasurementStore, Observation


def _counters(m: Mapping[str, Any], now: float) -> tuple[float | None, float | None, float | None]:
    """(read bytes, miss bytes, when taken) of a job's cumulative data-plane counters in a
    measurement dict (overview.measurements_from_*), or Nones when it carries none."""
    read, miss = m.get("read_bytes"), m.get("miss_bytes")
    try:
        read, miss = float(read), float(miss)
    except (TypeError, ValueError):
        return None, None, None
    if not (math.isfinite(read) and math.isfinite(miss) and 0 <= miss <= read):
        return None, None, None
    at = m.get("at")
    if at is None and m.get("age_s") is not None:
        at = now - float(m["age_s"])
    try:
        at = None if at is None else float(at)
    except (TypeError, ValueError):
        at = None
    return read, miss, (at if at is not None and math.isfinite(at) else None)


def _service_counters(m: Mapping[str, Any]) -> tuple[float | None, float | None, float | None]:
    """(misses delivered, their service seconds, their bytes) of a job's cumulative per-miss service
    counters in a measurement dict (overview.measurements_from_*), or Nones when it carries none."""
    try:
        got = tuple(float(m[k]) for k in ("miss_service_count", "miss_service_s", "miss_service_bytes"))
    except (KeyError, TypeError, ValueError):
        return None, None, None
    if not all(math.isfinite(v) and v >= 0 for v in got):
        return None, None, None
    return got  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class _RoundInput:
    snapshot: Snapshot  # the jobs admitted within their tenants' quotas
    held_back: tuple[JobView, ...]  # active jobs a quota keeps from running this round
    dataset_owner: Mapping[str, str]  # storage key -> tenant charged for its cache
    quotas: Mapping[str, TenantQuota]


class SchedulerService(ReadViews):
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
        self.storage = StoragePush(pusher)
        self.datamanager_url = datamanager_url
        #: Mints a job's report token (`report_token`, api.auth.TokenStore.mint_job_token) at each
        #: start: set by build_service for the backends whose jobs' code reports (local programs,
        #: Kubernetes pods, whose backend says `report_tokens`); None: no token.
        self.job_tokens: Any = None
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self._write_lock = threading.RLock()
        self._round_lock = threading.Lock()  # one round at a time (timer thread vs direct calls)
        self._last_round: tuple[Snapshot, RoundPlan, float] | None = None
        self._last_round_time: float | None = None
        self.rounds_total = 0
        self._progress_seen: dict[int, float] = {}  # job id -> when its progress was last believed
        self.round_durations: list[float] = []  # recent, for /metrics
        # For the overview (/ui, silod top, per-job /metrics; scheduler/service/overview.py):
        self._measured: dict = {}  # {"time", "jobs": {id: {hit_ratio, throughput}}, "cached": {key: bytes}}
        self._held_back: set[str] = set()  # job ids quota admission held back last round
        self._history: collections.deque = collections.deque(maxlen=HISTORY_SAMPLES)
        self._last_observed = 0.0
        self._pushed_placements: dict[str, list[str]] | None = None
        self._placements_at = 0.0
        self._description = backend.describe()
        #: The capacity the last round planned with (/v1/cluster's totals): the flags until then.
        self._planned_capacity: ClusterCapacity = config.capacity
        name = config.policy or self._stored_policy() or "fifo"
        self.core = SchedulingCore(get_policy(name), SiloDEstimator(), round_s=config.round_seconds)
        self.policy_name = name
        self._save_setting("policy", name)
        self.runner = LoopRunner(self)
        self.catalogue = Catalogue(self.sessions, config, self._write_lock, self.trigger, workloads=backend)
        self.measurements = MeasurementStore(self.sessions, self._write_lock)
        self._consumed_seen: dict[str, tuple[float, float]] = {}  # job -> (read bytes, time): node agents' rate
        self._round_jobs = RoundJobs()  # the active jobs' views, rebuilt only for changed rows
        self.publish_status()

    @property
    def pusher(self) -> StoragePusher | None:
        return self.storage.pusher

    @pusher.setter
    def pusher(self, value: StoragePusher | None) -> None:  # tests swap the data manager
        self.storage.pusher = value

    @property
    def last_push_error(self) -> str | None:
        return self.storage.last_error

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
        try:
            name = resolve_policy_name(name)
        except UserError as exc:  # the same message (and case rule) as the commands give
            raise ServiceError(str(exc), field="name") from None
        self.apply_policy(name)
        self._save_setting("policy", name)  # other processes (and the next start) read it here
        self.trigger("policy")
        return name

    def apply_policy(self, name: str) -> None:
        """Use policy `name` from the next round on (also when another process set it)."""
        if name not in available_policies():
            log.warning("ignoring unknown stored policy %r", name)
            return
        policy = get_policy(name)
        with self._round_lock:
            # Keep the round planner: its record of GPU time received stays valid across policies.
            self.core.policy = policy
            self.policy_name = name

    # ------------------------------------------------------------------ the catalogue (delegated)

    def register_dataset(self, who: Principal, req: NewDataset) -> tuple[DatasetRecord, bool]:
        return self.catalogue.register_dataset(who, req)

    def list_datasets(self, who: Principal) -> list[DatasetRecord]:
        return self.catalogue.list_datasets(who)

    def get_dataset(self, who: Principal, name: str, owner: str | None = None) -> DatasetRecord:
        return self.catalogue.get_dataset(who, name, owner)

    def submit_job(self, who: Principal, req: NewJob, idempotency_key: str | None = None) -> JobRecord:
        return self.catalogue.submit_job(who, req, idempotency_key)[0]

    def get_job(self, who: Principal, job_id: str) -> JobRecord:
        return self.catalogue.get_job(who, job_id)

    def list_jobs(
        self, who: Principal, state: str | None = None, owner: str | None = None, limit: int = 1000, offset: int = 0
    ) -> list[JobRecord]:
        return self.catalogue.list_jobs(who, state, owner, limit, offset)

    def cancel_job(self, who: Principal, job_id: str) -> JobRecord:
        return self.catalogue.cancel_job(who, job_id)

    # ------------------------------------------------------------------ cluster / allocations (views.py)

    def _status(self) -> ClusterStatus:
        return ClusterStatus(self._description, self.backend.name, self.datamanager_url, self._last_round_time,
                             self.last_push_error, self._planned_capacity)

    # ------------------------------------------------------------------ the loop

    def trigger(self, reason: str) -> None:
        """Ask for a round as soon as possible (coalesced with other pending requests)."""
        self.runner.trigger(reason)

    def start(self) -> None:
        """Start the loop thread; it recovers once it holds the leader lease, then schedules."""
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()

    def recover(self) -> None:
        """Make the backend run exactly what the database says (scheduler/service/recovery.py)."""
        with self._write_lock:
            recover(self.sessions, self.backend)

    def apply_events(self, events: Iterable[JobEvent]) -> bool:
        """Record backend events. True when a job finished or failed (a round should follow)."""
        events = list(events)
        if not events:
            return False
        ended = False
        now = time.time()
        with self._write_lock, self.sessions.begin() as s:
            for ev in events:
                pk = parse_job_id(ev.job_id)
                job = s.get(Job, pk) if pk is not None else None
                if job is None:
                    log.warning("event for unknown job %r ignored", ev.job_id)
                    continue
                if ev.consumed_bytes is not None and math.isfinite(ev.consumed_bytes):
                    # Cumulative and monotone: a repeated or reordered event never loses progress.
                    reported = min(float(ev.consumed_bytes), job.total_bytes)
                    if reported > job.consumed_bytes:
                        job.consumed_bytes = self._plausible_progress(job, reported, now)
                if not JobState(job.state).active:
                    continue
                if ev.kind in ("finished", "failed"):
                    revoke_job_tokens(s, job.id, now)  # its pods' or program's report token
                if ev.kind == "finished":
                    job.state = JobState.FINISHED
                    job.finish_time = ev.time or time.time()
                    job.consumed_bytes = job.total_bytes  # done; progress no longer orders anything
                    job.message = ev.message
                    ended = True
                elif ev.kind == "failed":
                    job.state = JobState.FAILED
                    job.finish_time = ev.time or time.time()
                    job.message = ev.message or "failed"
                    ended = True
                elif ev.kind == "unschedulable":
                    # Repeated every poll while it lasts: the reason stays visible (a preemption
                    # writes "preempted"); a round only when the job still holds its allocation.
                    job.message = ev.message or "unschedulable"
                    ended = ended or job.state == JobState.RUNNING
        return ended

    def _plausible_progress(self, job: Job, reported: float, now: float) -> float:
        """Progress reports come from places a job's owner can write (a status file in the job's
        directory, a pod's annotations), and remaining bytes order the SJF queue. So a report is
        believed only up to what the job could have read since the last believed one at its f*
        (`ideal_throughput`, the rate its GPUs consume data at best), times PROGRESS_SLACK, plus
        PROGRESS_BURST_S seconds' worth for batching: a forged report cannot move a job ahead
        faster than running it would. Time is the service's clock, never the report's."""
        since = self._progress_seen.get(job.id, job.start_time)
        if since is None:  # never started: nothing can have been read
            log.warning("job %s: progress reported before it ever ran; ignored", job.id)
            return job.consumed_bytes
        owner_session = object_session(job)
        row = owner_session.get(JobMeasurementRow, job.id) if owner_session is not None else None
        # A job measured faster than it declared may progress at the measured rate (at most 4x).
        fstar = max(job.ideal_throughput, (row.ideal_throughput or 0.0) if row is not None else 0.0)
        limit = job.consumed_bytes + fstar * (max(now - since, 0.0) * PROGRESS_SLACK + PROGRESS_BURST_S)
        self._progress_seen[job.id] = now
        if reported > limit:
            log.warning("job %s: reported %.0f bytes consumed, more than its f* allows (%.0f); capped", job.id, reported, limit)
            return limit
        return reported

    def build_snapshot(self, now: float | None = None) -> Snapshot:
        """An immutable view of the active jobs within their tenants' quotas, read in one transaction."""
        return self._round_input(now).snapshot

    def _round_input(self, now: float | None = None) -> _RoundInput:
        now = time.time() if now is None else now
        owners: dict[str, str] = {}
        cached = self.measured_cache()
        # One read transaction: the jobs, their datasets and the quotas are one consistent state.
        with self.sessions() as s, s.begin():
            jobs, sizes = self._round_jobs.read(s.connection(), now)
            if jobs:
                for ds_id, ds_name, ds_owner in s.execute(
                    select(Dataset.id, Dataset.name, Dataset.owner).where(Dataset.id.in_({dataset_id_of_key(k) for k in sizes}))
                ):
                    owners[storage_key(ds_id, ds_name)] = ds_owner
            quotas = {
                q.tenant: TenantQuota(*(getattr(q, k) for k in TenantQuota.FIELDS))
                for q in s.scalars(select(Quota))
            }
        admitted, held_back = admit(jobs, quotas, self.config.default_quota)
        # Jobs the backend cannot place on any node (its fit check, the API server's answer): held
        # back like a quota holds back, so the policy gives them no GPUs while that lasts.
        unschedulable = getattr(self.backend, "unschedulable_jobs", None)
        stuck = unschedulable() if callable(unschedulable) else set()
        if stuck:
            held_back = [*held_back, *(v for v in admitted if v.job_id in stuck)]
            admitted = [v for v in admitted if v.job_id not in stuck]
        # A measurement is believed only up to the dataset's size (issue 20: an agent's report of
        # 1e15 bytes for another tenant's dataset reached the policy as is). One view per dataset,
        # in the order the admitted jobs first read them.
        datasets = {
            ds: DatasetView(ds, sizes[ds], cached=None if cached is None else
                            min(max(float(cached.get(ds, 0.0)), 0.0), sizes[ds]))
            for ds in dict.fromkeys(v.dataset for v in admitted)
        }
        capacity = self._round_capacity()
        if capacity is None:  # no node with a GPU is Ready: nothing can run this round
            held_back, admitted, datasets = [*held_back, *admitted], [], {}
            capacity = self.config.capacity
            self._planned_capacity = dataclasses.replace(capacity, gpus=0)
        else:
            self._planned_capacity = capacity
        snapshot = Snapshot(time=now, jobs=tuple(admitted), datasets=datasets, capacity=capacity)
        return _RoundInput(snapshot, tuple(held_back), owners, quotas)

    def _round_capacity(self) -> ClusterCapacity | None:
        """The capacity this round plans with: the backend's view of the cluster when it has one
        (Kubernetes: the Ready GPU nodes of its last poll, capped by the flags), else the flags.
        None: the backend sees no GPU at all."""
        probe = getattr(self.backend, "cluster_capacity", None)
        if not callable(probe):
            return self.config.capacity
        try:
            seen = probe()
            self._description = self.backend.describe()  # /v1/cluster lists the nodes planned on
        except Exception as exc:  # noqa: BLE001 - the backend's view is not ready: plan on the flags
            log.warning("cluster capacity not read from the backend this round (%s); using the flags", exc)
            return self.config.capacity
        return seen

    def _enforce_cache_quota(self, plan: RoundPlan, inp: _RoundInput) -> RoundPlan:
        if plan.cache is None:
            return plan
        clamped = clamp_cache(plan.cache, inp.dataset_owner, inp.quotas, self.config.default_quota)
        if clamped == dict(plan.cache):
            return plan
        return dataclasses.replace(plan, cache=MappingProxyType(clamped))

    def node_cache_bound(self, node: str) -> float:
        """The most cache a node can hold: its own capacity when the backend knows it (Kubernetes:
        the node's silod.io/cache-capacity or its even share, which placement keeps every
        allocation within), else the cluster's whole cache (backends without nodes of their own
        let one dataset's allocation exceed an even share). A node's agent reporting more than
        this (issue 20) is not believed."""
        per_node = getattr(self.backend, "node_cache_capacity", None)
        if callable(per_node):
            try:
                known = per_node()
            except Exception:  # noqa: BLE001 - the backend's view is not ready: use the even share
                known = {}
            if node in known:
                return float(known[node])
        return float(self.config.capacity.cache)

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
                measured = cached_bytes_from_status(self.pusher.status(), self.node_cache_bound)
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
            inp = self._round_input(now)
            snapshot = inp.snapshot
            plan = self._enforce_cache_quota(self.core.plan(snapshot), inp) if snapshot.jobs else None
            self._held_back = {v.job_id for v in inp.held_back}
            pending, round_id, changes = self._persist(snapshot, plan, reason, now, t0, inp.held_back)
            self._execute(pending)
            self._last_round = (snapshot, plan, now) if plan is not None else None
            self._last_round_time = now
            duration = time.perf_counter() - t0
            self.rounds_total += 1
            self.round_durations = (self.round_durations + [duration])[-100:]
            self.publish_status()
            return RoundResult(
                round_id=round_id, reason=reason, active=len(snapshot.jobs),
                running=plan.running if plan else (), started=tuple(spec.job_id for spec, _ in pending.start),
                stopped=tuple(pending.stop), changes=changes, duration_s=duration, plan=plan,
            )

    def _overview_status(self) -> dict:
        return {"measured": self._measured, "held_back": sorted(self._held_back), "history": list(self._history)}

    def observe(self, force: bool = False) -> None:
        """Measure the running jobs and caches, add a utilisation sample, publish it all; at most
        every OBSERVE_INTERVAL_S (the loop calls this on every poll)."""
        now = time.time()
        if not force and now - self._last_observed < OBSERVE_INTERVAL_S:
            return
        self._last_observed = now
        self.push_placements()
        jobs: dict = {}
        cached = None
        if self.pusher is not None:
            try:
                st = self.pusher.status()
                # Agents' figures, bounded by what a node can hold (its cache disk) and carry (the
                # link: the cluster's remote IO, the most silod knows any node's link to be).
                jobs = measurements_from_datamanager(st, float(self.config.capacity.remote_io))
                cached = cached_bytes_from_status(st, self.node_cache_bound)
            except Exception as exc:  # informational; the rounds report push failures
                log.debug("data manager status unavailable for the overview: %s", exc)
        if not jobs:
            try:
                jobs = measurements_from_backend(self.backend)
            except Exception:
                log.exception("backend %s could not report job measurements", self.backend.name)
        if cached is None:
            cached = self.measured_cache() if self.pusher is None else None
        self._measured = {"time": now, "jobs": jobs, "cached": cached or {}}
        try:
            self.self_correct(jobs, now)
        except Exception:  # the estimates are refined later; the overview must still publish
            log.exception("could not update the measured job parameters")
        c = self.cluster()
        self._history.append({"time": now, "gpus_used": c.gpus_used, "cache_allocated": c.cache_used,
                              "remote_io_allocated": c.remote_io_used,
                              "running": c.jobs_by_state.get("running", 0), "queued": c.jobs_by_state.get("queued", 0)})
        self.publish_status()

    def push_placements(self) -> None:
        """Tell the data manager which datasets each node has a reason to mount (issue 20: a node's
        agent registers only those), from the leader's record of where admitted jobs' pods run.
        Only with a backend that keeps that record (Kubernetes) and a data manager that takes it;
        pushed when it changed, after a failure, and every minute."""
        store = getattr(self.backend, "consumption", None)
        setter = getattr(self.pusher, "set_placements", None)
        if store is None or not callable(setter):
            return
        try:
            nodes = store.placements()
            now = time.monotonic()
            # Again every minute even unchanged: a data manager that lost its state learns them back.
            if nodes != self._pushed_placements or now - getattr(self, "_placements_at", 0.0) > 60.0:
                setter(nodes)
                self._pushed_placements, self._placements_at = nodes, now
        except Exception as exc:  # the next observation retries
            log.warning("could not push placements to the data manager: %s", exc)

    def self_correct(self, measured: Mapping[str, Mapping[str, Any]], now: float) -> None:
        """Fold this interval's data-plane figures of every running job into its measured f* and
        per-core rate (measured_params.py). `measured`: {job id: {"throughput", "hit_ratio"}} from
        the data manager or the backend; Kubernetes jobs without such a figure use the rate of
        their node agents' read counters."""
        q = (select(Job.id, JobAllocationRow.remote_io, JobAllocationRow.cpu, Dataset.size, CacheAllocationRow.bytes)
             .join(Dataset, Job.dataset_id == Dataset.id)
             .join(JobAllocationRow, JobAllocationRow.job_id == Job.id)
             .outerjoin(CacheAllocationRow, CacheAllocationRow.dataset_id == Dataset.id)
             .where(Job.state == JobState.RUNNING, JobAllocationRow.running.is_(True)))
        with self.sessions() as s:
            running = list(s.execute(q))
        agents = self._agent_rates([str(r[0]) for r in running if str(r[0]) not in measured], now)
        obs = []
        for jid, io, cores, size, cache in running:
            m = measured.get(str(jid)) or agents.get(str(jid)) or {}
            rate = m.get("throughput")
            if rate is None or not math.isfinite(float(rate)) or float(rate) < 0:
                continue
            hit = m.get("hit_ratio")
            enforced = m.get("io_rate")  # what the mount enforces now, when the backend can tell
            if enforced is not None and math.isfinite(float(enforced)) and float(enforced) > 0:
                io = max(float(enforced), io or 0.0)
            counters = _counters(m, now)
            obs.append(Observation(int(jid), float(rate), None if hit is None else float(hit), io, cores, cache, size,
                                   *counters, *_service_counters(m)))
        self.measurements.observe(obs, float(self.config.capacity.remote_io), now)

    def _agent_rates(self, job_ids: list[str], now: float) -> dict[str, dict[str, float | None]]:
        """Read rate of jobs from the node agents' cumulative per-pod counters (trusted consumption)."""
        if not job_ids:
            self._consumed_seen.clear()
            return {}
        from scheduler.service.consumption import ConsumptionStore

        got = ConsumptionStore(self.sessions, self._write_lock).measured(job_ids)
        out: dict[str, dict[str, float | None]] = {}
        seen: dict[str, tuple[float, float]] = {}
        for jid, m in got.items():
            seen[jid] = (float(m.read_bytes), now)
            prev = self._consumed_seen.get(jid)
            if prev is not None and now > prev[1] and m.read_bytes >= prev[0]:
                hits = m.hit_bytes + m.miss_bytes
                out[jid] = {"throughput": (m.read_bytes - prev[0]) / (now - prev[1]),
                            "hit_ratio": m.hit_bytes / hits if hits > 0 else None,
                            # the counters themselves: the interval's own hit ratio comes from them
                            "read_bytes": float(hits), "miss_bytes": float(m.miss_bytes),
                            # the misses' service time (_service_counters: the loader term's L)
                            "miss_service_count": float(m.miss_service_count),
                            "miss_service_s": m.miss_service_us / 1e6, "miss_service_bytes": float(m.miss_service_bytes)}
        self._consumed_seen = seen
        return out

    def publish_status(self) -> None:
        """What only this process knows, for the API processes' /v1/cluster and /metrics."""
        d = self._description
        try:
            control.publish_status(self.sessions, {
                "backend": self.backend.name, "datamanager": self.datamanager_url,
                "nodes": [{"name": n.name, "gpus": n.gpus, "cache": n.cache, "labels": dict(n.labels),
                           "cache_source": n.cache_source} for n in d.nodes],
                "last_round_time": self._last_round_time, "last_push_error": self.last_push_error,
                "capacity": {"gpus": self._planned_capacity.gpus, "cache": self._planned_capacity.cache,
                             "remote_io": self._planned_capacity.remote_io},
                "rounds_total": self.rounds_total,
                "last_round_duration_s": self.round_durations[-1] if self.round_durations else 0.0,
                "measured": self._measured, "held_back": sorted(self._held_back), "history": list(self._history),
            })
        except Exception:  # status is informational; the round itself is committed
            log.exception("could not publish the scheduler status")

    def _persist(
        self, snapshot: Snapshot, plan: RoundPlan | None, reason: str, now: float, t0: float,
        held_back: tuple[JobView, ...] = (),
    ) -> tuple[Pending, int, int]:
        """Read the persisted allocation, diff it against the plan, write only the changes in one
        short transaction (scheduler/service/round_persistence.py)."""
        jobs_now, cache_now = read_current(self.sessions)
        diff = diff_round(snapshot, held_back, plan, jobs_now, cache_now, now)
        with self._write_lock:
            written = write_round(
                self.sessions, diff, policy=self.policy_name, reason=reason, active=len(snapshot.jobs),
                running=len(plan.running) if plan else 0, objective=plan.allocation.objective if plan else None,
                now=now, t0=t0, secrets=self.config.secrets,
            )
        try:  # what bound each running job, kept for when it has ended (the round itself is committed)
            record_bounds(self.sessions, self._write_lock, now, float(self.config.capacity.remote_io))
        except Exception:
            log.exception("could not store the running jobs' diagnoses")
        return written

    def _execute(self, pending: Pending) -> None:
        """Backend and data-manager actions for a committed round. Failures are recorded, not raised."""
        for job_id in pending.stop:
            try:
                self.backend.stop(job_id)
            except Exception:  # stop must be idempotent; a failing backend must not stop the loop
                log.exception("backend failed to stop job %s", job_id)
        self.storage.push(pending.cache, pending.io, pending.cache_mode, pending.autocache)
        for alloc in pending.update:
            try:
                self.backend.update(alloc.job_id, alloc)
            except Exception:  # the job keeps its old limit; the next change retries
                log.exception("backend failed to update job %s", alloc.job_id)
        failed: dict[str, str] = {}
        for spec, alloc in pending.start:
            try:
                if self.job_tokens is not None and (spec.program is not None
                                                    or getattr(self.backend, "report_tokens", False)):
                    spec = replace(spec, report_token=self.job_tokens(spec))
                self.backend.start(spec, alloc)
            except Exception as exc:  # the job fails, the service carries on
                log.warning("backend failed to start job %s: %s", spec.job_id, exc)
                failed[spec.job_id] = f"backend could not start the job: {exc}"
        if failed:
            self.apply_events(JobEvent(job_id, "failed", message=msg) for job_id, msg in failed.items())
            self.trigger("finish")

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


def cached_bytes_from_status(status: Any, node_cache: Callable[[str], float] | None = None) -> dict[str, float] | None:
    """Bytes in cache per dataset from the data manager's `GET /v1/status` (datamanager/state.py),
    or None when the answer has no per-dataset figures.

    A dataset's cache allocation applies to its cache on every node that mounts it, so the
    filled part of the allocation is the fullest node's cache (`nodes.*.datasets.*.cached_bytes`),
    not the sum over nodes (the same items cached on two nodes fill no more of it). Without the
    per-node view, `datasets.*.cached_bytes_all_nodes` is used.

    `node_cache(node)`: the most that node's disk holds; a node whose datasets add up to more
    (its agent reported what no disk of it can hold, issue 20) has its figures scaled down to it."""
    if not isinstance(status, Mapping) or not isinstance(status.get("datasets"), Mapping):
        return None
    out: dict[str, float] = {}
    nodes = status.get("nodes")
    if isinstance(nodes, Mapping):
        for node_name, node in nodes.items():
            figures = {name: max(_float((entry or {}).get("cached_bytes")), 0.0)
                       for name, entry in ((node or {}).get("datasets") or {}).items()}
            total = sum(figures.values())
            bound = node_cache(str(node_name)) if node_cache is not None else total
            scale = 1.0 if total <= bound or total <= 0 else bound / total
            for name, value in figures.items():
                out[name] = max(out.get(name, 0.0), value * scale)
    else:
        for name, entry in status["datasets"].items():
            out[name] = float((entry or {}).get("cached_bytes_all_nodes") or 0.0)
    for name in status["datasets"]:
        out.setdefault(name, 0.0)  # known to the manager, mounted nowhere: nothing cached
    return out


def _float(value: Any) -> float:
    try:
        f = float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def count_rows(engine: Engine, model: type) -> int:
    """Rows in a table (tests and benchmarks)."""
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def purge_audit(engine: Engine, before: float) -> int:
    """Delete audit rows older than `before` (unix seconds); the trail otherwise grows forever."""
    with Session(engine) as s, s.begin():
        return s.execute(delete(AllocationChange).where(AllocationChange.time < before)).rowcount or 0
