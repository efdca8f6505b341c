"""The catalogue: datasets, their grants and credentials, jobs, quotas and idempotency keys, per
tenant. Every object-level check lives here, so the API layer cannot forget one:

- a tenant sees, reads and cancels only its own jobs; another tenant's job is reported missing
  (404: its existence is not theirs to know); the admin sees all;
- dataset names are unique per tenant; another tenant's dataset is reachable only through an
  explicit grant by its owner (404 otherwise, the same answer as for a name nobody uses);
- a dataset's URI must pass the operator's allow-list (contract.uri_policy) and its
  credential must belong to the dataset's owner;
- a submission is checked against the tenant's quota (403 when the job alone exceeds it, 429
  when the tenant has too many jobs waiting) and may carry an Idempotency-Key.

The scheduling loop does not use this module; it reads the same tables for its snapshot.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any

from sqlalchemy import Connection, bindparam, cast, exists, func, or_, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from estimator.errors import UserError
from contract.credentials import SourceCredential
from contract.names import storage_key
from scheduler.service.api.auth import revoke_job_tokens
from scheduler.service.db.models import (
    ACTIVE_STATES,
    Credential,
    Dataset,
    DatasetGrant,
    IdempotencyKey,
    CacheAllocationRow,
    Job,
    JobAllocationRow,
    JobMeasurementRow,
    JobState,
    Quota,
    TenantJobCount,
    WorkloadPod,
)
from scheduler.service.diagnosis import diagnose_jobs, positions, record_input
from scheduler.service.measured_params import params_of
from scheduler.service.types import (
    DEFAULT_IDEAL_PER_GPU,
    MAX_BYTES,
    ConflictError,
    DatasetRecord,
    ForbiddenError,
    JobRecord,
    NewDataset,
    NewJob,
    NotFoundError,
    Principal,
    ServiceConfig,
    ServiceError,
    TenantQuota,
    UpstreamUnavailable,
    access_columns,
    access_from_row,
    check_name,
    loader_from_row,
    pipeline_columns,
)
from traces.catalog import lookup_model


class QuotaExceeded(ServiceError):
    status = 429


class BadUri(ServiceError):
    """A dataset URI (or credential endpoint) the operator's allow-list refuses."""

    status = 400


_TAKE_WRITE_LOCK = text("UPDATE settings SET key = key WHERE 0")


def _write_first(s: Session | Connection) -> None:
    """On SQLite, open the transaction with a write, which takes the database's write lock now
    (waiting for it under busy_timeout): reads that follow see every committed write, and the
    transaction cannot fail later at its first write because another process committed since
    its reads (WAL: SQLITE_BUSY_SNAPSHOT). A no-op elsewhere."""
    dialect = s.dialect if isinstance(s, Connection) else s.get_bind().dialect
    if dialect.name == "sqlite":
        s.execute(_TAKE_WRITE_LOCK)


def _lock_tenant_objects(s: Session, tenant: str) -> None:
    """Before counting a tenant's objects to add one: no other worker adds one of them until this
    transaction ends (SQLite: the database's write lock; PostgreSQL: a per-tenant advisory lock)."""
    _write_first(s)
    if s.get_bind().dialect.name == "postgresql":
        s.execute(_TENANT_LOCK_PG, {"k": f"silod-objects:{tenant}"})


def _check_room(s: Session, count_query: Any, limit: int, what: str, field: str) -> None:
    held = s.scalar(count_query) or 0
    if held >= limit:
        raise ForbiddenError(f"{what}: {held} of at most {limit} (the service's object limit); delete one first",
                             field=field)


@dataclass(frozen=True, slots=True)
class NewCredential:
    name: str
    access_key_id: str
    secret_access_key: str
    endpoint_url: str | None = None
    region: str | None = None
    kind: str = "s3"


@dataclass(frozen=True, slots=True)
class CredentialRecord:
    """What the API shows of a credential: never the secret."""

    name: str
    owner: str
    kind: str
    access_key_id: str
    endpoint_url: str | None
    region: str | None
    created_at: float


# Built once: a statement built per call with .values() costs more to cache-key than to run.
# The submission path (POST /v1/jobs) runs these on a plain connection, not an ORM session:
# building the statements and the session's bookkeeping cost more than the queries themselves.
_JOBS = Job.__table__
_INSERT_IDEMPOTENCY_KEY = IdempotencyKey.__table__.insert()
_IDEMPOTENCY_KEY = select(IdempotencyKey.__table__.c.request_hash, IdempotencyKey.__table__.c.job_id).where(
    IdempotencyKey.__table__.c.owner == bindparam("owner"), IdempotencyKey.__table__.c.key == bindparam("key"))
_DS = Dataset.__table__.c
_GRANT = select(DatasetGrant.__table__.c.grantee).where(
    DatasetGrant.__table__.c.dataset_id == bindparam("dataset_id"), DatasetGrant.__table__.c.grantee == bindparam("grantee"))
_QUOTA = select(*(getattr(Quota.__table__.c, k) for k in TenantQuota.FIELDS)).where(
    Quota.__table__.c.tenant == bindparam("tenant"))
# The submission's dataset and its tenant's quota in one statement (LEFT JOIN: no quota row is
# the default quota), instead of one statement each.
_DATASET_AND_QUOTA = (
    select(_DS.id, _DS.name, _DS.owner, _DS.size, Quota.__table__.c.tenant.label("quota_tenant"),
           *(getattr(Quota.__table__.c, k) for k in TenantQuota.FIELDS))
    .select_from(Dataset.__table__.outerjoin(Quota.__table__, Quota.__table__.c.tenant == bindparam("tenant")))
    .where(_DS.owner == bindparam("owner"), _DS.name == bindparam("name")))
