"""Measured, self-correcting job parameters in the service (issue 22, Build 3).

A user declares f* (and, for a job with a CPU stage, its per-core rate); those are starting
points. Every few seconds the scheduling process takes what the data plane measured for each
running job (its read rate and hit ratio: from the data manager, the local backend's mounts, or
the node agents' per-pod counters) and what the job holds (remote IO cap, cores, cache), and
updates the estimates with `estimator.measured.observe_job` (which interval was bound by what,
Plumber-style). Planning uses the estimates from then on (`SchedulerService._round_input`).

Trust (the same rules as the consumption reports, scheduler/service/consumption.py):
- the read rate comes only from silod's own data plane (mounts, node agents), never from the job;
- the optional client report (POST /v1/jobs/{id}/report: step time and batch bytes) is accepted
  from the job's owner, the admin, or a node agent bound to a node one of the job's pods runs
  on; values are bounded; only the latest report is kept (one row per job);
- once the data plane has measured a job, the measurement replaces its declared f* downward
  without a floor (a declaration is a claim: a tenant can only lose by overstating it), and
  upward at most to declared x 4;
- what a client claims can only lower the f* planning uses (not below the rate the data plane
  measured it reading at in its last interval), and is believed for telling a CPU
  bottleneck from a GPU one only up to the highest rate the data plane measured (see
  observe_job): a client that says its job is faster than measured gains nothing.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from estimator.model import loader_miss_rate as model_loader_miss_rate
from estimator.measured import NOT_BOUND_SLACK, SERVICE_FSTAR_FLOOR, FStarEstimate, JobMeasurement, observe_job, used_fstar
from scheduler.service.db.models import Job, JobMeasurementRow

#: Intervals in a job's first seconds of reading are not evidence: its mount and pipeline warm up.
#: Counted from its first read, not from its start (a framework's import and its loader's worker
#: processes take seconds before anything is read).
WARMUP_S = 5.0
#: An interval longer than this (the service paused, a job restarted) is not evidence of a rate.
MAX_INTERVAL_S = 30.0
#: Client step times and batch sizes accepted (a step of a microsecond or a day is a broken report).
MIN_STEP_S, MAX_STEP_S = 1e-4, 86_400.0
MAX_BATCH_BYTES = 2.0**50
#: A client report older than this no longer speaks for the job (it may have changed phase).
CLIENT_REPORT_TTL_S = 600.0


@dataclass(frozen=True, slots=True)
class MeasuredParams:
    """Declared vs measured, as GET /v1/jobs/{id} and `silod jobs` show them."""

    declared_ideal_throughput: float
    ideal_throughput: float  # what planning uses now (bytes/s)
    ideal_evidence_s: float
    declared_cpu_rate: float | None
    cpu_rate: float | None  # what planning uses now (bytes/s per core); None: no CPU stage
    cpu_evidence_s: float
    observed_throughput: float | None  # the data plane's last read rate
    max_observed_throughput: float
    bound: str  # what held the job in the last measured interval: gpu | cpu | remote_io | unknown | ""
    client_ideal_throughput: float | None  # batch bytes / step seconds of the latest fresh report
    client_at: float | None
    updated_at: float | None
    miss_service_s: float | None = None  # the mount's mean per-miss service time (the loader term's L)
    miss_item_bytes: float | None = None  # the mean size of those missed items (its s, when not declared)


def client_fstar(row: JobMeasurementRow | None, now: float) -> float | None:
    if row is None or row.client_step_s is None or row.client_batch_bytes is None or row.client_at is None:
        return None
    if now - row.client_at > CLIENT_REPORT_TTL_S:
        return None
    return row.client_batch_bytes / row.client_step_s


def state_from_row(row: JobMeasurementRow | None, declared_fstar: float, declared_cpu: float | None) -> JobMeasurement:
    m = JobMeasurement.start(declared_fstar, declared_cpu)
    if row is None:
        return m
    fs = FStarEstimate(declared_fstar, row.ideal_throughput or declared_fstar, row.ideal_evidence_s or 0.0,
                       floor_factor=SERVICE_FSTAR_FLOOR)
    fs = replace(fs, estimate=fs.clip(fs.estimate))
    cpu = m.cpu
    if cpu is not None and row.cpu_rate is not None:
        cpu = FStarEstimate(cpu.declared, cpu.clip(row.cpu_rate), row.cpu_evidence_s or 0.0)
    return JobMeasurement(fs, cpu, row.max_observed or 0.0, row.bound or "", row.best_per_core or 0.0)


def params_of(row: JobMeasurementRow | None, declared_fstar: float, declared_cpu: float | None,
              now: float | None = None) -> MeasuredParams | None:
    """The record shown to users (None: nothing measured or reported yet)."""
    if row is None:
        return None
    now = time.time() if now is None else now
    m = state_from_row(row, declared_fstar, declared_cpu)
    client = client_fstar(row, now)
    return MeasuredParams(
        declared_fstar, m.used_fstar(client, row.observed), m.fstar.evidence_s, declared_cpu,
        None if m.cpu is None else m.cpu.estimate, 0.0 if m.cpu is None else m.cpu.evidence_s,
        row.observed, m.max_observed, m.bound, client, row.client_at, row.updated_at, row.miss_service_s,
        row.miss_item_bytes)


def client_report_fresh(client_at: float | None, now: float) -> bool:
    """Whether a client report made at `client_at` still speaks for its job at `now`."""
    return client_at is not None and now - client_at <= CLIENT_REPORT_TTL_S


def planned(declared_fstar: float, declared_cpu: float | None, measured_fstar: float | None,
            measured_cpu: float | None, step_s: float | None, batch_bytes: float | None, client_at: float | None,
            now: float, observed: float | None = None) -> tuple[float, float | None]:
    """(f*, per-core rate) planning uses, from a job's row columns (the round's hot path: no ORM).
    Depends on `now` only through `client_report_fresh(client_at, now)` (round_jobs.py relies on it).
    `observed`: the data plane's last interval rate (JobMeasurement.used_fstar)."""
    if measured_fstar is None and step_s is None:
        return declared_fstar, declared_cpu
    fs = FStarEstimate(declared_fstar, declared_fstar, floor_factor=SERVICE_FSTAR_FLOOR)
    est = fs.clip(measured_fstar) if measured_fstar is not None else declared_fstar
    if step_s and batch_bytes and client_report_fresh(client_at, now):
        est = used_fstar(replace(fs, estimate=est), batch_bytes / step_s, observed)
    cpu = declared_cpu
    if declared_cpu is not None and measured_cpu is not None:
        cpu = FStarEstimate(declared_cpu, declared_cpu).clip(measured_cpu)
    return est, cpu


