"""Read-only views over the service's tables (cluster usage, allocations, the audit trail),
shared by the scheduling process (SchedulerService) and the API processes (ApiService)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker

from contract.names import storage_key
from policies.types import ClusterCapacity
from scheduler.backends.base import ClusterDescription
from scheduler.service.db.models import (
    AllocationChange,
    CacheAllocationRow,
    Dataset,
    DatasetGrant,
    Job,
    JobAllocationRow,
    JobState,
    Round,
    TenantJobCount,
)
from scheduler.service.overview import Overview, build_overview
from scheduler.service.types import (
    AllocationsRecord,
    CacheAllocationRecord,
    ChangeRecord,
    ClusterRecord,
    ForbiddenError,
    JobAllocationRecord,
    NotFoundError,
    Principal,
    ServiceConfig,
)


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """What the scheduling process knows beyond the tables."""

    description: ClusterDescription
    backend: str
    datamanager: str | None
    last_round_time: float | None
    last_push_error: str | None
    #: What the last round planned with (Kubernetes: the Ready GPU nodes, capped by the flags);
    #: None: the flags (no round yet, or a backend without a view of its own).
    capacity: ClusterCapacity | None = None


class ReadViews:
    sessions: sessionmaker
    config: ServiceConfig
    policy_name: str

    def _status(self) -> ClusterStatus:
        raise NotImplementedError

    def _overview_status(self) -> Mapping[str, Any]:
        """The scheduling process's published measurements, held-back jobs and history."""
        raise NotImplementedError

    def overview(self, who: Principal, queue_limit: int | None = None) -> Overview:
        """The web view's, `silod top`'s and /metrics' picture (scheduler/service/overview.py);
        `queue_limit`: only the first waiting jobs (/metrics gives no series to the others)."""
        from scheduler.service.control import scheduling_note

        capacity = self._status().capacity or self.config.capacity
        return build_overview(self.sessions, who, capacity=capacity, policy=self.policy_name,
                              status=self._overview_status(), queue_limit=queue_limit,
                              scheduling=scheduling_note(self.sessions))

    # ------------------------------------------------------------------ cluster / allocations

    def cluster(self) -> ClusterRecord:
        with self.sessions() as s:
            # The triggers' per-tenant counts (TenantJobCount): no count over every job ever submitted.
            counts = {k: v for k, v in s.execute(select(TenantJobCount.state, func.sum(TenantJobCount.n))
                                                 .group_by(TenantJobCount.state)).all() if v}
            gpus_used = s.scalar(select(func.coalesce(func.sum(JobAllocationRow.gpus), 0))) or 0
            io_used = s.scalar(
                select(func.coalesce(func.sum(JobAllocationRow.remote_io), 0.0)).where(JobAllocationRow.running)
            ) or 0.0
            cache_used = s.scalar(select(func.coalesce(func.sum(CacheAllocationRow.bytes), 0.0))) or 0.0
        st = self._status()
        return ClusterRecord(
            description=st.description,
            capacity=st.capacity or self.config.capacity,
            gpus_used=int(gpus_used),
            cache_used=float(cache_used),
            remote_io_used=float(io_used),
            jobs_by_state={JobState(k).value: int(v) for k, v in counts.items()},
            backend=st.backend,
            datamanager=st.datamanager,
            last_round_time=st.last_round_time,
            last_push_error=st.last_push_error,
        )

    def cpu_and_bottlenecks(self) -> tuple[float, dict[str, int]]:
        """Cores allocated to running jobs, and how many running jobs each resource bounds now
        (scheduler/service/diagnosis.py, what the job view and the overview read; the metrics
        read this at scrape time)."""
        from estimator.pipeline import RESOURCES

        from scheduler.service.diagnosis import running_jobs

        with self.sessions() as s:
            found = running_jobs(s, time.time(), float(self.config.capacity.remote_io))
        counts = {r: 0 for r in RESOURCES}
        for _, b in found.values():
            counts[b.bound] += 1
        return float(sum(i.cores for i, _ in found.values() if i.cores is not None and math.isfinite(i.cores))), counts

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
            cq = select(CacheAllocationRow.bytes, Dataset.id, Dataset.name, Dataset.owner, Dataset.size).join(Dataset)
            if not who.is_admin:  # your datasets and those shared with you; others' names are not yours to see
                granted = select(DatasetGrant.dataset_id).where(DatasetGrant.grantee == who.user)
                cq = cq.where((Dataset.owner == who.user) | Dataset.id.in_(granted))
            cache = tuple(
                CacheAllocationRecord(name, owner, storage_key(did, name), b, size)
                for b, did, name, owner, size in s.execute(cq.order_by(Dataset.name, Dataset.owner))
            )
        return AllocationsRecord(
            round_id=last.id if last else None, time=last.time if last else None,
            policy=self.policy_name, jobs=jobs, cache=cache,
        )

    def job_allocation_history(self, who: Principal, job_id: str, limit: int = 100) -> list[ChangeRecord]:
        """One job's allocation changes (GPUs, share, remote IO, cores), newest first: its owner's
        (or the admin's) to read. Another tenant's job is not found, as GET /v1/jobs/{id} says."""
        from scheduler.service.catalogue import parse_job_id

        pk = parse_job_id(job_id)
        with self.sessions() as s:
            owner = s.scalar(select(Job.owner).where(Job.id == pk)) if pk is not None else None
            if owner is None or (not who.is_admin and owner != who.user):
                raise NotFoundError(f"no job with id {job_id!r}", field="job_id")
            q = (select(AllocationChange).where(AllocationChange.subject_kind == "job",
                                                AllocationChange.subject == str(pk))
                 .order_by(AllocationChange.id.desc()).limit(limit))
            return [
                ChangeRecord(c.id, c.round_id, c.time, c.subject_kind, c.subject, c.resource, c.old_value, c.new_value)
                for c in s.scalars(q)
            ]

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

