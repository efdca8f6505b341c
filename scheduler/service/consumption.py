"""Trusted consumption: what node agents measured each pod of an admitted workload read.

Who may say what (docs/kubernetes.md, "Trusted consumption"):

- Which pods belong to which job is the scheduling leader's record (`workload_pods`), built from
  the API server: a pod counts for a job only when its controller chain (ownerReferences with
  `controller: true`, Pod -> Job [-> JobSet], Pod -> PyTorchJob) ends at the uid of a workload
  silod admitted, in the workload's namespace, and the pod is bound to one of the nodes silod
  placed that admission on. Labels and annotations, which the workload's owner can write at any
  time, play no part; the first attribution of a pod uid is kept.
- How much a pod read comes only from the node agent of the pod's node, authenticated by a token
  bound to that node (`silod serve --node-agent USER=NODE`): a report about a pod on another node
  is ignored, a report for another node is refused (403), and tenants' tokens are refused (403).
- Counters are cumulative and only ever raised (per column `max`, in one UPDATE statement, so
  concurrent reports from several API workers cannot lower them): a replayed, reordered or lower
  report changes nothing.

What a workload's owner can still do is make its pods really read more through the mount; the
service believes any progress only up to what the job's f* allows since the last believed report
(SchedulerService._plausible_progress), so that is no faster than running it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from contextlib import nullcontext

from sqlalchemy import Connection, Select, bindparam, case, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from contract.names import storage_key
from scheduler.service.db.models import ACTIVE_STATES, Dataset, Job, NodeCacheDisk, PodConsumption, WorkloadPod

COUNTERS = ("read_bytes", "hit_bytes", "miss_bytes", "hits", "misses", "miss_service_count", "miss_service_us",
            "miss_service_bytes")
# No pod reads 2^53 bytes (9 PB: a 100 Gbit/s link for 8 days) or items: a larger counter is a
# forged or broken report, refused at the API (schemas.PodConsumptionIn). Keeping every stored
# value below 2^53 also keeps it exact as a float (SQLite's overflow-free total()).
MAX_COUNTER = 2**53
MAX_PODS_PER_REPORT = 1000


@dataclass(frozen=True, slots=True)
class PodReport:
    pod_uid: str
    read_bytes: int
    hit_bytes: int
    miss_bytes: int
    hits: int
    misses: int
    # The pod's misses delivered whole, their summed service time (us) and bytes (0: an agent
    # from before these counters, or no miss served yet).
    miss_service_count: int = 0
    miss_service_us: int = 0
    miss_service_bytes: int = 0


@dataclass(frozen=True, slots=True)
class AdmittedPod:
    pod_uid: str
    job_id: str
    node: str
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Ignored:
    pod_uid: str
    reason: str


@dataclass(frozen=True, slots=True)
class ReportResult:
    accepted: int
    ignored: tuple[Ignored, ...]


@dataclass(frozen=True, slots=True)
class Measured:
    """A job's measured consumption, summed over its pods on every node."""

    read_bytes: int
    hit_bytes: int
    miss_bytes: int
    hits: int
    misses: int
    miss_service_count: int
    miss_service_us: int
    miss_service_bytes: int
    pods: int
    updated_at: float


