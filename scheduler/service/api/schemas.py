"""Request and response bodies of the REST API.

Requests are strict about shape (unknown fields are rejected, so a typo like `gpu` is a 422
naming the field instead of a silently ignored value) and lenient about units: sizes and rates
accept numbers or strings such as "143GB" and "114MB/s", parsed by estimator.units.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from estimator.access import AccessPattern, parse_access
from estimator.errors import UserError
from estimator.pipeline import MAX_EXPANSION, InputPipeline, parse_pipeline
from traces.catalog import lookup_model
from estimator.units import MAX_GPUS, MAX_RATE_BYTES_PER_S, MAX_SIZE_BYTES, parse_rate, parse_size
from scheduler.service.consumption import MAX_COUNTER
from scheduler.service.measured_params import MAX_BATCH_BYTES, MAX_STEP_S, MIN_STEP_S
from scheduler.service.types import MAX_LOADER_ITEM_BYTES, MAX_LOADER_WORKERS

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
URI_PATTERN = r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$"


def _as_size(value: Any) -> Any:
    if isinstance(value, (str, int, float)):
        return parse_size(value)  # rejects booleans too (lax float parsing would take True as 1)  # UnitError is a ValueError: pydantic reports it on the field
    return value


def _as_rate(value: Any) -> Any:
    if isinstance(value, (str, int, float)):
        return parse_rate(value)
    return value


_SIZE_SCHEMA = {
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SIZE_BYTES},
        {"type": "string", "pattern": r"^\s*[0-9]*\.?[0-9]+([eE][+-]?[0-9]+)?\s*[A-Za-z]*\s*$", "examples": ["143GB"]},
    ],
    "description": "bytes, as a number or with a unit: 143GB, 1.3TB, 512MiB; at most 1EB",
}
_RATE_SCHEMA = {
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_RATE_BYTES_PER_S},
        {"type": "string", "examples": ["114MB/s", "1Gbps"]},
    ],
    "description": "bytes/s, as a number or with a unit: 114MB/s, 1Gbps, 100MiB/s; at most 10TB/s",
}

# Bounds come from estimator.units, the one place the CLI, trace reader and data manager share.
Size = Annotated[float, BeforeValidator(_as_size), Field(gt=0, le=MAX_SIZE_BYTES), WithJsonSchema(_SIZE_SCHEMA)]
Rate = Annotated[float, BeforeValidator(_as_rate), Field(gt=0, le=MAX_RATE_BYTES_PER_S), WithJsonSchema(_RATE_SCHEMA)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]


def _no_dotdot(value: str) -> str:
    if ".." in value:
        raise ValueError("must not contain '..' (names become file and pod names)")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_field(cls, value: Any) -> Any:
        """Unknown fields are rejected at the first one: the others are dropped before pydantic
        sees them, so a body of many unknown keys makes one error, not one per key (issue 20:
        60,000 keys made 60,003 errors and seconds of CPU)."""
        if isinstance(value, dict):
            fields = cls.model_fields
            for key in value:
                if key not in fields:
                    return {key: value[key], **{k: v for k, v in value.items() if k in fields}}
        return value


class DatasetIn(_Strict):
    name: Name = Field(description="unique name; letters, digits, '.', '_', '-'", examples=["imagenet-1k"])
    # No pattern here: the URI policy (contract/uri_policy.py) refuses a local path or a URI
    # without a scheme with a 400 naming its rule, which a regex 422 did not.
    uri: str = Field(min_length=1, max_length=2048, examples=["s3://datasets/imagenet-1k"])
    size: Size
    item_count: int | None = Field(default=None, ge=1, le=2_000_000_000)
    credential: Name | None = Field(default=None, description="one of your credentials (POST /v1/credentials) the data path reads with")

    _names = field_validator("name")(_no_dotdot)


class DatasetOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    uri: str
    size: float
    item_count: int | None
    owner: str
    created_at: float
    key: str = Field(description="its name in the data manager and the cache")
    credential: str | None
    shared_with: list[str]
    cache_mode: str = Field("source", description="autocaching: preprocessed when the scheduler chose to cache its readers'"
                                                  " preprocessed data (their autocache point), else source")
    cache_expansion: float | None = Field(None, description="preprocessed: bytes cached per source byte")


def _access_shorthand(value: Any) -> Any:
    if isinstance(value, str):  # "access": "irregular" is short for {"kind": "irregular"}
        return {"kind": value}
    return value


class AccessIn(_Strict):
    """How the job reads its dataset (estimator/access.py). `epoch` (the default): every item once
    per epoch, uniformly; `curriculum`: the exponential pacing of Eq. 10 with the four
    parameters below; `irregular`: any other pattern. Non-epoch jobs are scheduled in the
    irregular partition of cache and remote IO."""

    kind: Literal["epoch", "curriculum", "irregular"] = "epoch"
    starting_percent: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False, description="curriculum: fraction of the items eligible at the start")
    alpha: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False, description="curriculum: growth factor of the eligible set (> 1)")
    step: int | None = Field(default=None, ge=1, le=2_000_000_000, description="curriculum: iterations between two growths")
    batch: int | None = Field(default=None, ge=1, le=2_000_000_000, description="curriculum: items read per iteration")

    @model_validator(mode="after")
    def _valid_pattern(self) -> AccessIn:
        self.pattern()  # the one set of rules, shared with the trace CSV
        return self

    def pattern(self) -> AccessPattern:
        try:
            return parse_access(self.kind, self.starting_percent, self.alpha, self.step, self.batch)
        except UserError as exc:
            raise ValueError(str(exc)) from None


class AccessOut(BaseModel):
    kind: str
    starting_percent: float | None = None
    alpha: float | None = None
    step: int | None = None
    batch: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_pattern(cls, value: Any) -> Any:
        if isinstance(value, AccessPattern):
            fields = value.fields()
            return {"kind": fields.pop("access"), **fields}
        return value


QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
Arg = Annotated[str, Field(max_length=4096)]


LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_./]*$")]
LabelValue = Annotated[str, Field(max_length=63, pattern=r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")]
ResourceName = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_./]*$")]
Quantity = Annotated[str, Field(max_length=32, pattern=QUANTITY_PATTERN)]


class TolerationIn(_Strict):
    """A pod spec's toleration (k8s.io/api/core/v1 Toleration)."""

    key: LabelKey | None = None
    operator: Literal["Equal", "Exists"] | None = None
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0, le=2**31, description="NoExecute only: how long")

    def to_k8s(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True, exclude={"toleration_seconds"})
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


