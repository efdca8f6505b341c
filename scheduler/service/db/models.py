"""The service's persistent state: jobs, datasets, current allocations and their audit trail.

Sizes are stored as double precision floats of bytes: datasets reach 1e13 bytes and the API
accepts up to 1e21, beyond a 64-bit integer, and the model works in floats anyway.

The schema is created and changed only by the Alembic migrations in scheduler/service/migrations;
tests check that these models and the migrations agree.
"""

from __future__ import annotations

import enum

from sqlalchemy import BigInteger, Boolean, Enum, Float, ForeignKey, Index, Integer, MetaData, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Stable constraint names, so migrations can refer to them on every database.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class JobState(enum.StrEnum):
    QUEUED = "queued"  # waiting for GPUs (never started, or preempted)
    RUNNING = "running"  # holds its GPUs on the backend
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        return self in (JobState.QUEUED, JobState.RUNNING)


ACTIVE_STATES = (JobState.QUEUED, JobState.RUNNING)


class Dataset(Base):
    """A dataset belongs to one tenant (`owner`); names are unique per tenant, not globally, so
    one tenant can neither squat nor read another's name. Other tenants reach it only through a
    `DatasetGrant`. The data path reads it with the owner's `credential`, never the cluster's."""

    __tablename__ = "datasets"
    __table_args__ = (UniqueConstraint("owner", "name", name="uq_datasets_owner_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    uri: Mapped[str] = mapped_column(String(2048))
    size: Mapped[float] = mapped_column(Float)  # bytes
    item_count: Mapped[int | None] = mapped_column(Integer, nullable=True)
    owner: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)  # unix seconds
    credential_id: Mapped[int | None] = mapped_column(ForeignKey("credentials.id"), nullable=True)

    jobs: Mapped[list[Job]] = relationship(back_populates="dataset")


class Job(Base):
    __tablename__ = "jobs"
    # ix_jobs_state_priority_submit: a waiting job's queue position is a count over it (overview.py).
    __table_args__ = (Index("ix_jobs_state_submit", "state", "submit_time"), Index("ix_jobs_owner", "owner"),
                      Index("ix_jobs_state_priority_submit", "state", "priority", "submit_time"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    owner: Mapped[str] = mapped_column(String(128))
    gpus: Mapped[int] = mapped_column(Integer)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id"))
    model: Mapped[str | None] = mapped_column(String(64), nullable=True)
    ideal_throughput: Mapped[float] = mapped_column(Float)  # f*, bytes/s at `gpus` GPUs
    epochs: Mapped[float | None] = mapped_column(Float, nullable=True)
    steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    step_bytes: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_bytes: Mapped[float] = mapped_column(Float)  # the job's whole work
    consumed_bytes: Mapped[float] = mapped_column(Float, default=0.0)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[JobState] = mapped_column(
        Enum(JobState, name="job_state", native_enum=False, length=16, values_callable=lambda e: [m.value for m in e])
    )
    submit_time: Mapped[float] = mapped_column(Float)
    start_time: Mapped[float | None] = mapped_column(Float, nullable=True)  # first start
    finish_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    # How the job reads (estimator/access.py): epoch | curriculum | irregular; the curriculum
    # pacing parameters are set only for curriculum (migration 0002).
    access: Mapped[str] = mapped_column(String(16), default="epoch", server_default="epoch")
    curriculum_starting_percent: Mapped[float | None] = mapped_column(Float, nullable=True)
    curriculum_alpha: Mapped[float | None] = mapped_column(Float, nullable=True)
    curriculum_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    curriculum_batch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The CPU preprocessing stage (estimator/pipeline.py; migration 0005); NULL cpu_rate = not CPU-bound.
    cpu_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    autocache_expansion: Mapped[float | None] = mapped_column(Float, nullable=True)
    post_cpu_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The local backend's program for the job, JSON {"command": [...], "env": {...}} (migration
    # 0009); NULL runs the built-in stand-in worker.
    program: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The model's diagnosis (scheduler/service/diagnosis.py) as of the last round the job ran in
    # (migration 0011): what bound an ended job; NULL = never diagnosed.
    last_bound: Mapped[str | None] = mapped_column(String(16), nullable=True)
    last_predicted_throughput: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_bound_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The job's data loader as declared (migration 0013; types.JobLoader): its worker processes
    # and, optionally, the size of one item; NULL workers = not declared (the paper's model).
    loader_workers: Mapped[int | None] = mapped_column(Integer, nullable=True)
    loader_item_bytes: Mapped[float | None] = mapped_column(Float, nullable=True)

    dataset: Mapped[Dataset] = relationship(back_populates="jobs", lazy="joined")
    allocation: Mapped[JobAllocationRow | None] = relationship(
        back_populates="job", uselist=False, cascade="all, delete-orphan", lazy="joined"
    )


class JobAllocationRow(Base):
    """What the job holds now. A row with running=True means the backend was told to run it;
    it is deleted once the job has been stopped after leaving the active states."""

    __tablename__ = "job_allocations"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    gpus: Mapped[int] = mapped_column(Integer)  # GPUs held this round (0 or the job's gpus)
    gpu_share: Mapped[float] = mapped_column(Float)  # the policy's time-average share
    remote_io: Mapped[float | None] = mapped_column(Float, nullable=True)  # bytes/s; None = unmanaged
    cpu: Mapped[float | None] = mapped_column(Float, nullable=True)  # cores while running; None = CPU not modelled
    running: Mapped[bool] = mapped_column(Boolean)
    round_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)

    job: Mapped[Job] = relationship(back_populates="allocation")


class CacheAllocationRow(Base):
    __tablename__ = "cache_allocations"

    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id"), primary_key=True)
    bytes: Mapped[float] = mapped_column(Float)
    round_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)
    #: autocaching: bytes cached per source byte when the cache holds preprocessed data; None = source
    expansion: Mapped[float | None] = mapped_column(Float, nullable=True)


class Round(Base):
    """One scheduling round: when, why, with which policy, and how long it took."""

    __tablename__ = "rounds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[float] = mapped_column(Float)
    policy: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(String(64))  # timer | submit | cancel | finish | policy | start
    active_jobs: Mapped[int] = mapped_column(Integer)
    running_jobs: Mapped[int] = mapped_column(Integer)
    changes: Mapped[int] = mapped_column(Integer)
    duration_s: Mapped[float] = mapped_column(Float)
    objective: Mapped[float | None] = mapped_column(Float, nullable=True)


class AllocationChange(Base):
    """Audit trail: one row per changed value of an allocation (GPUs, share, IO, cache)."""

    __tablename__ = "allocation_changes"
    __table_args__ = (Index("ix_allocation_changes_subject", "subject_kind", "subject"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round_id: Mapped[int | None] = mapped_column(ForeignKey("rounds.id"), nullable=True)
    time: Mapped[float] = mapped_column(Float)
    subject_kind: Mapped[str] = mapped_column(String(16))  # "job" | "dataset"
    subject: Mapped[str] = mapped_column(String(128))  # job id or dataset name
    resource: Mapped[str] = mapped_column(String(16))  # gpus | gpu_share | remote_io | cache | running
    old_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    new_value: Mapped[float | None] = mapped_column(Float, nullable=True)


class Setting(Base):
    """Small key/value state that must survive a restart (the current policy)."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class ApiToken(Base):
    """A bearer token, stored only as HMAC-SHA256(server key, token): a copy of the database does
    not reveal a usable token. Revocation and expiry take effect without a restart."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    owner: Mapped[str] = mapped_column(String(64))  # the tenant the token acts for
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    label: Mapped[str] = mapped_column(String(128), default="")
    source: Mapped[str] = mapped_column(String(16), default="api")  # api | file
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # A job's report token (migration 0012): it may only post that job's step reports, and is
    # revoked when the job ends. NULL: an ordinary token of its owner.
    job_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)


class DatasetGrant(Base):
    """The owner of a dataset lets another tenant run jobs on it (read through the owner's
    credential, into the same cache)."""

    __tablename__ = "dataset_grants"

    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id"), primary_key=True)
    grantee: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)


class Credential(Base):
    """A tenant's credential for a remote store (S3 keys). Datasets name one; the data path
    reads the dataset with it. The secret is never returned by the API."""

    __tablename__ = "credentials"
    __table_args__ = (UniqueConstraint("owner", "name", name="uq_credentials_owner_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))  # s3
    access_key_id: Mapped[str] = mapped_column(String(256))
    secret_access_key: Mapped[str] = mapped_column(Text)
    endpoint_url: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    region: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class TenantJobCount(Base):
    """How many jobs each tenant has in each state, kept by database triggers on `jobs` (migration
    0008), so every write path counts, in the same transaction: a submission checks the tenant's
    limits and the overview its totals without counting rows (issue 47)."""

    __tablename__ = "tenant_job_counts"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), primary_key=True)
    n: Mapped[int] = mapped_column(Integer)


class Quota(Base):
    """Per-tenant limits (None: no limit). Enforced at submission and by the scheduling round."""

    __tablename__ = "quotas"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    gpus: Mapped[int | None] = mapped_column(Integer, nullable=True)  # GPUs held at once
    cache_bytes: Mapped[float | None] = mapped_column(Float, nullable=True)  # cache over its datasets
    running_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)  # jobs holding GPUs at once
    queued_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)  # active (queued or running) jobs
    # Most f* per GPU a job may declare (bytes/s); None: the service's default (migration 0008).
    ideal_per_gpu: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The least and the most work (bytes) a job may declare; None: the service's default (0010).
    min_work: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_work: Mapped[float | None] = mapped_column(Float, nullable=True)