def loader_miss_rate(workers: int | None, item_bytes: float | None, miss_service_s: float | None,
                     miss_item_bytes: float | None) -> float:
    """m = W s / L of a job's row (estimator.loader_miss_rate): W and s as the job declared its
    loader (s: else the mean size of the missed items its mount measured), L its mount's measured
    per-miss service time. inf (the paper's model) when the job declared no loader or its mount
    has measured no miss yet."""
    s = item_bytes if item_bytes is not None else miss_item_bytes
    if not workers or miss_service_s is None or not s or s <= 0:
        return math.inf
    return float(model_loader_miss_rate(workers, s, max(float(miss_service_s), 0.0)))


@dataclass(frozen=True, slots=True)
class Observation:
    """One running job's figures for an interval (all from silod's side)."""

    job_id: int
    observed: float  # read rate, bytes/s (data plane)
    hit_ratio: float | None  # measured; None: use the cache allocation's c/d
    remote_io: float | None  # the job's cap; None: unmanaged (the whole link)
    cores: float | None  # held; None: CPU not modelled
    cache: float | None  # its dataset's cache allocation
    dataset_size: float
    # The data plane's cumulative counters of this run of the job (bytes read, bytes of them that
    # missed the cache) and when they were taken (None: now). With them an interval's rate and hit
    # ratio are those of the interval itself, not a smoothed rate and a whole-run hit ratio.
    read_bytes: float | None = None
    miss_bytes: float | None = None
    at: float | None = None
    # The mount's cumulative per-miss service counters (fuse_client/accounting.py): missed items
    # delivered whole, the seconds they held their readers, their bytes. None: not measured.
    miss_service_count: float | None = None
    miss_service_s: float | None = None
    miss_service_bytes: float | None = None