# A tenant's jobs per state, kept by triggers on `jobs` (TenantJobCount, migration 0008): counting
# a tenant's 10,000 jobs over an index cost ~4 ms of a submission's ~2 (SQLite).
_COUNTS_OF_OWNER = select(TenantJobCount.__table__.c.state, TenantJobCount.__table__.c.n).where(
    TenantJobCount.__table__.c.owner == bindparam("owner"))
_TENANT_LOCK_PG = text("SELECT pg_advisory_xact_lock(hashtext(:k))")
_COUNTS = TenantJobCount.__table__.c


@functools.cache
def _insert_job_checked(columns: tuple[str, ...], queued_limit: bool, through_grant: bool) -> Any:
    """`INSERT INTO jobs (columns) SELECT :values WHERE <the tenant's limits hold> [AND <the
    grant exists>] RETURNING id`: the submission's check and insert as one statement (issue 47,
    round 3). On SQLite the write transaction held the database's one write lock across four
    statements (take the lock, count, insert, commit) and every submission of every API worker
    waited for it; now it holds it for this statement and the commit, as the bare insert does.
    Exact under concurrency: the statement's reads and its write are one step under the write
    lock (SQLite), or follow the tenant's advisory lock (PostgreSQL: each statement of a READ
    COMMITTED transaction sees what committed before it). No row back: a check failed, and the
    caller reads which, in the same transaction. Parameters: the columns' values, `count_owner`,
    `active_limit`, and with the flags `queued_limit`, `grant_dataset` and `grantee`."""
    owner = bindparam("count_owner", type_=_COUNTS.owner.type)
    active = (select(func.coalesce(func.sum(_COUNTS.n), 0))
              # Two equalities, not IN (list): an IN list is re-expanded at every execution.
              .where(_COUNTS.owner == owner, or_(_COUNTS.state == JobState.QUEUED.value,
                                                 _COUNTS.state == JobState.RUNNING.value))
              .scalar_subquery())
    checks = [active < bindparam("active_limit", type_=_COUNTS.n.type)]
    if queued_limit:
        waiting = (select(func.coalesce(func.sum(_COUNTS.n), 0))
                   .where(_COUNTS.owner == owner, _COUNTS.state == JobState.QUEUED.value).scalar_subquery())
        checks.append(waiting < bindparam("queued_limit", type_=_COUNTS.n.type))
    if through_grant:
        g = DatasetGrant.__table__.c
        checks.append(exists().where(g.dataset_id == bindparam("grant_dataset", type_=g.dataset_id.type),
                                     g.grantee == bindparam("grantee", type_=g.grantee.type)))
    # CAST: PostgreSQL types a SELECT list's parameters before it sees the target columns (a
    # NULL would be text); a no-op for SQLite's values.
    values = [cast(bindparam(k, type_=_JOBS.c[k].type), _JOBS.c[k].type) for k in columns]
    return (_JOBS.insert().from_select(list(columns), select(*values).where(*checks))
            .returning(_JOBS.c.id))
_UNKNOWN_DATASET = ("unknown dataset {!r}; register it first with POST /v1/datasets"
                    " (another tenant's dataset needs its grant and dataset_owner)")


def parse_job_id(job_id: str) -> int | None:
    # Ids are decimal integers; anything else cannot exist (404, not 422: ids are opaque).
    if not job_id.isascii() or not job_id.isdigit() or len(job_id) > 18:
        return None
    return int(job_id)


_MEASURED_COLUMNS = ("job_id", "ideal_throughput", "ideal_evidence_s", "cpu_rate", "cpu_evidence_s", "max_observed",
                     "best_per_core", "observed", "bound", "updated_at", "client_step_s", "client_batch_bytes",
                     "client_reporter", "client_at", "miss_service_s", "miss_item_bytes")
_RECORD_COLUMNS = (
    Job.id, Job.name, Job.owner, Job.gpus, Dataset.name, Dataset.owner, Job.model, Job.ideal_throughput, Job.epochs,
    Job.steps, Job.step_bytes, Job.total_bytes, Job.consumed_bytes, Job.priority, Job.state, Job.submit_time,
    Job.start_time, Job.finish_time, Job.message, JobAllocationRow.gpus, JobAllocationRow.gpu_share,
    JobAllocationRow.remote_io, Job.access, Job.curriculum_starting_percent, Job.curriculum_alpha,
    Job.curriculum_step, Job.curriculum_batch, Job.cpu_rate, Job.autocache_expansion, Job.post_cpu_rate,
    JobAllocationRow.cpu, Dataset.size, CacheAllocationRow.bytes,
    *(getattr(JobMeasurementRow, c) for c in _MEASURED_COLUMNS),
    Job.last_bound, Job.last_predicted_throughput, Job.last_bound_at, Job.loader_workers, Job.loader_item_bytes,
    CacheAllocationRow.expansion,
)
_LAST_BOUND = 33 + len(_MEASURED_COLUMNS)  # the row's last_bound, then its throughput and time, then its loader
ENDED_STATES = (JobState.FINISHED, JobState.FAILED, JobState.CANCELLED)
_EXPANSION = len(_RECORD_COLUMNS) - 1  # the row's autocaching column (None: source bytes)
_DIAGNOSIS_AT = positions(_RECORD_COLUMNS)  # where diagnosis.COLUMNS are in a record row


_JOB_QUERY = (select(*_RECORD_COLUMNS).join(Dataset, Job.dataset_id == Dataset.id)
              .outerjoin(JobAllocationRow, JobAllocationRow.job_id == Job.id)
              .outerjoin(CacheAllocationRow, CacheAllocationRow.dataset_id == Dataset.id)
              .outerjoin(JobMeasurementRow, JobMeasurementRow.job_id == Job.id))
_GET_JOB = _JOB_QUERY.where(Job.id == bindparam("jid"))
# Another tenant's job is not found: the owner is part of the lookup, not a check after it.
_GET_OWN_JOB = _JOB_QUERY.where(Job.id == bindparam("jid"), Job.owner == bindparam("owner"))