class AffinityIn(_Strict):
    """A pod spec's affinity, passed to the API server as given (it validates the terms); silod
    honours nodeAffinity's required terms in placement and refuses terms no node matches."""

    node_affinity: dict[str, Any] | None = Field(default=None, description="Kubernetes' nodeAffinity, as it spells it")
    pod_affinity: dict[str, Any] | None = Field(default=None, description="Kubernetes' podAffinity")
    pod_anti_affinity: dict[str, Any] | None = Field(default=None, description="Kubernetes' podAntiAffinity")

    def to_k8s(self) -> dict[str, Any]:
        names = {"node_affinity": "nodeAffinity", "pod_affinity": "podAffinity", "pod_anti_affinity": "podAntiAffinity"}
        return {names[k]: v for k, v in self.model_dump(exclude_none=True).items()}


class ResourcesIn(_Strict):
    requests: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=16)


class PodTemplateIn(_Strict):
    """The pods of a job on Kubernetes (`--backend kubernetes`). Nothing here can grant privilege:
    silod writes the security context (Pod Security "restricted") and the dataset volume."""

    image: str = Field(min_length=1, max_length=512, pattern=r"^\S+$", examples=["ghcr.io/me/train:1.0"])
    command: list[Arg] = Field(default_factory=list, max_length=64)
    args: list[Arg] = Field(default_factory=list, max_length=256)
    env: dict[Annotated[str, Field(max_length=128, pattern=ENV_NAME_PATTERN)], Arg] = Field(default_factory=dict, max_length=64)
    cpu: str | None = Field(default=None, max_length=32, pattern=QUANTITY_PATTERN, examples=["4"])
    memory: str | None = Field(default=None, max_length=32, pattern=QUANTITY_PATTERN, examples=["16Gi"])
    pods: int = Field(default=1, ge=1, le=1024, description="pods of the job; gpus must split evenly over them")
    data_path: str = Field(default="/data", max_length=256, pattern=r"^/[A-Za-z0-9._/-]*$",
                           description="where the dataset is mounted (read-only) in the containers")
    run_as_user: int = Field(default=1000, ge=1, le=2_147_483_647, description="a non-root uid")
    tolerations: list[TolerationIn] = Field(default_factory=list, max_length=32,
                                            description="as a pod spec's tolerations (e.g. for GPU nodes' taints)")
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32,
                                                     description="as a pod spec's nodeSelector")
    affinity: AffinityIn | None = Field(default=None, description="as a pod spec's affinity (nodeAffinity,"
                                        " podAffinity, podAntiAffinity; the API server validates them)")
    resources: ResourcesIn | None = Field(default=None, description="requests and limits per resource (not"
                                          " nvidia.com/gpu: silod sets it from gpus / pods); cpu and memory above"
                                          " are shorthands for them")

    def to_template(self) -> Any:
        from scheduler.backends.kubernetes.workloads import PodTemplate

        return PodTemplate(image=self.image, command=tuple(self.command), args=tuple(self.args), env=dict(self.env),
                           cpu=self.cpu, memory=self.memory, pods=self.pods, data_path=self.data_path,
                           run_as_user=self.run_as_user,
                           tolerations=tuple(t.to_k8s() for t in self.tolerations),
                           node_selector=dict(self.node_selector) or None,
                           affinity=self.affinity.to_k8s() if self.affinity else None,
                           resources=self.resources.model_dump(exclude_none=True) if self.resources else None)


