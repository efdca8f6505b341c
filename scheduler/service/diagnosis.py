"""What bounds a running job now: the one diagnosis every view reads.

`GET /v1/jobs` and `GET /v1/jobs/{id}` (`bottleneck`), /metrics (`silod_job_bound`,
`silod_job_predicted_throughput_bytes_per_second`, `silod_running_jobs_bound`), the overview
behind /ui and `silod top` all call `diagnose_jobs` on inputs made by `diagnosis_input` from the
same columns (COLUMNS): they cannot disagree about a job unless its rows change between two reads.

The inputs are the parameters planning uses (measured_params.planned: the measured f* and
per-core rate once there is evidence, else the declared ones), what the job holds (its remote-IO
cap, cores and its dataset's cache allocation, preprocessed or source bytes), its dataset's
size, and for a job that declared its loader (jobs.loader_workers) the loader's miss term from
its mount's measured per-miss service time (measured_params.loader_miss_rate). Unmanaged storage
(no IO cap): the whole link and no cache, the most and least it could see; CPU not modelled (no
cores recorded): unconstrained cores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session, sessionmaker

from scheduler.service.db.models import CacheAllocationRow, Dataset, Job, JobAllocationRow, JobMeasurementRow, JobState
from scheduler.service.measured_params import loader_miss_rate, planned
from scheduler.service.types import Bottleneck


@dataclass(frozen=True, slots=True)
class DiagnosisInput:
    """One running job, as planning sees it."""

    fstar: float  # planned f*, bytes/s
    cpu_rate: float | None  # planned source bytes/s per core; None: no CPU stage
    gpus: int
    remote_io: float | None  # the job's cap; None: unmanaged (the whole link)
    cores: float | None  # held; None: CPU not modelled
    cache: float | None  # its dataset's cache allocation, bytes
    dataset_size: float
    expansion: float | None  # autocaching: bytes cached per source byte; None: source bytes cached
    post_cpu_rate: float | None  # per-core rate of a cached (preprocessed) item
    # The loader's miss term m = W s / L (estimator.loader_miss_rate), bytes/s: a job that declared
    # its loader, once its mount measured a miss's service time L; inf: the paper's model.
    loader_miss_rate: float = math.inf


_M = JobMeasurementRow
#: The columns diagnosis_input reads, in its argument order after the job id. A query that wants
#: to diagnose its running jobs selects these (catalogue.py's record query holds them all).
COLUMNS = (Job.id, Job.ideal_throughput, Job.cpu_rate, Job.gpus, JobAllocationRow.remote_io, JobAllocationRow.cpu,
           CacheAllocationRow.bytes, Dataset.size, CacheAllocationRow.expansion, Job.post_cpu_rate,
           _M.ideal_throughput, _M.cpu_rate, _M.client_step_s, _M.client_batch_bytes, _M.client_at, _M.observed,
           Job.loader_workers, Job.loader_item_bytes, _M.miss_service_s, _M.miss_item_bytes)


def diagnosis_input(declared_fstar: float, declared_cpu: float | None, gpus: int, remote_io: float | None,
                    cores: float | None, cache: float | None, dataset_size: float, cache_expansion: float | None,
                    post_cpu_rate: float | None, measured_fstar: float | None, measured_cpu: float | None,
                    step_s: float | None, batch_bytes: float | None, client_at: float | None, observed: float | None,
                    loader_workers: int | None, loader_item_bytes: float | None, miss_service_s: float | None,
                    miss_item_bytes: float | None, now: float) -> DiagnosisInput:
    f, cpu = planned(declared_fstar, declared_cpu, measured_fstar, measured_cpu, step_s, batch_bytes, client_at, now,
                     observed)
    # Autocaching counts only when the cache holds preprocessed data for a job with both rates.
    pre = cache_expansion is not None and post_cpu_rate is not None and cpu is not None
    return DiagnosisInput(float(f), cpu, int(gpus), remote_io, cores, cache, float(dataset_size),
                          cache_expansion if pre else None, post_cpu_rate if pre else None,
                          loader_miss_rate(loader_workers, loader_item_bytes, miss_service_s, miss_item_bytes))


def diagnose_jobs(inputs: Sequence[DiagnosisInput], link: float) -> list[Bottleneck]:
    """The diagnosis of each job (estimator.pipeline.diagnose, one vectorised call). `link`: the
    cluster's remote IO, what an unmanaged job is diagnosed with."""
    from estimator.pipeline import diagnose

    if not inputs:
        return []
    inf = math.inf
    rates = [inf if i.cpu_rate is None else i.cpu_rate for i in inputs]
    d = diagnose([i.fstar for i in inputs], [i.gpus for i in inputs],
                 [link if i.remote_io is None else i.remote_io for i in inputs],
                 [i.cache or 0.0 for i in inputs], [i.dataset_size for i in inputs],
                 [inf if i.cores is None else i.cores for i in inputs], rates,
                 [1.0 if i.expansion is None else i.expansion for i in inputs],
                 [r if i.post_cpu_rate is None else i.post_cpu_rate for i, r in zip(inputs, rates)],
                 [i.loader_miss_rate for i in inputs])
    return [Bottleneck(str(d.bound[k]), float(d.throughput[k]), float(d.speedup_gpu[k]), float(d.speedup_cpu[k]),
                       float(d.speedup_cache[k]), float(d.speedup_remote_io[k])) for k in range(len(inputs))]