def _row_record(r, **extra: Any) -> JobRecord:  # type: ignore[no-untyped-def]
    """`extra`: fields a listing leaves at their defaults (GET one job: its cache mode)."""
    return JobRecord(
        id=str(r[0]), name=r[1], owner=r[2], gpus=r[3], dataset=r[4], dataset_owner=r[5], model=r[6],
        ideal_throughput=r[7], epochs=r[8], steps=r[9], step_bytes=r[10], total_bytes=r[11], consumed_bytes=r[12],
        remaining_bytes=max(r[11] - r[12], 0.0), priority=r[13], state=JobState(r[14]).value, submit_time=r[15],
        start_time=r[16], finish_time=r[17], message=r[18], allocated_gpus=r[19] or 0, gpu_share=r[20] or 0.0,
        remote_io=r[21], access=access_from_row(*r[22:27]), cpu_rate=r[27], autocache_expansion=r[28],
        post_cpu_rate=r[29], allocated_cpus=r[30],
        measured_parameters=None if r[33] is None else params_of(
            JobMeasurementRow(**dict(zip(_MEASURED_COLUMNS, r[33:33 + len(_MEASURED_COLUMNS)]))), r[7], r[27]),
        last_bound=r[_LAST_BOUND], last_predicted_throughput=r[_LAST_BOUND + 1], last_bound_at=r[_LAST_BOUND + 2],
        loader=loader_from_row(r[_LAST_BOUND + 3], r[_LAST_BOUND + 4]), **extra,
    )


def _with_bottlenecks(rows: list, records: list[JobRecord], capacity) -> list[JobRecord]:  # type: ignore[no-untyped-def]
    """Running jobs' records with their diagnosis (scheduler/service/diagnosis.py, the one every
    view reads; one vectorised call for the whole list)."""
    idx = [i for i, rec in enumerate(records) if rec.state == JobState.RUNNING.value]
    if not idx:
        return records
    now = time.time()
    found = diagnose_jobs([record_input(rows[i], _DIAGNOSIS_AT, now) for i in idx], float(capacity.remote_io))
    out = list(records)
    for i, b in zip(idx, found):
        out[i] = replace(out[i], bottleneck=b)
    return out