class IdempotencyKey(Base):
    """`Idempotency-Key` of a job submission: the same key and body return the same job."""

    __tablename__ = "idempotency_keys"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    created_at: Mapped[float] = mapped_column(Float)


class Lease(Base):
    """A named lease (the scheduling leader among several API workers): whoever holds an
    unexpired lease runs the rounds; the others only serve requests."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[float] = mapped_column(Float)


class WorkloadPod(Base):
    """A pod of a workload silod admitted, as the scheduling leader read it from the API server:
    its uid, its node (spec.nodeName, set by the scheduler's binding) and its controller chain to
    the admitted workload. Written only by the leader; the first attribution of a uid is kept
    (a pod cannot move to another job). Node agents' consumption reports count only for these."""

    __tablename__ = "workload_pods"

    pod_uid: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    node: Mapped[str] = mapped_column(String(253))
    namespace: Mapped[str] = mapped_column(String(63))
    name: Mapped[str] = mapped_column(String(253))
    seen_at: Mapped[float] = mapped_column(Float)


class PodConsumption(Base):
    """What a node agent measured one pod read through the node's FUSE mounts (POST
    /v1/agents/{node}/consumption). Counters are cumulative and only ever raised (max-merge): a
    replayed or lower report changes nothing."""

    __tablename__ = "pod_consumption"

    node: Mapped[str] = mapped_column(String(253), primary_key=True)
    pod_uid: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    agent: Mapped[str] = mapped_column(String(64))  # the authenticated agent user that reported it
    read_bytes: Mapped[int] = mapped_column(BigInteger)
    hit_bytes: Mapped[int] = mapped_column(BigInteger)
    miss_bytes: Mapped[int] = mapped_column(BigInteger)
    hits: Mapped[int] = mapped_column(BigInteger)
    misses: Mapped[int] = mapped_column(BigInteger)
    # Its misses delivered whole, their summed service time (microseconds) and bytes (migration
    # 0014): the loader term's L of the pod's job (estimator.loader_miss_rate).
    miss_service_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    miss_service_us: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    miss_service_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    first_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class NodeCacheDisk(Base):
    """The bytes a node's cache directory can hold, as its node agent reports them with its
    consumption reports (statvfs of the directory, capped by the agent's --cache-size), from a
    token bound to that node. The Kubernetes backend plans with it while it is fresh."""

    __tablename__ = "node_cache_disks"

    node: Mapped[str] = mapped_column(String(253), primary_key=True)
    capacity_bytes: Mapped[float] = mapped_column(Float)
    agent: Mapped[str] = mapped_column(String(128))  # the authenticated agent user that reported it
    reported_at: Mapped[float] = mapped_column(Float)


class JobMeasurementRow(Base):
    """A job's measured parameters (issue 22; migration 0007): f* and the per-core preprocessing
    rate as the scheduling process estimates them from the data plane's figures
    (estimator.measured.observe_job), and the job's latest client report (step time, batch size;
    POST /v1/jobs/{id}/report). The scheduling process writes the estimate columns, the API
    workers the client columns: each writes only its own, so neither overwrites the other."""

    __tablename__ = "job_measurements"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    ideal_throughput: Mapped[float | None] = mapped_column(Float, nullable=True)  # measured f*, bytes/s
    ideal_evidence_s: Mapped[float] = mapped_column(Float, default=0.0)
    cpu_rate: Mapped[float | None] = mapped_column(Float, nullable=True)  # measured bytes/s per core
    cpu_evidence_s: Mapped[float] = mapped_column(Float, default=0.0)
    max_observed: Mapped[float] = mapped_column(Float, default=0.0)  # highest read rate measured, bytes/s
    best_per_core: Mapped[float] = mapped_column(Float, default=0.0)
    observed: Mapped[float | None] = mapped_column(Float, nullable=True)  # last measured read rate
    bound: Mapped[str] = mapped_column(String(16), default="")  # what held it in the last interval
    updated_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    client_step_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    client_batch_bytes: Mapped[float | None] = mapped_column(Float, nullable=True)
    client_reporter: Mapped[str | None] = mapped_column(String(128), nullable=True)
    client_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The mount's per-miss service time (migration 0013): the mean time a missed item held its
    # reader (open request to last byte), the mean size of those items, and how many misses the
    # means stand for (capped: a running mean over the recent misses). The loader term's L and s.
    miss_service_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    miss_item_bytes: Mapped[float | None] = mapped_column(Float, nullable=True)
    miss_service_n: Mapped[float | None] = mapped_column(Float, nullable=True)