def running_jobs(s: Session, now: float, link: float, job_ids: Iterable[int] | None = None) -> dict[int, tuple[DiagnosisInput, Bottleneck]]:
    """Every running job's (or those of `job_ids`') inputs and diagnosis, from one query."""
    q = (select(*COLUMNS).join(Dataset, Job.dataset_id == Dataset.id)
         .outerjoin(JobAllocationRow, JobAllocationRow.job_id == Job.id)
         .outerjoin(CacheAllocationRow, CacheAllocationRow.dataset_id == Dataset.id)
         .outerjoin(_M, _M.job_id == Job.id)
         .where(Job.state == JobState.RUNNING))
    if job_ids is not None:
        ids = list(job_ids)
        if not ids:
            return {}
        q = q.where(Job.id.in_(ids))
    rows = s.execute(q).all()
    inputs = [diagnosis_input(*r[1:], now) for r in rows]
    return {int(r[0]): (i, b) for r, i, b in zip(rows, inputs, diagnose_jobs(inputs, link))}


#: A running job's stored diagnosis is rewritten when its bound changes or its predicted
#: throughput moves by more than this fraction: a steady round writes nothing for it.
RECORD_TOLERANCE = 0.01


def record_bounds(sessions: sessionmaker, write_lock: Any, now: float, link: float) -> int:
    """Store each running job's diagnosis (its bound and predicted throughput) on its row, so an
    ended job keeps the model's diagnosis of the last round it ran in (GET /v1/jobs?state=ended).
    Called after a round commits: the read holds no write transaction (on SQLite one blocks every
    submission), and only the jobs whose diagnosis changed are written, in one short one.
    Returns how many rows it wrote."""
    q = (select(*COLUMNS, Job.last_bound, Job.last_predicted_throughput).join(Dataset, Job.dataset_id == Dataset.id)
         .outerjoin(JobAllocationRow, JobAllocationRow.job_id == Job.id)
         .outerjoin(CacheAllocationRow, CacheAllocationRow.dataset_id == Dataset.id)
         .outerjoin(_M, _M.job_id == Job.id)
         .where(Job.state == JobState.RUNNING))
    with sessions() as s:
        rows = s.execute(q).all()
    n = len(COLUMNS)
    found = diagnose_jobs([diagnosis_input(*r[1:n], now) for r in rows], link)
    changed = []
    for r, b in zip(rows, found):
        old_bound, old_tput = r[n], r[n + 1]
        if (old_bound != b.bound or old_tput is None
                or abs(b.throughput - old_tput) > RECORD_TOLERANCE * max(abs(old_tput), 1.0)):
            changed.append({"b_id": int(r[0]), "last_bound": b.bound, "last_predicted_throughput": b.throughput,
                            "last_bound_at": now})
    if changed:  # Core executemany: one statement for all of them
        with write_lock, sessions.begin() as s:
            s.connection().execute(
                update(Job.__table__).where(Job.__table__.c.id == bindparam("b_id")).values(
                    last_bound=bindparam("last_bound"), last_predicted_throughput=bindparam("last_predicted_throughput"),
                    last_bound_at=bindparam("last_bound_at")),
                changed)
    return len(changed)


def positions(columns: Sequence[Any]) -> list[int]:
    """Where each input column of COLUMNS (after the id) is in another query's `columns`, which
    must select them all (compared by identity: SQLAlchemy's == builds an expression)."""
    return [next(k for k, c in enumerate(columns) if c is want) for want in COLUMNS[1:]]


def record_input(row: Any, where: Sequence[int], now: float) -> DiagnosisInput:
    """diagnosis_input from a row of another query; `where`: positions(that query's columns)."""
    return diagnosis_input(*(row[k] for k in where), now)


__all__ = ["COLUMNS", "DiagnosisInput", "diagnose_jobs", "diagnosis_input", "positions", "record_bounds", "record_input", "running_jobs"]