class Catalogue:
    def __init__(self, sessions: sessionmaker, config: ServiceConfig, write_lock: threading.RLock,
                 trigger: Callable[[str], None], workloads: Any = None):
        self.sessions = sessions
        self.config = config
        self._write_lock = write_lock
        self._trigger = trigger
        # A backend that creates a job's workload from its pod_template (Kubernetes), else None.
        self.workloads = workloads if callable(getattr(workloads, "create_workload", None)) else None
        # The last submission time this process gave (under the write lock): FIFO orders by it,
        # so a wall clock stepped back between two submissions must not invert their order.
        self._last_submit = 0.0

    # ------------------------------------------------------------------ datasets

    def _dataset_record(self, s: Session, d: Dataset, who: Principal) -> DatasetRecord:
        """`who`'s view: whom a dataset is shared with is its owner's (and the admin's) to see; a
        grantee sees only its own grant."""
        cred = s.get(Credential, d.credential_id) if d.credential_id is not None else None
        grants = tuple(s.scalars(select(DatasetGrant.grantee).where(DatasetGrant.dataset_id == d.id)
                                 .order_by(DatasetGrant.grantee)))
        if not who.is_admin and who.user != d.owner:
            grants = tuple(g for g in grants if g == who.user)
        expansion = s.scalar(select(CacheAllocationRow.expansion).where(CacheAllocationRow.dataset_id == d.id))
        return DatasetRecord(d.name, d.uri, d.size, d.item_count, d.owner, d.created_at, storage_key(d.id, d.name),
                             cred.name if cred else None, grants, "source" if expansion is None else "preprocessed", expansion)

    def _visible_dataset(self, s: Session, who: Principal, name: str, owner: str | None) -> Dataset | None:
        """The dataset `owner/name` if `who` may use it: its owner, a grantee, or the admin."""
        owner = owner or who.user
        d = s.scalar(select(Dataset).where(Dataset.owner == owner, Dataset.name == name))
        if d is None or who.is_admin or d.owner == who.user:
            return d
        granted = s.get(DatasetGrant, (d.id, who.user))
        return d if granted is not None else None

    def _usable_dataset_and_quota(self, c: Connection, who: Principal, name: str,
                                  owner: str | None) -> tuple[Any, TenantQuota]:
        """The submission path's reads: `_visible_dataset` as plain columns (id, name, owner,
        size), or None, and the caller's quota."""
        owner = owner or who.user
        d = c.execute(_DATASET_AND_QUOTA, {"owner": owner, "name": name, "tenant": who.user}).first()
        if d is None:
            return None, self.config.default_quota  # refused as an unknown dataset
        q = self.config.default_quota if d.quota_tenant is None else TenantQuota(*d[5:])
        if who.is_admin or d.owner == who.user:
            return d, q
        granted = c.execute(_GRANT, {"dataset_id": d.id, "grantee": who.user}).first()
        return (d if granted is not None else None), q

    def register_dataset(self, who: Principal, req: NewDataset) -> tuple[DatasetRecord, bool]:
        """Register a dataset of the caller's tenant; re-registering identical fields is a no-op
        (returns created=False), different fields a 409."""
        check_name(req.name, "name")
        if not (0 < req.size <= MAX_BYTES) or not math.isfinite(req.size):
            raise ServiceError(f"size {req.size!r} must be > 0 and <= 1e21 bytes", field="size")
        try:
            self.config.uri_policy.check(req.uri)
        except UserError as exc:
            raise BadUri(str(exc), field="uri") from None
        with self._write_lock, self.sessions.begin() as s:
            _lock_tenant_objects(s, who.user)
            cred_id = None
            if req.credential is not None:
                cred_id = s.scalar(select(Credential.id).where(Credential.owner == who.user, Credential.name == req.credential))
                if cred_id is None:
                    raise NotFoundError(f"no credential named {req.credential!r}; create it with POST /v1/credentials",
                                        field="credential")
            existing = s.scalar(select(Dataset).where(Dataset.owner == who.user, Dataset.name == req.name))
            if existing is not None:
                same = (existing.uri, existing.size, existing.item_count, existing.credential_id) == (
                    req.uri, req.size, req.item_count, cred_id)
                if not same:
                    raise ConflictError(f"dataset {req.name!r} is already registered with different fields", field="name")
                return self._dataset_record(s, existing, who), False
            _check_room(s, select(func.count()).select_from(Dataset).where(Dataset.owner == who.user),
                        self.config.objects.datasets, "you have registered as many datasets as a tenant may", "name")
            row = Dataset(
                name=req.name, uri=req.uri, size=float(req.size), item_count=req.item_count,
                owner=who.user, created_at=time.time(), credential_id=cred_id,
            )
            s.add(row)
            s.flush()
            return self._dataset_record(s, row, who), True

    def list_datasets(self, who: Principal, limit: int = 1000, offset: int = 0) -> list[DatasetRecord]:
        """Own datasets and those granted to the caller (the admin: all), a page in (owner, name) order."""
        with self.sessions() as s:
            q = select(Dataset).order_by(Dataset.owner, Dataset.name)
            if not who.is_admin:
                granted = select(DatasetGrant.dataset_id).where(DatasetGrant.grantee == who.user)
                q = q.where((Dataset.owner == who.user) | Dataset.id.in_(granted))
            return [self._dataset_record(s, d, who) for d in s.scalars(q.limit(limit).offset(offset))]

    def get_dataset(self, who: Principal, name: str, owner: str | None = None) -> DatasetRecord:
        with self.sessions() as s:
            if owner is not None and who.user in self.config.node_agents:
                # A node agent mounts a tenant's dataset for that tenant's pods: read-only lookup.
                d = s.scalar(select(Dataset).where(Dataset.owner == owner, Dataset.name == name))
            else:
                d = self._visible_dataset(s, who, name, owner)
            if d is None:
                raise NotFoundError(f"no dataset named {name!r}", field="name")
            return self._dataset_record(s, d, who)

    def dataset_source_credential(self, who: Principal, name: str, owner: str) -> SourceCredential | None:
        """The credential the node agent of `who` mounts `owner`'s dataset `name` with, for that
        tenant's pods (None: the dataset is read anonymously). Node agents only: the agent hands it
        to the one `silod mount` process of that (tenant, dataset), as the local backend does,
        so the node never reads a tenant's data with its own cloud keys."""
        if who.user not in self.config.node_agents:
            raise ForbiddenError("only a node agent's token (silod serve --node-agent USER) may read a dataset's"
                                 " source credential")
        # Never hand out data rights beyond the node's need (issue 20): the agent's node from its
        # identity (the reviewed pod's node, or the static token's --node-agent USER=NODE), never
        # from the request. An agent token bound to no node mounts nothing: it gets no secret.
        node = who.node or self.config.agent_node(who.user)
        if node is None:
            raise ForbiddenError("this node agent's token is bound to no node (silod serve --node-agent USER=NODE, or"
                                 " an agent pod's own token): it may not read a dataset's source credential")
        with self.sessions() as s:
            d = s.scalar(select(Dataset).where(Dataset.owner == owner, Dataset.name == name))
            if d is None:
                raise NotFoundError(f"no dataset named {name!r}", field="name")
            if not self._needed_on_node(s, d, node) and not self._pod_mounts_it(owner, node, name):
                raise ForbiddenError(
                    f"node {node} has no reason to mount {owner}'s dataset {name!r}: no active silod job using it"
                    f" has a pod bound to that node (the scheduler's record from the API server; a pod just"
                    f" bound is recorded within a poll, retry then), nor does a pod of {owner}'s namespace on"
                    f" that node have a silod volume of it (asked of the API server, when agent pods' tokens are"
                    f" checked there)", field="name")
            cred = s.get(Credential, d.credential_id) if d.credential_id is not None else None
            if cred is None:
                return None
            from scheduler.service.sealed import SecretBox, SecretUnavailable

            stored, box = cred.secret_access_key, self.config.secrets
            try:
                if box is None:
                    if SecretBox.is_sealed(stored):
                        raise SecretUnavailable("this service has no secret keys (ServiceConfig.secrets)")
                    secret = stored
                else:
                    secret = box.open(stored)
            except SecretUnavailable as exc:
                raise ServiceError(f"dataset {name!r}: its credential {cred.name!r} cannot be opened: {exc}",
                                   field="credential") from None
            return SourceCredential(cred.access_key_id, secret, cred.endpoint_url, cred.region)

    @staticmethod
    def _needed_on_node(s: Session, d: Dataset, node: str) -> bool:
        """Whether `node` has a reason to mount dataset `d`: an active job reading it (its owner's or
        a grantee's) has a pod bound to `node`, in the scheduling leader's own record
        (`workload_pods`: pods attributed from the API server by controller chain, never from
        labels or annotations a tenant writes; scheduler/service/consumption.py)."""
        hit = s.scalar(
            select(WorkloadPod.pod_uid).join(Job, Job.id == WorkloadPod.job_id)
            .where(WorkloadPod.node == node, Job.dataset_id == d.id, Job.state.in_(ACTIVE_STATES)).limit(1))
        return hit is not None

    def _pod_mounts_it(self, owner: str, node: str, name: str) -> bool:
        """On Kubernetes (agent pods' tokens checked with the API server): whether a pod of
        `owner`'s namespace bound to `node` has a silod volume of dataset `name`, e.g. a pod no
        silod job admitted. Asked of the API server, never of labels or annotations."""
        reviewer = self.config.agent_reviewer
        if reviewer is None:
            return False
        from http_guard.agent_identity import ReviewUnavailable, pod_on_node_mounts

        try:
            return pod_on_node_mounts(reviewer, self.config.tenant_namespace_prefix + owner, node, name)
        except ReviewUnavailable as exc:
            raise UpstreamUnavailable(f"cannot check node {node}'s pods with the Kubernetes API server now ({exc});"
                                      f" retry later") from None

    def _own_dataset(self, s: Session, who: Principal, name: str, owner: str | None) -> Dataset:
        owner = owner or who.user
        if owner != who.user and not who.is_admin:
            raise NotFoundError(f"no dataset named {name!r}", field="name")  # grants are the owner's to give
        d = s.scalar(select(Dataset).where(Dataset.owner == owner, Dataset.name == name))
        if d is None:
            raise NotFoundError(f"no dataset named {name!r}", field="name")
        return d

    def grant(self, who: Principal, name: str, grantee: str, owner: str | None = None) -> DatasetRecord:
        """Let `grantee` run jobs on the caller's dataset `name`."""
        check_name(grantee, "grantee")
        with self._write_lock, self.sessions.begin() as s:
            _lock_tenant_objects(s, owner or who.user)
            d = self._own_dataset(s, who, name, owner)
            if grantee == d.owner:
                # It answered 200 and did nothing: a caller who meant another tenant's name
                # would never learn that nobody got the grant.
                raise ServiceError(f"dataset {name!r} belongs to {grantee!r}, who needs no grant to use it; "
                                   f"name the tenant to share it with", field="tenant")
            if s.get(DatasetGrant, (d.id, grantee)) is None:
                _check_room(s, select(func.count()).select_from(DatasetGrant).where(DatasetGrant.dataset_id == d.id),
                            self.config.objects.grants, f"dataset {name!r} is shared with as many tenants as one may be",
                            "tenant")
                s.add(DatasetGrant(dataset_id=d.id, grantee=grantee, created_at=time.time()))
                s.flush()
            return self._dataset_record(s, d, who)

    def revoke_grant(self, who: Principal, name: str, grantee: str, owner: str | None = None) -> DatasetRecord:
        """Take a grant back. New submissions are refused, and the grantee's jobs on the dataset
        that have not started yet fail (they would otherwise start later and read the owner's
        data with the owner's credential). Jobs that have started keep running: they were
        admitted with the grant and have read its data already."""
        with self._write_lock, self.sessions.begin() as s:
            d = self._own_dataset(s, who, name, owner)
            row = s.get(DatasetGrant, (d.id, grantee))
            if row is None:
                raise NotFoundError(f"dataset {name!r} is not shared with {grantee!r}", field="grantee")
            s.delete(row)
            s.execute(update(Job).where(Job.dataset_id == d.id, Job.owner == grantee, Job.state == JobState.QUEUED,
                                        Job.start_time.is_(None))
                      .values(state=JobState.FAILED, finish_time=time.time(),
                              message=f"{d.owner} revoked the grant of dataset {d.name!r} before the job started"))
            s.flush()
            return self._dataset_record(s, d, who)

    # ------------------------------------------------------------------ credentials

    def add_credential(self, who: Principal, req: NewCredential) -> CredentialRecord:
        check_name(req.name, "name")
        if req.kind != "s3":
            raise ServiceError(f"credential kind {req.kind!r} is not supported; use 's3'", field="kind")
        if req.endpoint_url is not None:
            # The data path connects there with the tenant's keys: the same allow-list as
            # dataset URIs (https to a public host, or a prefix the operator listed).
            try:
                self.config.uri_policy.check(req.endpoint_url.rstrip("/") + "/")
            except UserError as exc:
                raise BadUri(f"endpoint_url: {exc}", field="endpoint_url") from None
        if self.config.secrets is None:
            raise ServiceError("this service has no secret key to seal credentials with (set SILOD_SECRET_KEYS or"
                               " give silod serve a --state-dir)", field=None)
        sealed = self.config.secrets.seal(req.secret_access_key)  # never stored in the clear
        with self._write_lock, self.sessions.begin() as s:
            _lock_tenant_objects(s, who.user)
            if s.scalar(select(Credential.id).where(Credential.owner == who.user, Credential.name == req.name)) is not None:
                raise ConflictError(f"credential {req.name!r} already exists; delete it first to replace it", field="name")
            _check_room(s, select(func.count()).select_from(Credential).where(Credential.owner == who.user),
                        self.config.objects.credentials, "you hold as many credentials as a tenant may", "name")
            row = Credential(owner=who.user, name=req.name, kind=req.kind, access_key_id=req.access_key_id,
                             secret_access_key=sealed, endpoint_url=req.endpoint_url, region=req.region,
                             created_at=time.time())
            s.add(row)
            s.flush()
            return _credential_record(row)

    def list_credentials(self, who: Principal, limit: int = 1000, offset: int = 0) -> list[CredentialRecord]:
        with self.sessions() as s:
            q = select(Credential).order_by(Credential.owner, Credential.name)
            if not who.is_admin:
                q = q.where(Credential.owner == who.user)
            return [_credential_record(c) for c in s.scalars(q.limit(limit).offset(offset))]

    def delete_credential(self, who: Principal, name: str) -> None:
        with self._write_lock, self.sessions.begin() as s:
            row = s.scalar(select(Credential).where(Credential.owner == who.user, Credential.name == name))
            if row is None:
                raise NotFoundError(f"no credential named {name!r}", field="name")
            if s.scalar(select(func.count()).select_from(Dataset).where(Dataset.credential_id == row.id)):
                raise ConflictError(f"credential {name!r} is used by a dataset", field="name")
            s.delete(row)

    # ------------------------------------------------------------------ quotas

    def quota(self, tenant: str) -> TenantQuota:
        with self.sessions() as s:
            return self._quota(s, tenant)

    def _quota(self, s: Session | Connection, tenant: str) -> TenantQuota:
        row = s.execute(_QUOTA, {"tenant": tenant}).first()
        if row is None:
            return self.config.default_quota
        return TenantQuota(*row)

    def ideal_ceiling(self, q: TenantQuota) -> float:
        """The most f* per GPU a job under quota `q` may declare (bytes/s): the tenant's own, else
        the default quota's, else DEFAULT_IDEAL_PER_GPU on this cluster's GPUs. A declaration
        orders the SJF queue (and preempts) before anything is measured: it is a bounded claim."""
        for v in (q.ideal_per_gpu, self.config.default_quota.ideal_per_gpu):
            if v is not None:
                return float(v)
        return DEFAULT_IDEAL_PER_GPU * self.config.gpu_speed

    def work_range(self, q: TenantQuota) -> tuple[float | None, float | None]:
        """The least and the most work (bytes) a job under quota `q` may declare: the tenant's
        own bound, else the default quota's, else none. The shortest declared job goes first in
        SJF (and preempts) before anything is measured: declared work is a bounded claim."""
        d = self.config.default_quota
        return (q.min_work if q.min_work is not None else d.min_work,
                q.max_work if q.max_work is not None else d.max_work)

    def set_quota(self, who: Principal, tenant: str, quota: TenantQuota) -> TenantQuota:
        if not who.is_admin:
            raise ForbiddenError("only the admin may set quotas")
        with self._write_lock, self.sessions.begin() as s:
            row = s.get(Quota, tenant)
            if row is None:
                s.add(Quota(tenant=tenant, **{k: getattr(quota, k) for k in TenantQuota.FIELDS}))
            else:
                for k in TenantQuota.FIELDS:
                    setattr(row, k, getattr(quota, k))
        self._trigger("quota")
        return quota

    # ------------------------------------------------------------------ jobs

    def _throughput(self, req: NewJob) -> float:
        if req.ideal_throughput is not None:
            ideal = float(req.ideal_throughput)
            if not (0 < ideal <= MAX_BYTES):
                raise ServiceError("ideal_throughput must be > 0 and <= 1e21 bytes/s", field="ideal_throughput")
            return ideal
        if req.model is not None:
            try:
                spec = lookup_model(req.model)
            except UserError as exc:
                raise ServiceError(str(exc), field="model") from exc
            return spec.ideal_per_gpu * req.gpus * self.config.gpu_speed
        raise ServiceError("give ideal_throughput (bytes/s, e.g. \"114MB/s\") or a catalog model", field="ideal_throughput")

    def submit_job(self, who: Principal, req: NewJob, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """A new queued job (created=True), or with a known Idempotency-Key and the same request,
        the job that key created (created=False). The same key with another request is a 409."""
        check_name(req.name, "name")
        if req.pod_template is not None and self.workloads is None:
            raise ServiceError("pod_template needs a backend that creates workloads (silod serve --backend kubernetes)",
                               field="pod_template")
        if req.program is not None and self.workloads is not None:
            raise ServiceError("program is what the local backend runs; on Kubernetes give the pods to run as"
                               " pod_template", field="program")
        check_name(req.dataset, "dataset")
        check = getattr(self.workloads, "check_workload", None)
        if req.pod_template is not None and callable(check):
            try:  # the admission webhook's own check, before anything is recorded
                check(who.user, req.name, req.gpus, req.dataset, req.pod_template)
            except UserError as exc:
                raise ServiceError(str(exc), field="pod_template") from None
        cap = self.config.capacity
        if req.gpus < 1:
            raise ServiceError(f"gpus = {req.gpus}; a job needs at least 1 GPU", field="gpus")
        if req.gpus > cap.gpus:
            raise ServiceError(f"gpus = {req.gpus} but the cluster has only {cap.gpus} GPUs", field="gpus")
        ideal = self._throughput(req)
        digest = hashlib.sha256(json.dumps(asdict(req), sort_keys=True).encode()).hexdigest() if idempotency_key else ""
        for _attempt in range(2):  # a concurrent request with the same key wins the insert: read its job
            try:
                return self._submit(who, req, ideal, idempotency_key, digest)
            except IntegrityError:
                if idempotency_key is None:
                    raise
        raise ConflictError("the Idempotency-Key is being used by a concurrent request; retry", field="Idempotency-Key")

    def _submit(self, who: Principal, req: NewJob, ideal: float, key: str | None, digest: str) -> tuple[JobRecord, bool]:
        engine = self.sessions.kw["bind"]
        # What cannot change under us is read before the write transaction: on SQLite that
        # transaction holds the database's one write lock, which every other submission (in
        # every API worker) and the round's write wait for, so it does the insert and only what
        # must be atomic with it. A dataset's owner and id never change (datasets are not
        # deleted); a quota's limits apply to later submissions (a change racing this one may
        # or may not apply to it, as before). An Idempotency-Key inserted meanwhile fails the
        # insert on its primary key and submit_job reads that job.
        # One pooled connection for the reads and the write transaction (a checkout and its
        # reset cost about as much as a statement).
        with engine.connect() as c:
            if key is not None:
                known = c.execute(_IDEMPOTENCY_KEY, {"owner": who.user, "key": key}).first()
                if known is not None:
                    if known.request_hash != digest:
                        raise ConflictError("this Idempotency-Key was used with a different request body",
                                            field="Idempotency-Key")
                    return self.get_job(who, str(known.job_id)), False
            ds, q = self._usable_dataset_and_quota(c, who, req.dataset, req.dataset_owner)
            if ds is None:
                raise NotFoundError(_UNKNOWN_DATASET.format(req.dataset), field="dataset")
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
            c.rollback()  # ends the reads' transaction: the write below begins its own
            return self._insert_job(c, who, req, ideal, key, digest, ds, q, total)

    def _insert_job(self, c: Connection, who: Principal, req: NewJob, ideal: float, key: str | None, digest: str,
                    ds: Any, q: TenantQuota, total: float) -> tuple[JobRecord, bool]:
        if q.gpus is not None and req.gpus > q.gpus:
            raise ForbiddenError(f"gpus = {req.gpus} exceeds your quota of {q.gpus} GPUs (quota gpus)", field="gpus")
        least, most = self.work_range(q)
        if least is not None and total < least:
            raise ForbiddenError(
                f"the job declares {total:.4g} bytes of work, below the {least:.4g} your jobs must declare at least"
                f" (quota min_work: SJF runs the shortest declared job first, so the declaration is bounded);"
                f" declare what it reads (epochs x dataset size, or steps x step_bytes), or ask an admin to lower"
                f" it (PUT /v1/quotas/{who.user})", field="epochs")
        if most is not None and total > most:
            raise ForbiddenError(
                f"the job declares {total:.4g} bytes of work, above the {most:.4g} your jobs may declare"
                f" (quota max_work); declare what it reads, or ask an admin to raise it"
                f" (PUT /v1/quotas/{who.user})", field="epochs")
        if req.ideal_throughput is not None:
            per_gpu = self.ideal_ceiling(q)
            if ideal > per_gpu * req.gpus:
                raise ForbiddenError(
                    f"ideal_throughput {ideal:.4g} B/s is above the {per_gpu:.4g} B/s per GPU x {req.gpus} GPUs"
                    f" = {per_gpu * req.gpus:.4g} B/s your jobs may declare (quota ideal_per_gpu); declare what"
                    f" the job reads when IO is not its bottleneck, or name a catalog model, or ask an admin to"
                    f" raise it (PUT /v1/quotas/{who.user})", field="ideal_throughput")
        # Another tenant's dataset: the grant is checked again in the write transaction, so a job
        # submitted after the grant's revocation committed is refused (revoke_grant's promise).
        through_grant = not who.is_admin and ds.owner != who.user
        # The statement and its parameters are made before the write lock is taken: every other
        # writer waits while it is held (submit_time, which needs the lock, is set under it).
        values = dict(
            name=req.name, owner=who.user, gpus=req.gpus, dataset_id=ds.id, model=req.model,
            ideal_throughput=ideal, epochs=req.epochs, steps=req.steps, step_bytes=req.step_bytes,
            total_bytes=total, consumed_bytes=0.0, priority=req.priority, state=JobState.QUEUED,
            submit_time=0.0, start_time=None, finish_time=None, message="", **access_columns(req.access),
            **pipeline_columns(req.pipeline), program=None if req.program is None else req.program.to_json(),
            loader_workers=None if req.loader is None else req.loader.workers,
            loader_item_bytes=None if req.loader is None else req.loader.item_bytes,
        )
        # Core insert, not an ORM object: attaching a Job to its Dataset would load the
        # dataset's whole job collection (thousands of rows) on every submission.
        params = dict(values, count_owner=who.user, active_limit=self.config.objects.jobs)
        if q.queued_jobs is not None:
            params["queued_limit"] = q.queued_jobs
        if through_grant:
            params.update(grant_dataset=ds.id, grantee=who.user)
        statement = _insert_job_checked(tuple(values), q.queued_jobs is not None, through_grant)
        with self._write_lock, c.begin():
            if c.dialect.name == "postgresql":  # see _insert_job_checked
                c.execute(_TENANT_LOCK_PG, {"k": f"silod-submit:{who.user}"})
            now = params["submit_time"] = max(time.time(), self._last_submit)
            jid = c.execute(statement, params).scalar()
            if jid is None:  # refused: say why (this transaction still holds the lock the statement took)
                if through_grant and c.execute(_GRANT, {"dataset_id": ds.id, "grantee": who.user}).first() is None:
                    raise NotFoundError(_UNKNOWN_DATASET.format(req.dataset), field="dataset")
                self._check_active(c, who, q.queued_jobs)
                raise RuntimeError("the submission's checked insert refused a job that every check allows")
            self._last_submit = now
            if key is not None:
                c.execute(_INSERT_IDEMPOTENCY_KEY, {"owner": who.user, "key": key, "request_hash": digest, "job_id": jid,
                                                    "created_at": now})
        record = JobRecord(
            id=str(jid), name=req.name, owner=who.user, gpus=req.gpus, dataset=ds.name, dataset_owner=ds.owner,
            model=req.model, ideal_throughput=ideal, epochs=req.epochs, steps=req.steps,
            step_bytes=req.step_bytes, total_bytes=total, consumed_bytes=0.0, remaining_bytes=total,
            priority=req.priority, state=JobState.QUEUED.value, submit_time=now, start_time=None,
            finish_time=None, message="", allocated_gpus=0, gpu_share=0.0, remote_io=None,
            access=req.access, **pipeline_columns(req.pipeline), loader=req.loader,
        )
        if req.pod_template is not None:
            self._create_workload(record, req.pod_template)
        self._trigger("submit")
        return record, True

    def _create_workload(self, record: JobRecord, template: Any) -> None:
        """Backends that run pods from a template (Kubernetes) create the job's workload now (the
        scheduling process adopts it by name); a refusal fails the job and is the caller's error."""
        try:
            self.workloads.create_workload(record, template)
            return
        except UserError as exc:
            message = str(exc)
        with self._write_lock, self.sessions.begin() as s:
            job = s.get(Job, int(record.id))
            if job is not None and JobState(job.state).active:
                job.state = JobState.FAILED
                job.finish_time = time.time()
                job.message = message[:2000]
        self._trigger("submit")
        raise ServiceError(message, field="pod_template")

    def _check_active(self, c: Connection, who: Principal, queued_limit: int | None) -> None:
        """Raise the error for the limit a refused submission hit. Called in the transaction of
        the insert that `_insert_job_checked` refused (the enforcement, exact across API workers:
        issue 20's overshoot), under the same lock, so it counts what that statement counted."""
        counts = dict(c.execute(_COUNTS_OF_OWNER, {"owner": who.user}).all())
        waiting = counts.get(JobState.QUEUED.value, 0)
        active, limit = waiting + counts.get(JobState.RUNNING.value, 0), self.config.objects.jobs
        if active >= limit:
            raise ForbiddenError(f"you have {active} active (queued or running) jobs, at most {limit} per tenant (the"
                                 f" service's object limit, --object-limits jobs=N); wait for some to end or cancel"
                                 f" some", field="name")
        if queued_limit is not None and waiting >= queued_limit:
            limit = queued_limit
            raise QuotaExceeded(
                f"you have {waiting} queued jobs, the quota queued_jobs is {limit}; "
                "wait for some to start or cancel some", field="queued_jobs",
            )

    @staticmethod
    def _job_record(j: Job) -> JobRecord:
        a = j.allocation
        return JobRecord(
            id=str(j.id), name=j.name, owner=j.owner, gpus=j.gpus, dataset=j.dataset.name,
            dataset_owner=j.dataset.owner, model=j.model,
            ideal_throughput=j.ideal_throughput, epochs=j.epochs, steps=j.steps, step_bytes=j.step_bytes,
            total_bytes=j.total_bytes, consumed_bytes=j.consumed_bytes,
            remaining_bytes=max(j.total_bytes - j.consumed_bytes, 0.0), priority=j.priority,
            state=JobState(j.state).value, submit_time=j.submit_time, start_time=j.start_time,
            finish_time=j.finish_time, message=j.message,
            allocated_gpus=a.gpus if a else 0, gpu_share=a.gpu_share if a else 0.0,
            remote_io=a.remote_io if a else None,
            access=access_from_row(j.access, j.curriculum_starting_percent, j.curriculum_alpha, j.curriculum_step,
                                   j.curriculum_batch),
            cpu_rate=j.cpu_rate, autocache_expansion=j.autocache_expansion, post_cpu_rate=j.post_cpu_rate,
            allocated_cpus=a.cpu if a else None, last_bound=j.last_bound,
            last_predicted_throughput=j.last_predicted_throughput, last_bound_at=j.last_bound_at,
            loader=loader_from_row(j.loader_workers, j.loader_item_bytes),
        )

    def _load_job(self, s: Session, who: Principal, job_id: str) -> Job:
        pk = parse_job_id(job_id)
        job = s.get(Job, pk) if pk is not None else None
        # Another tenant's job is reported as missing: its existence is not theirs to know.
        if job is None or (not who.is_admin and job.owner != who.user):
            raise NotFoundError(f"no job with id {job_id!r}", field="job_id")
        return job

    def get_job(self, who: Principal, job_id: str, connection: Connection | None = None) -> JobRecord:
        """One job, or NotFoundError. `connection`: read on it (the API reads the job's
        consumption on the same one), else on a connection of its own."""
        pk = parse_job_id(job_id)
        row = None
        if pk is not None:
            # A plain connection, not an ORM session: this is the hottest read (GET /v1/jobs/{id}).
            with nullcontext(connection) if connection is not None else self.sessions.kw["bind"].connect() as c:
                if who.is_admin:
                    row = c.execute(_GET_JOB, {"jid": pk}).first()
                else:
                    row = c.execute(_GET_OWN_JOB, {"jid": pk, "owner": who.user}).first()
        if row is None:
            raise NotFoundError(f"no job with id {job_id!r}", field="job_id")
        expansion = row[_EXPANSION]
        record = _row_record(row, cache_mode="source" if expansion is None else "preprocessed", cache_expansion=expansion)
        return _with_bottlenecks([row], [record], self.config.capacity)[0]

    def list_jobs(
        self, who: Principal, state: str | None = None, owner: str | None = None, limit: int = 1000, offset: int = 0
    ) -> list[JobRecord]:
        # Plain columns, not ORM objects: listing is the hottest read and ORM loading tripled its cost.
        q = _JOB_QUERY.order_by(Job.id)
        if not who.is_admin:
            q = q.where(Job.owner == who.user)
        elif owner is not None:
            q = q.where(Job.owner == owner)
        if state is not None:
            if state == "active":
                q = q.where(Job.state.in_(ACTIVE_STATES))
            elif state == "ended":  # the history: finished, failed and cancelled, newest first
                q = q.where(Job.state.in_(ENDED_STATES)).order_by(None).order_by(Job.id.desc())
            else:
                try:
                    q = q.where(Job.state == JobState(state))
                except ValueError:
                    valid = ", ".join([*(s.value for s in JobState), "active", "ended"])
                    raise ServiceError(f"unknown state {state!r}; choose one of: {valid}", field="state") from None
        q = q.limit(limit).offset(offset)
        with self.sessions() as s:
            rows = list(s.execute(q))
        return _with_bottlenecks(rows, [_row_record(r) for r in rows], self.config.capacity)

    def cancel_job(self, who: Principal, job_id: str) -> JobRecord:
        with self._write_lock, self.sessions.begin() as s:
            job = self._load_job(s, who, job_id)
            if not JobState(job.state).active:
                raise ConflictError(f"job {job_id} is already {JobState(job.state).value}", field="job_id")
            job.state = JobState.CANCELLED
            job.finish_time = time.time()
            revoke_job_tokens(s, job.id, job.finish_time)  # its pods' or program's report token
            job.message = f"cancelled by {who.user}"
            record = self._job_record(job)
        self._trigger("cancel")
        return record


def _credential_record(c: Credential) -> CredentialRecord:
    return CredentialRecord(c.name, c.owner, c.kind, c.access_key_id, c.endpoint_url, c.region, c.created_at)