#: The per-miss service time stored for a job is a running mean over about this many recent
#: misses (an interval's own mean of a few misses is noisy; a whole-run mean never follows a
#: change of load).
MISS_SERVICE_WINDOW = 2000.0
#: A per-miss service time above this is no figure of a working mount (a stalled remote, a
#: stopped process): not folded in.
MAX_MISS_SERVICE_S = 60.0


def fold_miss_service(old_s: float | None, old_bytes: float | None, old_n: float | None, d_count: float,
                      d_seconds: float, d_bytes: float) -> tuple[float, float, float] | None:
    """(mean service seconds, mean item bytes, weight) after an interval in which `d_count` misses
    were delivered whole in `d_seconds` of service with `d_bytes` bytes; None when the interval
    says nothing (no miss delivered, or figures no working mount gives)."""
    if not (d_count >= 1 and d_seconds >= 0 and d_bytes >= 0) or not all(map(math.isfinite, (d_count, d_seconds, d_bytes))):
        return None
    mean_s, mean_b = d_seconds / d_count, d_bytes / d_count
    if mean_s > MAX_MISS_SERVICE_S:
        return None
    if old_s is None or old_bytes is None or not old_n:
        return mean_s, mean_b, min(d_count, MISS_SERVICE_WINDOW)
    n = max(0.0, min(old_n, MISS_SERVICE_WINDOW - d_count))  # the older misses' weight, within the window
    w = n + d_count
    return (old_s * n + d_seconds) / w, (old_bytes * n + d_bytes) / w, min(w, MISS_SERVICE_WINDOW)


def io_bound(o: Observation, link: float) -> float:
    b = link if o.remote_io is None else o.remote_io
    h = o.hit_ratio
    if h is None:
        h = min((o.cache or 0.0) / o.dataset_size, 1.0) if o.dataset_size > 0 else 0.0
    h = min(max(h, 0.0), 1.0)
    return math.inf if h >= 1.0 else b / (1.0 - h)


