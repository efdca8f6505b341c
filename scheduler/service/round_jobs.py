"""Stage 2 of a round, the jobs: the active jobs' rows read in one query, turned into JobViews.

A round over 30,000 active jobs spent most of its CPU here (issue 20: it competes with the API
workers on a small machine and raised their p99 during rounds). Between two rounds almost every
row is unchanged (only running jobs progress, few change state), so `RoundJobs` keeps the view it
built for each row and builds a view again only for a row whose columns differ from last round's.
A view is a pure function of the row's columns and of whether the job's client report is still
fresh at `now` (the only way time enters `planned`; a running job past its declared work, whose
remaining work depends on `now`, is never reused), so both are the key: a reused view is the
view that building it again would give. Rows are read with a Core select on the connection, not
through the ORM's result processing.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Select, String, select, type_coerce

from contract.names import storage_key
from policies.types import JobView
from scheduler.service.db.models import ACTIVE_STATES, Dataset, Job, JobMeasurementRow, JobState
from scheduler.service.measured_params import client_report_fresh, loader_miss_rate, planned
from scheduler.service.quota_admission import TenantJob
from scheduler.service.types import access_from_row, pipeline_from_row

# The columns `_build` reads, in this order. The state is read as its stored string (a StrEnum
# compares equal to it), sparing the Enum type's per-row result processing.
_QUERY: Select = (
    select(
        Job.id, Job.gpus, Dataset.id, Dataset.name, Job.ideal_throughput, Job.total_bytes, Job.consumed_bytes,
        Job.submit_time, type_coerce(Job.state, String), Job.priority, Dataset.size, Job.owner, Job.access,
        Job.curriculum_starting_percent, Job.curriculum_alpha, Job.curriculum_step, Job.curriculum_batch,
        Job.cpu_rate, Job.autocache_expansion, Job.post_cpu_rate,
        JobMeasurementRow.ideal_throughput, JobMeasurementRow.cpu_rate, JobMeasurementRow.client_step_s,
        JobMeasurementRow.client_batch_bytes, JobMeasurementRow.client_at, Job.start_time, JobMeasurementRow.observed,
        Job.loader_workers, Job.loader_item_bytes, JobMeasurementRow.miss_service_s, JobMeasurementRow.miss_item_bytes,
    )
    .join(Dataset, Job.dataset_id == Dataset.id)
    .outerjoin(JobMeasurementRow, JobMeasurementRow.job_id == Job.id)
    .where(Job.state.in_(ACTIVE_STATES))
    .order_by(Job.submit_time, Job.id)
)
_DATASET_SIZE = 10
_CLIENT_AT = 24
_TOTAL, _CONSUMED = 5, 6

#: An active job whose progress reached this share of its declared work is at or past the
#: backends' cap below "done" (only the job's controller says done: the Kubernetes backend holds
#: its estimate at 0.99 of the total): how much it has left is unknown from here on.
AT_DECLARED_WORK = 0.99


def _past_declared_work(row: tuple) -> bool:
    total = row[_TOTAL]
    return total > 0 and row[_CONSUMED] >= AT_DECLARED_WORK * total


def remaining_work(total: float, consumed: float, fstar: float, start_time: float | None, now: float) -> float:
    """Bytes an active job has left, as SJF ranks it. A job at its declared work that has not
    ended (issue 47: on Kubernetes such a job had 0 left and stayed first in SJF however long it
    overran) has an unknown remainder, not the shortest: it is taken to need as much again as it
    has run past its declaration, f* x (time since it first started) - declared work (Tiresias'
    least-attained-service reading of an unknown size). An honest job finishing on time keeps
    about 0 left; one that overruns falls back in the queue as it overruns (and stays back while
    preempted), so understating work only loses."""
    left = max(total - consumed, 0.0)
    if total <= 0 or consumed < AT_DECLARED_WORK * total or start_time is None:
        return left
    return max(left, fstar * max(now - start_time, 0.0) - total)


@dataclass(frozen=True, slots=True)
class _Built:
    row: tuple  # every column the view was built from
    fresh: bool  # whether the client report was fresh then
    job: TenantJob


def _build(row: tuple, now: float) -> TenantJob:
    jid, gpus, ds_id, ds_name, ideal, total, consumed, submit, state, prio, _size, owner, *rest = row
    # Measured, self-correcting parameters (measured_params.py): the estimate once there is
    # evidence, else what the job declared.
    ideal, cpu_rate = planned(ideal, rest[5], rest[8], rest[9], *rest[10:13], now, rest[14])
    if cpu_rate is not None and rest[7] is not None:
        cpu_rate = min(cpu_rate, rest[7])  # the autocache point's rate bounds the whole pipeline's
    view = JobView(
        job_id=str(jid), gpus=gpus, dataset=storage_key(ds_id, ds_name), ideal_throughput=ideal,
        remaining_bytes=remaining_work(total, consumed, ideal, rest[13], now),
        submit_time=submit,
        running=state == JobState.RUNNING, priority=prio, access=access_from_row(*rest[:5]),
        pipeline=pipeline_from_row(cpu_rate, *rest[6:8]),
        # The loader's miss term (policies/loader.py), from the same columns as the diagnosis's.
        loader_miss_rate=loader_miss_rate(*rest[15:19]),
    )
    return TenantJob(view, owner)


class RoundJobs:
    """Reads the active jobs for a round, reusing the previous round's view of an unchanged row.

    Holds the views of the last read's rows only (a job that left the active states is dropped).
    Two reads at once (a round and a direct `build_snapshot`) at worst lose each other's entries:
    an entry is only ever reused for a row equal to the one it was built from."""

    def __init__(self) -> None:
        self._built: dict[int, _Built] = {}

    def read(self, conn: Connection, now: float) -> tuple[list[TenantJob], dict[str, float]]:
        """(the active jobs in arrival order with their owners, storage key -> dataset size)."""
        last = self._built
        built: dict[int, _Built] = {}
        jobs: list[TenantJob] = []
        sizes: dict[str, float] = {}
        for r in conn.execute(_QUERY):
            row = tuple(r)
            fresh = client_report_fresh(row[_CLIENT_AT], now)
            entry = last.get(row[0])
            # Tuple equality: a NaN column never equals itself, so such a row is simply rebuilt. A
            # job past its declared work is ranked by how long it has run: rebuilt every round.
            if entry is None or entry.fresh != fresh or entry.row != row or _past_declared_work(row):
                entry = _Built(row, fresh, _build(row, now))
            built[row[0]] = entry
            jobs.append(entry.job)
            sizes[entry.job.view.dataset] = row[_DATASET_SIZE]
        self._built = built
        return jobs, sizes


__all__ = ["AT_DECLARED_WORK", "RoundJobs", "remaining_work"]