class ConsumptionStore:
    def __init__(self, sessions: sessionmaker, write_lock: threading.RLock | None = None,
                 clock=time.time) -> None:
        self.sessions = sessions
        self.lock = write_lock or threading.RLock()
        self.clock = clock

    # --- the leader's side -------------------------------------------------------------------

    def record_pods(self, pods: Iterable[AdmittedPod]) -> int:
        """Remember pods of admitted workloads; a uid already known keeps its first job."""
        pods = list(pods)
        if not pods:
            return 0
        now = self.clock()
        added = 0
        with self.lock, self.sessions.begin() as s:
            known = set(s.scalars(select(WorkloadPod.pod_uid).where(WorkloadPod.pod_uid.in_([p.pod_uid for p in pods]))))
            for p in pods:
                if p.pod_uid in known:
                    continue
                s.add(WorkloadPod(pod_uid=p.pod_uid, job_id=int(p.job_id), node=p.node, namespace=p.namespace,
                                  name=p.name, seen_at=now))
                known.add(p.pod_uid)
                added += 1
        return added

    def placements(self) -> dict[str, list[str]]:
        """node -> the storage keys it has a reason to mount: those of active jobs with a pod bound
        to it (the data manager lets a node's agent register only these, PUT /v1/placements)."""
        out: dict[str, set[str]] = {}
        with self.sessions() as s:
            rows = s.execute(select(WorkloadPod.node, Dataset.id, Dataset.name).distinct()
                             .join(Job, Job.id == WorkloadPod.job_id).join(Dataset, Dataset.id == Job.dataset_id)
                             .where(Job.state.in_(ACTIVE_STATES)))
            for node, ds_id, ds_name in rows:
                out.setdefault(str(node), set()).add(storage_key(int(ds_id), str(ds_name)))
        return {n: sorted(keys) for n, keys in sorted(out.items())}

    # --- the agents' side (API workers) ---------------------------------------------------------

    def record_report(self, node: str, agent: str, reports: Sequence[PodReport]) -> ReportResult:
        now = self.clock()
        ignored: list[Ignored] = []
        accepted = 0
        with self.lock:
            with self.sessions() as s:
                known = {w.pod_uid: w for w in s.scalars(
                    select(WorkloadPod).where(WorkloadPod.pod_uid.in_([r.pod_uid for r in reports])))}
            for r in reports:
                w = known.get(r.pod_uid)
                if w is None:
                    ignored.append(Ignored(r.pod_uid, "not a pod of a workload silod admitted (or not seen by the"
                                                      " scheduler yet: a later report, cumulative, counts it)"))
                    continue
                if w.node != node:
                    ignored.append(Ignored(r.pod_uid, f"pod {w.namespace}/{w.name} runs on node {w.node}, not {node}"))
                    continue
                self._raise_counters(node, agent, w.job_id, r, now)
                accepted += 1
        return ReportResult(accepted, tuple(ignored))

    def record_cache_disk(self, node: str, agent: str, capacity_bytes: float) -> None:
        """The node's agent says its cache directory holds `capacity_bytes` (the latest wins)."""
        now = self.clock()
        with self.lock:
            for _ in range(2):
                with self.sessions.begin() as s:
                    row = s.get(NodeCacheDisk, node)
                    if row is not None:
                        row.capacity_bytes, row.agent, row.reported_at = float(capacity_bytes), agent, now
                        return
                try:
                    with self.sessions.begin() as s:
                        s.add(NodeCacheDisk(node=node, capacity_bytes=float(capacity_bytes), agent=agent, reported_at=now))
                    return
                except IntegrityError:
                    continue  # another worker inserted it meanwhile: update it instead

    def cache_disks(self, max_age_s: float) -> dict[str, float]:
        """node -> the cache bytes its agent reported within the last `max_age_s` seconds (an
        older report may be of a disk that was replaced, or of an agent that is gone)."""
        since = self.clock() - max_age_s
        with self.sessions() as s:
            return {str(n): float(c) for n, c in s.execute(
                select(NodeCacheDisk.node, NodeCacheDisk.capacity_bytes).where(NodeCacheDisk.reported_at >= since))}

    def _raise_counters(self, node: str, agent: str, job_id: int, r: PodReport, now: float) -> None:
        cols = {c: getattr(PodConsumption, c) for c in COUNTERS}
        raise_ = {c: case((cols[c] < getattr(r, c), getattr(r, c)), else_=cols[c]) for c in COUNTERS}
        stmt = (update(PodConsumption)
                .where(PodConsumption.node == node, PodConsumption.pod_uid == r.pod_uid)
                .values(**raise_, agent=agent, updated_at=now)
                .execution_options(synchronize_session=False))
        for _ in range(2):
            with self.sessions.begin() as s:
                if s.execute(stmt).rowcount:
                    return
            try:
                with self.sessions.begin() as s:
                    s.add(PodConsumption(node=node, pod_uid=r.pod_uid, job_id=job_id, agent=agent, first_at=now,
                                         updated_at=now, **{c: getattr(r, c) for c in COUNTERS}))
                return
            except IntegrityError:
                continue  # another worker inserted it meanwhile: raise its counters instead

    # --- reading ------------------------------------------------------------------------------

    def measured(self, job_ids: Iterable[str], connection: Connection | None = None) -> dict[str, Measured]:
        """What the node agents reported of these jobs' pods, summed per job. `connection`: read
        on it (GET /v1/jobs/{id} reads the job on the same one), else on one of its own."""
        ids = [int(j) for j in job_ids if str(j).isdigit()]
        if not ids:
            return {}
        engine = self.sessions.kw["bind"]
        # A prebuilt statement on a plain connection (GET /v1/jobs/{id} calls this per request:
        # building the query and an ORM session each time cost more than the query itself).
        q = _measured_query(engine.dialect.name == "sqlite", len(ids) == 1)
        with nullcontext(connection) if connection is not None else engine.connect() as c:
            rows = c.execute(q, {"jid": ids[0]} if len(ids) == 1 else {"ids": ids})
            n = len(COUNTERS)
            return {str(row[0]): Measured(*(int(v or 0) for v in row[1:n + 1]), pods=int(row[n + 1]), updated_at=float(row[n + 2]))
                    for row in rows}


@functools.cache
def _measured_query(sqlite: bool, one: bool) -> Select:
    # SQLite's SUM of integers raises "integer overflow" past 2^63 (two legal-looking rows
    # suffice); its total() is a float and never overflows. PostgreSQL's SUM(bigint) is a
    # numeric, which cannot overflow.
    add = func.total if sqlite else func.sum
    which = (PodConsumption.job_id == bindparam("jid") if one
             else PodConsumption.job_id.in_(bindparam("ids", expanding=True)))
    return (select(PodConsumption.job_id, *(add(getattr(PodConsumption, c)) for c in COUNTERS),
                   func.count(), func.max(PodConsumption.updated_at))
            .where(which).group_by(PodConsumption.job_id))
