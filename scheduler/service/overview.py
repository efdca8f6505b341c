"""What a person watching the cluster sees: the web view (/ui), `silod top` and the per-job and
per-dataset gauges of /metrics all render this one overview, so they cannot disagree.

`build_overview` reads the database (jobs, allocations, datasets) and the status the scheduling
process publishes (measurements from the data manager or the backend, jobs held back by quota,
a short utilisation history). `wait_reason` is a pure function of that state, tested on its
own; what bounds a running job is scheduler/service/diagnosis.py's, the job view's and /metrics'.

A tenant sees its own jobs and the datasets it owns or was granted; the cluster's totals and
each waiting job's position in the whole queue are visible to everyone (as `GET /v1/cluster`
is), never another tenant's job names.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from contract.names import storage_key
from scheduler.service.consumption import ConsumptionStore
from scheduler.service.db.models import (
    ACTIVE_STATES,
    CacheAllocationRow,
    Dataset,
    DatasetGrant,
    Job,
    JobAllocationRow,
    JobMeasurementRow,
    JobState,
    TenantJobCount,
)
from scheduler.service.diagnosis import running_jobs
from scheduler.service.types import Principal

QUOTA_REASON = "held back by the tenant's quota (GPUs or running jobs)"


@dataclass(frozen=True, slots=True)
class QueuedJob:
    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
    priority: int
    submit_time: float
    position: int  # 1 = next in line, among every tenant's waiting jobs
    reason: str


@dataclass(frozen=True, slots=True)
class RunningJob:
    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
    ideal_throughput: float  # f*, bytes/s
    progress: float  # 0..1
    cache_bytes: float | None  # the dataset's cache allocation (shared by its readers)
    dataset_bytes: float
    remote_io: float | None  # bytes/s cap; None = not managed
    hit_ratio: float | None  # measured: hit bytes / read bytes (None: no measurement yet)
    throughput: float | None  # measured read throughput, bytes/s
    predicted_throughput: float  # SiloDPerf (with the CPU stage) of what it holds
    bound: str  # what limits it by the model: "gpu" | "cpu" | "cache" | "remote_io"


@dataclass(frozen=True, slots=True)
class DatasetRow:
    name: str
    owner: str
    key: str
    size: float
    allocated: float  # cache allocated, bytes
    cached: float | None  # measured, bytes (None: no measurement)


@dataclass(frozen=True, slots=True)
class Overview:
    time: float
    policy: str
    gpus_total: int
    gpus_used: int
    cache_total: float
    cache_allocated: float
    remote_io_total: float
    remote_io_allocated: float
    queued_total: int  # every tenant's waiting jobs (a count, no names)
    running_total: int
    queue: tuple[QueuedJob, ...]
    running: tuple[RunningJob, ...]
    datasets: tuple[DatasetRow, ...]
    history: tuple[dict[str, float], ...] = field(default_factory=tuple)
    measured_at: float | None = None
    #: None while rounds run normally; else what keeps the scheduler from placing jobs now, e.g.
    #: "scheduler starting: compiling policy kernels, 12 s" (control.scheduling_note)
    scheduling: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["history"] = [dict(h) for h in self.history]
        return out


def wait_reason(job_gpus: int, free_gpus: int, held_by_quota: bool, passed_by: int, policy: str,
                scheduling: str | None = None, message: str = "") -> str:
    """Why a queued job is not running, in words a user can act on. `scheduling`: what keeps
    the scheduler from placing anything now (control.scheduling_note), which is then the
    reason, not the policy. `message`: the job's own; a backend's "unschedulable: ..." (no node
    can take its pods, kube-scheduler's refusal) is the reason it is held back, not a quota."""
    if message.startswith("unschedulable"):
        return message
    if held_by_quota:
        return QUOTA_REASON
    if job_gpus > free_gpus:
        text = f"needs {job_gpus} GPUs, {free_gpus} free"
        if passed_by:
            text += f"; {passed_by} later job(s) started on free GPUs (backfilling)"
        return text
    if scheduling is not None:
        return f"GPUs are free; no round can place it yet ({scheduling})"
    return f"GPUs are free; waiting for the next round ({policy} gave it no share yet)"


def queue_order(jobs: Sequence[Job]) -> list[Job]:
    """The order waiting jobs are considered in: priority first, then arrival (as quota
    admission and FIFO order them)."""
    return sorted(jobs, key=lambda j: (-j.priority, j.submit_time, j.id))


#: A caller with at most this many waiting jobs gets each one's queue position from three
#: index range counts; one with more reads every waiting job's queue key once (its own jobs are
#: then a large share of the cost anyway).
POSITION_QUERIES = 32

_J = Job.__table__.c
_WAITING = _J.state == JobState.QUEUED
# Every tenant's waiting jobs: the triggers' counts (TenantJobCount), not a count of rows.
_COUNT_WAITING = select(func.coalesce(func.sum(TenantJobCount.n), 0)).where(TenantJobCount.state == JobState.QUEUED.value)


def _position(s: Session, priority: int, submit: float, jid: int) -> int:
    """1 + the waiting jobs ahead of (priority, submit, id) in queue_order, by index range counts
    (ix_jobs_state_priority_submit): O(log n) seeks, never a row of another tenant's loaded."""
    ahead = 0
    for cond in ((_J.priority > priority,), (_J.priority == priority, _J.submit_time < submit),
                 (_J.priority == priority, _J.submit_time == submit, _J.id < jid)):
        ahead += s.scalar(select(func.count()).select_from(Job.__table__).where(_WAITING, *cond)) or 0
    return ahead + 1


def build_overview(sessions: sessionmaker, who: Principal, *, capacity: Any, policy: str,
                   status: Mapping[str, Any], now: float | None = None, queue_limit: int | None = None,
                   scheduling: str | None = None) -> Overview:
    """The caller's picture. Its cost grows with the caller's own jobs and datasets and with the
    running jobs (bounded by the GPUs), not with other tenants' queues (issue 47: 12,000 queued
    jobs of one tenant made every other tenant's overview take seconds): the cluster's totals
    are aggregates and each waiting job's position is a count over an index. `scheduling`:
    what keeps the scheduler from placing jobs now (control.scheduling_note), or None."""
    now = time.time() if now is None else now
    measured = status.get("measured") or {}
    m_jobs: Mapping[str, Mapping[str, Any]] = measured.get("jobs") or {}
    m_cached: Mapping[str, float] = measured.get("cached") or {}
    held = set(status.get("held_back") or ())
    with sessions() as s:
        queued_total = s.scalar(_COUNT_WAITING) or 0
        # Every running job's queue key and holdings: as many as the GPUs allow, no more.
        running_keys = list(s.execute(
            select(Job.id, Job.owner, Job.gpus, Job.priority, Job.submit_time, JobAllocationRow.remote_io)
            .outerjoin(JobAllocationRow, JobAllocationRow.job_id == Job.id).where(Job.state == JobState.RUNNING)))
        cache_allocated = s.scalar(select(func.coalesce(func.sum(CacheAllocationRow.bytes), 0.0))) or 0.0
        if who.is_admin:
            own_running = sorted(s.scalars(select(Job).where(Job.state == JobState.RUNNING)).unique(), key=lambda j: j.id)
            # Every waiting job in queue_order (`queue_limit`: the first ones, /metrics' series):
            # its place in the list is its position.
            wq = select(Job).where(_WAITING).order_by(Job.priority.desc(), Job.submit_time, Job.id)
            own_waiting = list(s.scalars(wq if queue_limit is None else wq.limit(queue_limit)).unique())
            positions = {j.id: i for i, j in enumerate(own_waiting, start=1)}
        else:
            # By owner (ix_jobs_owner), states split here: a filter on the state as well let
            # SQLite walk every tenant's waiting jobs through the state's index instead.
            own = list(s.scalars(select(Job).where(Job.owner == who.user, Job.state.in_(ACTIVE_STATES))).unique())
            own_running = sorted((j for j in own if JobState(j.state) == JobState.RUNNING), key=lambda j: j.id)
            own_waiting = queue_order([j for j in own if JobState(j.state) != JobState.RUNNING])[:queue_limit]
            if len(own_waiting) <= POSITION_QUERIES:
                positions = {j.id: _position(s, j.priority, j.submit_time, j.id) for j in own_waiting}
            else:
                keys = sorted((-p, t, i) for i, p, t in s.execute(
                    select(Job.id, Job.priority, Job.submit_time).where(_WAITING)))
                positions = {j.id: bisect.bisect_left(keys, (-j.priority, j.submit_time, j.id)) + 1
                             for j in own_waiting}
        # A job measured faster than it declared may read at its measured f* (measured_params.py)
        ids = [j.id for j in own_running]
        measured_fstar = {jid: f for jid, f in s.execute(
            select(JobMeasurementRow.job_id, JobMeasurementRow.ideal_throughput)
            .where(JobMeasurementRow.job_id.in_(ids))) if f is not None} if ids else {}
        dq = select(Dataset)
        if not who.is_admin:
            granted = select(DatasetGrant.dataset_id).where(DatasetGrant.grantee == who.user)
            dq = dq.where((Dataset.owner == who.user) | Dataset.id.in_(granted))
        visible_datasets = list(s.scalars(dq.order_by(Dataset.name, Dataset.owner)))
        wanted = {j.dataset_id for j in own_running} | {d.id for d in visible_datasets}
        cache_rows = {r.dataset_id: r.bytes for r in s.scalars(
            select(CacheAllocationRow).where(CacheAllocationRow.dataset_id.in_(wanted)))} if wanted else {}
        # What bounds each running job: the one diagnosis the job view and /metrics read.
        diagnosed = running_jobs(s, now, float(capacity.remote_io), ids)
    gpus_used = sum(r.gpus for r in running_keys)
    free = max(int(capacity.gpus) - gpus_used, 0)
    running_order = [(-r.priority, r.submit_time, r.id) for r in running_keys]
    queue: list[QueuedJob] = []
    for j in own_waiting:
        key = (-j.priority, j.submit_time, j.id)
        passed_by = sum(1 for r in running_order if r > key)
        queue.append(QueuedJob(str(j.id), j.name, j.owner, j.gpus, j.dataset.name, j.priority, j.submit_time,
                               positions[j.id], wait_reason(j.gpus, free, str(j.id) in held, passed_by, policy, scheduling,
                                                                 j.message or "")))
    # Kubernetes: the node agents' per-pod counters (trusted consumption) give the hit ratio of
    # jobs the data manager and the backend have no figure for.
    agents = ConsumptionStore(sessions, None).measured(str(j.id) for j in own_running if str(j.id) not in m_jobs)
    rows: list[RunningJob] = []
    for j in own_running:
        a = j.allocation
        cache = cache_rows.get(j.dataset_id)
        m = m_jobs.get(str(j.id)) or {}
        pods = agents.get(str(j.id))
        if not m and pods is not None and pods.hit_bytes + pods.miss_bytes > 0:
            m = {"hit_ratio": pods.hit_bytes / (pods.hit_bytes + pods.miss_bytes)}
        remote_io = a.remote_io if a else None
        found = diagnosed.get(j.id)
        # A job that stopped running between the two reads above has no diagnosis: none shown.
        predicted, bound = (found[1].throughput, found[1].bound) if found else (0.0, "-")
        rows.append(RunningJob(
            str(j.id), j.name, j.owner, j.gpus, j.dataset.name, j.ideal_throughput,
            min(j.consumed_bytes / j.total_bytes, 1.0) if j.total_bytes > 0 else 0.0,
            cache, j.dataset.size, remote_io, _finite(m.get("hit_ratio")), _at_most(_finite(m.get("throughput")),
                                                                                   max(j.ideal_throughput, measured_fstar.get(j.id, 0.0))),
            predicted, bound,
        ))
    datasets = []
    for d in visible_datasets:
        key = storage_key(d.id, d.name)
        cached = m_cached.get(key)
        datasets.append(DatasetRow(d.name, d.owner, key, d.size, float(cache_rows.get(d.id, 0.0)),
                                   None if cached is None else float(cached)))
    io_used = sum((r.remote_io or 0.0) for r in running_keys)
    return Overview(
        time=now, policy=policy, gpus_total=int(capacity.gpus), gpus_used=gpus_used,
        cache_total=float(capacity.cache), cache_allocated=float(cache_allocated),
        remote_io_total=float(capacity.remote_io), remote_io_allocated=float(io_used),
        queued_total=int(queued_total), running_total=len(running_keys), queue=tuple(queue), running=tuple(rows),
        datasets=tuple(datasets), history=tuple(dict(h) for h in status.get("history") or ()),
        measured_at=measured.get("time"), scheduling=scheduling,
    )


def _finite(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _at_most(value: float | None, bound: float) -> float | None:
    """A node agent's figure for a job, never above what the job can consume (its f*, declared or
    measured, the bound its believed progress has too): what a hit-only report claims beyond it
    is not believed."""
    return None if value is None else min(value, bound)


def measurements_from_datamanager(status: Any, link: float | None = None) -> dict[str, dict[str, float | None]]:
    """Per job: measured hit ratio and read throughput, summed over the job's mounts on every
    node, from the data manager's `GET /v1/status` (datamanager/state.py).

    `link`: the most a node reads from remote storage (bytes/s; the cluster's remote-IO capacity,
    which no node's link exceeds as far as silod knows). Figures come from the node agents; a node
    whose jobs' remote reads add up to more than that (an agent reporting what its link cannot
    carry, issue 20) has its jobs' figures scaled down to it. A mount's remote rate is its
    `remote_rate_bytes_per_s`, else its throughput times its miss share (the whole throughput
    when it reports no hit/miss counters)."""
    out: dict[str, dict[str, float]] = {}
    if not isinstance(status, Mapping):
        return {}
    for node in (status.get("nodes") or {}).values():
        mounts: list[tuple[str, float, float, float, float | None, tuple[float, float, float] | None]] = []
        # (job, hit, miss, throughput, age, per-miss service counters)
        remote = 0.0
        for entry in ((node or {}).get("datasets") or {}).values():
            for job, j in ((entry or {}).get("jobs") or {}).items():
                j = j if isinstance(j, Mapping) else {}
                hit, miss = _finite(j.get("hit_bytes")) or 0.0, _finite(j.get("miss_bytes")) or 0.0
                tput = _finite(j.get("throughput_bytes_per_s")) or 0.0
                rate = _finite(j.get("remote_rate_bytes_per_s"))
                remote += rate if rate is not None else (tput * miss / (hit + miss) if hit + miss > 0 else tput)
                service = _service(j.get("miss_service_count"), j.get("miss_service_s"), j.get("miss_service_bytes"))
                mounts.append((str(job), hit, miss, tput, _finite(j.get("stats_age_s")), service))
        scale = link / remote if link is not None and link > 0 and remote > link else 1.0
        for job, hit, miss, tput, age, service in mounts:
            acc = out.setdefault(job, {"hit": 0.0, "miss": 0.0, "throughput": 0.0, "age": 0.0, "counted": 1.0,
                                       "sv_count": 0.0, "sv_s": 0.0, "sv_bytes": 0.0, "sv": 1.0})
            if service is None:
                acc["sv"] = 0.0  # one of its mounts does not measure it: no sum over all of them
            else:
                acc["sv_count"] += service[0]
                acc["sv_s"] += service[1]
                acc["sv_bytes"] += service[2]
            acc["hit"] += hit
            acc["miss"] += miss
            acc["throughput"] += tput * scale
            # Counters are believed only where the node's figures are (scale 1) and dated.
            if scale < 1.0 or age is None or age < 0:
                acc["counted"] = 0.0
            else:
                acc["age"] = max(acc["age"], age)
    res: dict[str, dict[str, float | None]] = {}
    for job, a in out.items():
        res[job] = {"hit_ratio": (a["hit"] / (a["hit"] + a["miss"])) if a["hit"] + a["miss"] > 0 else None,
                    "throughput": a["throughput"]}
        if a["counted"]:
            # Cumulative counters of the job's mounts (summed over nodes) and their age: the
            # scheduler's measured parameters take each interval's own rate and hit ratio from them.
            res[job].update(read_bytes=a["hit"] + a["miss"], miss_bytes=a["miss"], age_s=a["age"])
            if a["sv"]:
                res[job].update(miss_service_count=a["sv_count"], miss_service_s=a["sv_s"],
                                miss_service_bytes=a["sv_bytes"])
    return res


def _service(count: Any, seconds: Any, nbytes: Any) -> tuple[float, float, float] | None:
    """A mount's cumulative per-miss service counters (count, seconds, bytes), or None when it
    reports none or a malformed figure."""
    c, t, b = _finite(count), _finite(seconds), _finite(nbytes)
    if c is None or t is None or b is None or min(c, t, b) < 0:
        return None
    return c, t, b


def measurements_from_backend(backend: Any) -> dict[str, dict[str, float | None]]:
    """Per running job from a backend that can tell (the local backend's workers' status files)."""
    running = getattr(backend, "running_jobs", None)
    status_of = getattr(backend, "job_status", None)
    if not callable(running) or not callable(status_of):
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for job_id in running():
        st = status_of(job_id) or {}
        mount = st.get("mount") or {}
        out[str(job_id)] = {"hit_ratio": _finite(st.get("hit_ratio")), "throughput": _finite(st.get("throughput")),
                            # the rate its mount's token bucket enforces now (work conservation may
                            # lend it more than its allocation): the IO bound of its last interval
                            "io_rate": _finite(mount.get("io_rate_bytes_per_s"))}
        read, miss, at = _finite(mount.get("read_bytes")), _finite(mount.get("miss_bytes")), _finite(st.get("updated_at"))
        if read is not None and miss is not None and at is not None:
            # the mount's cumulative counters as of the worker's status (wall-clock time)
            out[str(job_id)].update(read_bytes=read, miss_bytes=miss, at=at)
            sv = mount.get("miss_service")
            service = _service(sv.get("count"), sv.get("sum_s"), sv.get("bytes")) if isinstance(sv, Mapping) else None
            if service is not None:
                out[str(job_id)].update(miss_service_count=service[0], miss_service_s=service[1],
                                        miss_service_bytes=service[2])
    return out