class ProgramIn(_Strict):
    """The local backend (`--backend local`): the training program a job runs instead of the
    built-in stand-in worker, in the worker's process group after the dataset is mounted. It gets
    SILOD_DATA (the mount), SILOD_JOB_ID, SILOD_SERVER and SILOD_TOKEN (the job's report token: it
    may post this job's step reports and nothing else) besides `env`. The job ends when the program exits (0: finished)."""

    command: list[Arg] = Field(min_length=1, max_length=256, examples=[["python", "train.py", "--epochs", "2"]])
    env: dict[Annotated[str, Field(max_length=128, pattern=ENV_NAME_PATTERN)], Arg] = Field(
        default_factory=dict, max_length=64, description="stored as given: no secrets (the job gets its own token)")

    @field_validator("env")
    @classmethod
    def _not_ours(cls, env: dict[str, str]) -> dict[str, str]:
        reserved = sorted(k for k in env if k.startswith("SILOD_"))
        if reserved:
            raise ValueError(f"{reserved[0]} is set by silod (SILOD_* names are reserved); rename it")
        return env

    def to_program(self) -> Any:
        from scheduler.service.types import JobProgram

        return JobProgram(tuple(self.command), tuple(sorted(self.env.items())))


class LoaderIn(_Strict):
    """The job's data loader (e.g. a torch DataLoader): with the mount's measured per-miss
    service time L, its miss term m = workers x item_bytes / L lowers the predicted throughput of
    a job whose misses its workers cannot hide (estimator.loader_perf)."""

    # strict: `true` and "4" are not worker counts
    workers: int = Field(ge=1, le=MAX_LOADER_WORKERS, strict=True,
                         description="the loader's worker processes (a DataLoader's num_workers; 1 for a loader"
                                     " that reads in the training process)")
    item_bytes: Annotated[float, BeforeValidator(_as_size), Field(gt=0, le=MAX_LOADER_ITEM_BYTES),
                          WithJsonSchema(_SIZE_SCHEMA)] | None = Field(
        default=None, description="one item's size (e.g. \"110KB\"); omitted: the mean size of the missed items"
                                  " the mount measures")

    def to_loader(self) -> Any:
        from scheduler.service.types import JobLoader

        return JobLoader(self.workers, self.item_bytes)


class LoaderOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    workers: int
    item_bytes: float | None = None


class JobIn(_Strict):
    name: Name = Field(examples=["resnet50-run1"])
    gpus: int = Field(ge=1, le=MAX_GPUS, description="GPUs the job needs (gang-scheduled)")
    dataset: Name = Field(description="a registered dataset")
    epochs: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False)
    steps: int | None = Field(default=None, ge=1, le=2_000_000_000, description="with step_bytes, instead of epochs")
    step_bytes: Size | None = Field(default=None, description="bytes read per step")
    ideal_throughput: Rate | None = Field(default=None, description="f*: bytes/s at `gpus` GPUs when IO is not the bottleneck")
    model: str | None = Field(default=None, min_length=1, max_length=64, description="catalog model, instead of ideal_throughput")
    priority: int = Field(default=0, ge=-1000, le=1000,
                          description="orders admission (higher first); above 0 only for the admin")
    dataset_owner: Name | None = Field(default=None, description="the tenant owning `dataset`, when it is shared with you")
    access: Annotated[AccessIn, BeforeValidator(_access_shorthand)] | None = Field(
        default=None, description='how the job reads: "epoch" (default), "irregular", or {"kind": "curriculum", ...}'
    )
    pod_template: PodTemplateIn | None = Field(default=None, description="Kubernetes: the pods to run (a Job is"
                                               " created in your namespace, suspended until admitted)")
    cpu_rate: Rate | None = Field(default=None, description="source bytes/s one CPU core preprocesses (decode, augment);"
                                  " null = not CPU-bound; omitted with a catalog `model`: the catalog's rate")
    autocache_expansion: float | None = Field(default=None, gt=0, le=MAX_EXPANSION, allow_inf_nan=False,
                                              description="preprocessed bytes per source byte at the job's autocache point")
    post_cpu_rate: Rate | None = Field(default=None, description="bytes/s per core of what remains after the autocache point")
    program: ProgramIn | None = Field(default=None, description="local backend: the command to run on the mounted"
                                      " dataset (default: the built-in stand-in that reads and sleeps)")
    loader: LoaderIn | None = Field(default=None, description="the job's data loader ({\"workers\": 4, \"item_bytes\":"
                                    " \"110KB\"}): adds its miss term to the job's predicted throughput once the"
                                    " mount has measured a miss; null: the paper's model")

    _names = field_validator("name", "dataset")(_no_dotdot)

    def pipeline(self) -> InputPipeline | None:
        """The job's CPU stage: as given, or the catalog model's when cpu_rate is not mentioned."""
        if "cpu_rate" not in self.model_fields_set and self.model is not None:
            try:
                return lookup_model(self.model).pipeline
            except UserError:
                return None  # an unknown model is reported by the catalogue, naming `model`
        return parse_pipeline(self.cpu_rate, self.autocache_expansion, self.post_cpu_rate)

    @model_validator(mode="after")
    def _pipeline(self) -> JobIn:
        try:
            parse_pipeline(self.cpu_rate, self.autocache_expansion, self.post_cpu_rate)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _work_and_speed(self) -> JobIn:
        has_steps = self.steps is not None or self.step_bytes is not None
        if self.epochs is None and not has_steps:
            raise ValueError("give epochs, or steps together with step_bytes")
        if self.epochs is not None and has_steps:
            raise ValueError("give either epochs or steps/step_bytes, not both")
        if has_steps and (self.steps is None or self.step_bytes is None):
            raise ValueError("steps and step_bytes go together")
        if self.ideal_throughput is None and self.model is None:
            raise ValueError("give ideal_throughput (e.g. \"114MB/s\") or a catalog model (e.g. \"resnet50\")")
        return self