class MeasurementStore:
    """Reads and writes `job_measurements`; keeps the time each job was last observed."""

    def __init__(self, sessions: sessionmaker, write_lock: threading.RLock | None = None) -> None:
        self.sessions = sessions
        self.lock = write_lock or threading.RLock()
        self._last: dict[int, float] = {}  # job -> when it was last observed (scheduling process)
        self._first_read: dict[int, float] = {}  # job -> when this run of it was first seen reading
        self._counts: dict[int, tuple[float, float, float]] = {}  # job -> (read, miss, at) last seen
        self._service: dict[int, tuple[float, float, float]] = {}  # job -> per-miss service counters last seen

    def rows(self, job_ids: Iterable[int]) -> dict[int, JobMeasurementRow]:
        ids = [int(j) for j in job_ids]
        if not ids:
            return {}
        out: dict[int, JobMeasurementRow] = {}
        with self.sessions() as s:
            for i in range(0, len(ids), 500):
                for row in s.scalars(select(JobMeasurementRow).where(JobMeasurementRow.job_id.in_(ids[i:i + 500]))):
                    s.expunge(row)
                    out[row.job_id] = row
        return out

    # --- the scheduling process ---------------------------------------------------------------

    def observe(self, observations: Iterable[Observation], link: float, now: float) -> dict[int, JobMeasurement]:
        """Fold one interval per job in and persist the changed estimates. A job seen for the
        first time (or after a gap) only starts its interval: rates need two points in time."""
        obs = {o.job_id: o for o in observations}
        for jid in [j for j in self._last if j not in obs]:
            del self._last[jid]  # not running now: its next interval starts afresh
            self._first_read.pop(jid, None)
            self._counts.pop(jid, None)
            self._service.pop(jid, None)
        if not obs:
            return {}
        with self.sessions() as s:
            declared = {jid: (f, r) for jid, f, r, *_ in s.execute(
                select(Job.id, Job.ideal_throughput, Job.cpu_rate).where(Job.id.in_(list(obs))))}
            loaders = {jid: (w, b) for jid, w, b in s.execute(
                select(Job.id, Job.loader_workers, Job.loader_item_bytes)
                .where(Job.id.in_(list(obs)), Job.loader_workers.is_not(None)))}
        rows = self.rows(obs)
        out: dict[int, JobMeasurement] = {}
        writes: list[dict] = []
        for jid, o in obs.items():
            if jid not in declared:
                continue
            interval = self._interval(jid, o, now)
            row = rows.get(jid)
            # An interval the link held (its rate at the IO bound b / (1 - h), as f*'s samples
            # judge it) timed its misses' waits for the token bucket, not the loader: L there is
            # L(b) = W s (1/b - 1/((1-h) f*)) (estimator.loader_miss_time), the allocation's,
            # and a plan for another b with it would keep the job at this b. Not folded: the L
            # kept is the free one, and planning puts the link's bound beside it (min).
            held = interval is not None and interval[0] >= NOT_BOUND_SLACK * io_bound(replace(o, hit_ratio=interval[1]), link)
            service = self._miss_service(jid, o, row, held_by_link=held)
            if interval is None:
                if service is not None and row is not None:  # no rate to learn; the misses' service time is a figure
                    writes.append(dict(job_id=jid, existed=row is not None, only_service=True, **service))
                continue
            observed, hit, seconds = interval
            f, r = declared[jid]
            before = state_from_row(row, f, r)
            after = observe_job(before, observed, seconds, io_bound(replace(o, hit_ratio=hit), link),
                                math.inf if o.cores is None else o.cores, client_fstar(row, now),
                                self._loader_cost(o, hit, loaders.get(jid), row, service))
            out[jid] = after
            writes.append(dict(
                job_id=jid, ideal_throughput=after.fstar.estimate, ideal_evidence_s=after.fstar.evidence_s,
                cpu_rate=None if after.cpu is None else after.cpu.estimate,
                cpu_evidence_s=0.0 if after.cpu is None else after.cpu.evidence_s,
                max_observed=after.max_observed, best_per_core=after.best_per_core, observed=observed,
                bound=after.bound, updated_at=now, existed=row is not None, **(service or {})))
        self._write(writes)
        return out

    @staticmethod
    def _loader_cost(o: Observation, hit: float | None, loader: tuple[int, float | None] | None,
                     row: JobMeasurementRow | None, service: dict | None) -> float:
        """(1 - h)/m, the seconds per byte a job that declared its loader spent on this interval's
        misses (0: no loader declared, or no miss service time measured yet)."""
        if loader is None:
            return 0.0
        sv = service or {}
        m = loader_miss_rate(loader[0], loader[1], sv.get("miss_service_s", row.miss_service_s if row else None),
                             sv.get("miss_item_bytes", row.miss_item_bytes if row else None))
        if not math.isfinite(m):
            return 0.0
        if hit is None:
            hit = min((o.cache or 0.0) / o.dataset_size, 1.0) if o.dataset_size > 0 else 0.0
        return (1.0 - min(max(hit, 0.0), 1.0)) / m

    def _miss_service(self, jid: int, o: Observation, row: JobMeasurementRow | None, held_by_link: bool = False) -> dict | None:
        """The job's per-miss service columns folded with this observation's misses (their
        counters' change since the last look), or None when nothing new was delivered or the
        link held the interval (`held_by_link`: its counters are taken as the next start)."""
        if o.miss_service_count is None or o.miss_service_s is None or o.miss_service_bytes is None:
            return None
        now_counts = (float(o.miss_service_count), float(o.miss_service_s), float(o.miss_service_bytes))
        prev = self._service.get(jid)
        self._service[jid] = now_counts
        if prev is None:
            return None
        d = [a - b for a, b in zip(now_counts, prev)]
        if d[0] < 0 or d[1] < 0 or d[2] < 0:
            return None  # counters restarted (a new mount): the next look starts afresh
        if held_by_link:
            return None
        folded = fold_miss_service(row.miss_service_s if row is not None else None,
                                   row.miss_item_bytes if row is not None else None,
                                   row.miss_service_n if row is not None else None, *d)
        if folded is None:
            return None
        return dict(miss_service_s=folded[0], miss_item_bytes=folded[1], miss_service_n=folded[2])

    def _interval(self, jid: int, o: Observation, now: float) -> tuple[float, float | None, float] | None:
        """(read rate, hit ratio, seconds) of the job's interval ending now, or None when it is no
        evidence: the first sight of it (or after a gap), its warm-up, a stall, restarted counters.

        With the data plane's counters the rate and the hit ratio are the interval's own: a
        whole-run hit ratio lags (a job whose cache filled in its first epoch still shows its cold
        misses epochs later), and an interval with misses judged against the cache it will have
        looks GPU-bound while the link held it (issue 48: such an interval lowered f*)."""
        last = self._last.get(jid)
        self._last[jid] = now
        counted = o.read_bytes is not None and o.miss_bytes is not None
        if counted:
            at = now if o.at is None else min(float(o.at), now)
            read, miss = float(o.read_bytes), float(o.miss_bytes)
            prev = self._counts.get(jid)
            if prev is not None and at <= prev[2] and read >= prev[0]:
                return None  # no new figures since the last look: the next interval spans both
            self._counts[jid] = (read, miss, at)
            if read > 0:
                self._first_read.setdefault(jid, at)
            if prev is None or last is None or not 0 < now - last <= MAX_INTERVAL_S:
                return None
            d_read, d_miss, start = read - prev[0], miss - prev[1], prev[2]
            if d_read < 0 or d_miss < 0:
                self._first_read.pop(jid, None)  # counters restarted (a new mount): warm up again
                if read > 0:
                    self._first_read[jid] = at
                return None
            if not 0 < at - start <= MAX_INTERVAL_S:
                return None
            if start < self._first_read.get(jid, math.inf) + WARMUP_S or d_read <= 0:
                return None  # warming up, or read nothing (stalled, not started): no rate to learn
            return d_read / (at - start), 1.0 - min(d_miss, d_read) / d_read, at - start
        if o.observed > 0:
            self._first_read.setdefault(jid, now)
        if last is None or not 0 < now - last <= MAX_INTERVAL_S:
            return None
        if last < self._first_read.get(jid, math.inf) + WARMUP_S or o.observed <= 0:
            return None
        return o.observed, o.hit_ratio, now - last

    def _write(self, writes: list[dict]) -> None:
        if not writes:
            return
        cols = ("ideal_throughput", "ideal_evidence_s", "cpu_rate", "cpu_evidence_s", "max_observed",
                "best_per_core", "observed", "bound", "updated_at", "miss_service_s", "miss_item_bytes",
                "miss_service_n")

        def values(w: dict) -> dict:
            return {c: w[c] for c in cols if c in w}

        with self.lock:
            with self.sessions.begin() as s:
                for w in writes:
                    if w["existed"]:
                        s.execute(update(JobMeasurementRow).where(JobMeasurementRow.job_id == w["job_id"])
                                  .values(**values(w)))
            for w in writes:
                if not w["existed"]:
                    self._insert_or_update(w["job_id"], values(w))

    def _insert_or_update(self, job_id: int, values: Mapping) -> None:
        """Insert the row, or (another process inserted it meanwhile) update only `values`."""
        for _ in range(2):
            with self.sessions.begin() as s:
                if s.execute(update(JobMeasurementRow).where(JobMeasurementRow.job_id == job_id)
                             .values(**values)).rowcount:
                    return
            try:
                with self.sessions.begin() as s:
                    defaults = dict(ideal_evidence_s=0.0, cpu_evidence_s=0.0, max_observed=0.0, best_per_core=0.0,
                                    bound="")
                    s.add(JobMeasurementRow(job_id=job_id, **{**defaults, **values}))
                return
            except IntegrityError:
                continue

    # --- the API workers ------------------------------------------------------------------------

    def record_client_report(self, job_id: int, step_s: float, batch_bytes: float, reporter: str, now: float) -> None:
        with self.lock:
            self._insert_or_update(job_id, dict(client_step_s=float(step_s), client_batch_bytes=float(batch_bytes),
                                                client_reporter=reporter[:128], client_at=now))


__all__ = ["CLIENT_REPORT_TTL_S", "MAX_BATCH_BYTES", "MISS_SERVICE_WINDOW", "fold_miss_service", "MAX_STEP_S", "MIN_STEP_S", "MeasuredParams",
           "MeasurementStore", "Observation", "client_fstar", "client_report_fresh", "io_bound", "params_of", "planned", "state_from_row"]