class MeasuredOut(BaseModel):
    read_bytes: int
    hit_bytes: int
    miss_bytes: int
    hits: int
    misses: int
    miss_service_count: int = Field(0, description="misses its pods' mounts delivered whole")
    miss_service_us: int = Field(0, description="their summed service time, microseconds (open request to last byte)")
    miss_service_bytes: int = Field(0, description="their bytes")
    pods: int = Field(description="pods that reported")
    updated_at: float


#: Longest service time one miss may report (an hour, as the data manager caps a mount's).
MAX_MISS_SERVICE_US = 3600 * 10**6

# A pod's cumulative counter: at most 2^53 (9 PB; scheduler/service/consumption.py MAX_COUNTER).
_COUNT = Annotated[int, Field(ge=0, le=MAX_COUNTER)]


class PodConsumptionIn(_Strict):
    pod_uid: str = Field(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    read_bytes: _COUNT
    hit_bytes: _COUNT
    miss_bytes: _COUNT
    hits: _COUNT
    misses: _COUNT
    # Optional (agents before these counters send none): the pod's misses delivered whole, their
    # summed service time in microseconds and their bytes (fuse_client/accounting.PodCounters).
    miss_service_count: _COUNT = 0
    miss_service_us: _COUNT = 0
    miss_service_bytes: _COUNT = 0

    @model_validator(mode="after")
    def _sums(self) -> "PodConsumptionIn":
        if self.read_bytes != self.hit_bytes + self.miss_bytes:
            raise ValueError("read_bytes must equal hit_bytes + miss_bytes")
        if self.miss_service_count > self.misses or self.miss_service_bytes > self.miss_bytes:
            raise ValueError("miss_service_count and miss_service_bytes count misses delivered whole: at most misses"
                             " and miss_bytes")
        if self.miss_service_us > self.miss_service_count * MAX_MISS_SERVICE_US:
            raise ValueError(f"miss_service_us is more than {MAX_MISS_SERVICE_US} us (an hour) per miss served")
        if (self.miss_service_count == 0) != (self.miss_service_bytes == 0):
            raise ValueError("miss_service_count and miss_service_bytes are zero together (misses served have bytes)")
        return self


class ConsumptionIn(_Strict):
    """A node agent's cumulative per-pod counters (POST /v1/agents/{node}/consumption)."""

    pods: list[PodConsumptionIn] = Field(max_length=1000)
    cache_disk_bytes: _COUNT | None = Field(
        default=None, description="bytes the node's cache directory can hold (statvfs of it, capped by the agent's"
                                  " --cache-size): the Kubernetes backend plans the node's cache with it while fresh")


class IgnoredOut(BaseModel):
    pod_uid: str
    reason: str


class ConsumptionOut(BaseModel):
    accepted: int
    ignored: list[IgnoredOut]


class BottleneckOut(BaseModel):
    bound: Literal["gpu", "cpu", "cache", "remote_io"]
    throughput: float = Field(description="bytes/s the model predicts with the job's allocation while it runs")
    speedup_gpu: float
    speedup_cpu: float
    speedup_cache: float
    speedup_remote_io: float


class MeasuredParamsOut(BaseModel):
    declared_ideal_throughput: float = Field(description="f* the job declared, bytes/s")
    ideal_throughput: float = Field(description="f* planning uses now: measured once there is evidence, bytes/s")
    ideal_evidence_s: float = Field(description="seconds of GPU-bound intervals behind the measured f*")
    declared_cpu_rate: float | None
    cpu_rate: float | None = Field(description="per-core rate planning uses now, bytes/s; null: no CPU stage")
    cpu_evidence_s: float
    observed_throughput: float | None = Field(description="the data plane's last measured read rate, bytes/s")
    max_observed_throughput: float
    bound: str = Field(description="what held the job in its last measured interval: gpu | cpu | remote_io |"
                                   " unknown (a slow GPU and a slow pipeline look alike without a client report)")
    client_ideal_throughput: float | None = Field(description="batch bytes / step seconds of its latest client"
                                                              " report (at most 10 minutes old)")
    client_at: float | None
    updated_at: float | None
    miss_service_s: float | None = Field(None, description="the mount's mean per-miss service time, seconds: from a"
                                                          " missed item's open request to its last byte delivered")
    miss_item_bytes: float | None = Field(None, description="the mean size of those missed items, bytes")


class ClientReportIn(_Strict):
    """A training job's own figures (POST /v1/jobs/{id}/report): the time its GPUs spend per step,
    not counting waiting for input, and the source bytes one step consumes."""

    # strict: `true` and "0.5" are not numbers of seconds or bytes
    step_seconds: float = Field(ge=MIN_STEP_S, le=MAX_STEP_S, allow_inf_nan=False, strict=True,
                                description="compute time per step, seconds")
    batch_bytes: float = Field(ge=1, le=MAX_BATCH_BYTES, allow_inf_nan=False, strict=True,
                               description="source bytes one step consumes")

    @model_validator(mode="after")
    def _rate_in_range(self) -> ClientReportIn:
        # Each figure alone may be in range and their ratio (the rate stored as the job's
        # client_ideal_throughput) not: 2^50 bytes per 0.1 ms is 1e19 B/s.
        rate = self.batch_bytes / self.step_seconds
        if rate > MAX_RATE_BYTES_PER_S:
            raise ValueError(f"batch_bytes / step_seconds = {rate:.3g} B/s is above {MAX_RATE_BYTES_PER_S:.0e} B/s "
                             "(10 TB/s); check that step_seconds is in seconds and batch_bytes in bytes")
        return self


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    owner: str
    gpus: int
    dataset: str
    dataset_owner: str
    model: str | None
    ideal_throughput: float
    epochs: float | None
    steps: int | None
    step_bytes: float | None
    total_bytes: float
    consumed_bytes: float
    remaining_bytes: float
    priority: int
    state: str = Field(description="queued | running | finished | failed | cancelled")
    submit_time: float
    start_time: float | None
    finish_time: float | None
    message: str
    allocated_gpus: int
    gpu_share: float
    remote_io: float | None
    access: AccessOut
    cpu_rate: float | None = Field(None, description="source bytes/s per core; null = not CPU-bound")
    autocache_expansion: float | None = None
    post_cpu_rate: float | None = None
    allocated_cpus: float | None = Field(None, description="CPU cores while running; null = the cluster does not model CPU")
    bottleneck: BottleneckOut | None = Field(
        None, description="GET /v1/jobs/{id} of a running job: the resource that bounds it and the predicted speed-up"
                          " of one more GPU, one more core, +10% cache, +10% remote IO")
    cache_mode: str | None = Field(None, description="GET /v1/jobs/{id} only: what its dataset's cache holds, source or"
                                                      " preprocessed (autocaching)")
    cache_expansion: float | None = Field(None, description="GET /v1/jobs/{id} only, preprocessed: bytes cached per source byte")
    measured_parameters: MeasuredParamsOut | None = Field(
        None, description="declared vs measured f* and per-core rate (null until measured or reported)")
    last_bound: str | None = Field(
        None, description="the model's bound (gpu | cpu | cache | remote_io) as of the last round the job ran in: what"
                          " bound an ended job; null = never diagnosed (it never ran)")
    last_predicted_throughput: float | None = Field(
        None, description="the model's predicted throughput, bytes/s, with that diagnosis")
    last_bound_at: float | None = Field(None, description="when that diagnosis was stored (the round's time)")
    measured: MeasuredOut | None = Field(
        None, description="GET /v1/jobs/{id} only: what the node agents measured the job's pods read (null: no"
                          " report yet, or not a Kubernetes job)")
    loader: LoaderOut | None = Field(None, description="the job's data loader as declared; null: not declared")


class UsageOut(BaseModel):
    total: float
    used: float


class NodeOut(BaseModel):
    name: str
    gpus: int
    cache: float
    labels: dict[str, str]
    cache_source: Literal["agent", "annotation", "share"] | None = Field(
        default=None, description="Kubernetes: where `cache` comes from: the node agent's report (fresh), the node's"
                                  " silod.io/cache-capacity annotation, or an even share of --cache")


class ClusterOut(BaseModel):
    backend: str
    nodes: list[NodeOut]
    gpus: UsageOut
    cache: UsageOut
    remote_io: UsageOut
    jobs: dict[str, int]
    datamanager: str | None
    last_round_time: float | None
    last_push_error: str | None


class JobAllocationOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    job_id: str
    owner: str
    gpus: int
    gpu_share: float
    running: bool
    remote_io: float | None


class CacheAllocationOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    dataset: str
    owner: str
    key: str
    bytes: float
    size: float


class AllocationsOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    round_id: int | None
    time: float | None
    policy: str
    jobs: list[JobAllocationOut]
    cache: list[CacheAllocationOut]


class ChangeOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    round_id: int | None
    time: float
    subject_kind: str
    subject: str
    resource: str
    old_value: float | None
    new_value: float | None


class PolicyIn(_Strict):
    name: str = Field(min_length=1, max_length=64)


class PolicyOut(BaseModel):
    name: str
    available: list[str]


class RoundOut(BaseModel):
    round_id: int
    reason: str
    active: int
    running: list[str]
    started: list[str]
    stopped: list[str]
    changes: int
    duration_s: float


class ErrorOut(BaseModel):
    detail: str
    field: str | None = None


class HealthOut(BaseModel):
    status: str
    database: str


class ReadyOut(BaseModel):
    status: str = Field(description="ready | not ready")
    scheduling: str = Field(description="ok, or why no process schedules")


class TokenIn(_Strict):
    owner: str = Field(min_length=1, max_length=64, pattern=NAME_PATTERN, description="the tenant the token acts for")
    admin: bool = False
    expires_in_s: float | None = Field(default=None, gt=0, le=10 * 365 * 86400, allow_inf_nan=False)
    label: str = Field(default="", max_length=128)


class TokenOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    owner: str
    is_admin: bool
    label: str
    source: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


class NewTokenOut(TokenOut):
    token: str = Field(description="shown once; only its HMAC is stored")


class QuotaIn(_Strict):
    gpus: int | None = Field(default=None, ge=0, le=100_000)
    cache_bytes: Size | None = None
    running_jobs: int | None = Field(default=None, ge=0, le=10_000_000)
    queued_jobs: int | None = Field(default=None, ge=0, le=10_000_000)
    ideal_per_gpu: Rate | None = Field(default=None, description="the most f* per GPU a job may declare;"
                                       " null: the service's default")
    min_work: Size | None = Field(default=None, description="the least work (bytes: epochs x dataset size, or"
                                  " steps x step_bytes) a job may declare; null: the service's default")
    max_work: Size | None = Field(default=None, description="the most work (bytes) a job may declare; null: the"
                                  " service's default")

    @model_validator(mode="after")
    def _work_range(self) -> "QuotaIn":
        if self.min_work is not None and self.max_work is not None and self.min_work > self.max_work:
            raise ValueError("min_work is above max_work; give min_work <= max_work")
        return self


class QuotaOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    tenant: str
    gpus: int | None
    cache_bytes: float | None
    running_jobs: int | None
    queued_jobs: int | None
    ideal_per_gpu: float | None = None
    min_work: float | None = None
    max_work: float | None = None


class CredentialIn(_Strict):
    name: Name
    kind: str = Field(default="s3", max_length=16)
    # Printable ASCII: the keys reach the job as environment variables and HTTP headers, where a
    # NUL or a line break fails the job's start (or splits a header), long after the 201.
    access_key_id: str = Field(min_length=1, max_length=256, pattern=r"^[\x20-\x7e]+$")
    secret_access_key: str = Field(min_length=1, max_length=1024, pattern=r"^[\x20-\x7e]+$")
    endpoint_url: str | None = Field(default=None, max_length=2048, pattern=URI_PATTERN)
    region: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9-]+$")

    _names = field_validator("name")(_no_dotdot)


class CredentialOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    owner: str
    kind: str
    access_key_id: str
    endpoint_url: str | None
    region: str | None
    created_at: float
