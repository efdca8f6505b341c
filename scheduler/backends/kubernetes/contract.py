"""The pod label/annotation contract between users, the silod scheduler and the data plane.

Users (or their Job/JobSet templates) describe a training job on its pods; the scheduler writes
its decisions back onto the same pods. Kubernetes keeps pod annotations reliably, so they are
the scheduler's durable state (SiloD §6, "Fault tolerance"): after a restart the scheduler, the
data manager and every FUSE client rebuild their view from them. Names and units are documented
in docs/kubernetes.md; keep them stable (they are a user-facing contract).

Everything here is pure (no API calls) so that the codec can be tested on its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from estimator.errors import UserError
from estimator.units import UnitError, parse_rate, parse_size

PREFIX = "silod.io/"
SCHEDULER_NAME = "silod"
GPU_RESOURCE = "nvidia.com/gpu"

# --- written by users (label + annotations on every pod of the job) -------------------------
LABEL_JOB = PREFIX + "job"  # label: job id; pods sharing it (in one namespace) are one gang
ANN_PODS = PREFIX + "pods"  # number of pods in the gang (default 1); binding waits for all
ANN_DATASET = PREFIX + "dataset"  # dataset name; jobs naming the same dataset share its cache
ANN_DATASET_SIZE = PREFIX + "dataset-size"  # e.g. 143GB; optional for catalog datasets
ANN_DATASET_URI = PREFIX + "dataset-uri"  # e.g. s3://bucket/imagenet (for the FUSE mount)
ANN_GPUS = PREFIX + "gpus"  # total GPUs of the job; checked against / replaces pod requests
ANN_IDEAL = PREFIX + "ideal-throughput"  # f* at the job's GPUs, e.g. 912MB/s
ANN_MODEL = PREFIX + "model"  # catalog model name; f* = per-GPU catalog value x GPUs
ANN_EPOCHS = PREFIX + "epochs"  # passes over the dataset (float > 0)
ANN_PRIORITY = PREFIX + "priority"  # integer, default 0

# --- written by the scheduler (durable state; identical on every pod of a job except IO) -----
ANN_NODE = PREFIX + "node"  # node chosen for this pod; written *before* the binding (intent log)
ANN_CACHE = PREFIX + "cache-bytes"  # cache of the job's dataset, bytes (same on all pods)
ANN_IO = PREFIX + "remote-io-bytes-per-s"  # this pod's share of the job's remote IO
ANN_JOB_IO = PREFIX + "job-remote-io-bytes-per-s"  # the whole job's remote IO (for recovery)
ANN_SCHEDULED_AT = PREFIX + "scheduled-at"  # unix seconds when the gang was placed
ANN_CONSUMED = PREFIX + "consumed-bytes"  # optional, written by the data plane: progress

# --- on nodes (optional) ---------------------------------------------------------------------
NODE_ANN_CACHE = PREFIX + "cache-capacity"  # local disk this node gives to the dataset cache
NODE_ANN_GPUS = PREFIX + "gpus"  # GPU count for nodes without the NVIDIA device plugin

USER_ANNOTATIONS = (ANN_PODS, ANN_DATASET, ANN_DATASET_SIZE, ANN_DATASET_URI, ANN_GPUS, ANN_IDEAL,
                    ANN_MODEL, ANN_EPOCHS, ANN_PRIORITY)
SCHEDULER_ANNOTATIONS = (ANN_NODE, ANN_CACHE, ANN_IO, ANN_JOB_IO, ANN_SCHEDULED_AT)

_INT_RE = re.compile(r"^\s*\+?[0-9]+\s*$")


class AnnotationError(UserError):
    """A pod annotation or resource request that cannot be understood. The pod stays pending and
    the message (naming the pod, the key and the fix) becomes a Kubernetes Warning Event."""


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What the user asked for, read from the annotations of one pod of the job."""

    pods: int
    dataset: str
    dataset_size: float | None  # bytes; None = from the catalog
    dataset_uri: str
    gpus: int | None  # total; None = sum of the pods' nvidia.com/gpu requests
    ideal_throughput: float | None  # bytes/s; None = from the model catalog
    model: str | None
    epochs: float
    priority: int


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """What the scheduler wrote on one pod (None when not written yet)."""

    node: str | None
    cache_bytes: float | None
    remote_io: float | None  # this pod's share
    job_remote_io: float | None
    scheduled_at: float | None
    consumed_bytes: float | None


def _where(pod: str, key: str, value: str) -> str:
    return f"pod {pod}: annotation {key}={value!r}"


def parse_count(value: str, what: str, *, minimum: int = 0) -> int:
    """A non-negative integer (GPU counts, pod counts). AnnotationError otherwise."""
    if not _INT_RE.match(value):
        raise AnnotationError(f"{what} is not a whole number; write e.g. 1, 2 or 8")
    n = int(value)
    if n < minimum:
        raise AnnotationError(f"{what} must be >= {minimum}")
    return n


def parse_gpu_quantity(value: str, what: str) -> int:
    """A Kubernetes quantity for an extended resource: a whole number ("2"; "2000m" is also 2)."""
    text = str(value).strip()
    if text.endswith("m") and _INT_RE.match(text[:-1]):
        milli = int(text[:-1])
        if milli % 1000:
            raise AnnotationError(f"{what} = {text!r}: GPUs are whole devices")
        return milli // 1000
    return parse_count(text, f"{what} = {text!r}")


def _float(value: str, what: str, *, positive: bool) -> float:
    try:
        x = float(value)
    except ValueError:
        raise AnnotationError(f"{what} is not a number") from None
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise AnnotationError(f"{what} must be a finite number {'>' if positive else '>='} 0")
    return x


def parse_job_request(pod: str, annotations: Mapping[str, str]) -> JobRequest:
    """Read the user's annotations of one pod. Raises AnnotationError with one clear message."""
    a = dict(annotations or {})

    def get(key: str) -> str | None:
        v = a.get(key)
        return None if v is None or str(v).strip() == "" else str(v).strip()

    pods = 1
    if (v := get(ANN_PODS)) is not None:
        pods = parse_count(v, _where(pod, ANN_PODS, v), minimum=1)
    dataset = get(ANN_DATASET)
    if dataset is None:
        raise AnnotationError(f"pod {pod}: missing annotation {ANN_DATASET}; name the dataset the job reads")
    size = None
    if (v := get(ANN_DATASET_SIZE)) is not None:
        try:
            size = parse_size(v, f"pod {pod}: annotation {ANN_DATASET_SIZE}")
        except UnitError as exc:
            raise AnnotationError(str(exc)) from None
        if size <= 0:
            raise AnnotationError(f"{_where(pod, ANN_DATASET_SIZE, v)} must be > 0")
    gpus = None
    if (v := get(ANN_GPUS)) is not None:
        gpus = parse_count(v, _where(pod, ANN_GPUS, v), minimum=1)
    ideal = None
    if (v := get(ANN_IDEAL)) is not None:
        try:
            ideal = parse_rate(v, f"pod {pod}: annotation {ANN_IDEAL}")
        except UnitError as exc:
            raise AnnotationError(str(exc)) from None
        if ideal <= 0:
            raise AnnotationError(f"{_where(pod, ANN_IDEAL, v)} must be > 0")
    model = get(ANN_MODEL)
    if ideal is None and model is None:
        raise AnnotationError(
            f"pod {pod}: give {ANN_IDEAL} (e.g. 912MB/s, f* at the job's GPUs) or a catalog {ANN_MODEL}"
        )
    v = get(ANN_EPOCHS)
    if v is None:
        raise AnnotationError(f"pod {pod}: missing annotation {ANN_EPOCHS}; passes over the dataset, e.g. 3")
    epochs = _float(v, _where(pod, ANN_EPOCHS, v), positive=True)
    priority = 0
    if (v := get(ANN_PRIORITY)) is not None:
        try:
            priority = int(v)
        except ValueError:
            raise AnnotationError(f"{_where(pod, ANN_PRIORITY, v)} is not an integer") from None
    return JobRequest(
        pods=pods, dataset=dataset, dataset_size=size, dataset_uri=get(ANN_DATASET_URI) or "",
        gpus=gpus, ideal_throughput=ideal, model=model, epochs=epochs, priority=priority,
    )


def parse_scheduler_state(pod: str, annotations: Mapping[str, str]) -> SchedulerState:
    """Read what the scheduler wrote earlier. Values the scheduler writes are plain numbers; a
    corrupted one (hand-edited) raises AnnotationError rather than being silently reset."""
    a = dict(annotations or {})

    def num(key: str) -> float | None:
        v = a.get(key)
        if v is None or str(v).strip() == "":
            return None
        return _float(str(v), _where(pod, key, str(v)), positive=False)

    node = a.get(ANN_NODE) or None
    return SchedulerState(
        node=node, cache_bytes=num(ANN_CACHE), remote_io=num(ANN_IO), job_remote_io=num(ANN_JOB_IO),
        scheduled_at=num(ANN_SCHEDULED_AT), consumed_bytes=num(ANN_CONSUMED),
    )


def encode_number(x: float) -> str:
    """Scheduler-written values: whole bytes or bytes/s as a plain decimal integer string."""
    return str(int(round(x))) if math.isfinite(x) else "0"


def allocation_annotations(*, node: str | None, cache_bytes: float | None, pod_io: float | None,
                           job_io: float | None, scheduled_at: float | None) -> dict[str, str | None]:
    """The annotation patch for one pod. None values delete the key (merge-patch semantics)."""
    return {
        ANN_NODE: node,
        ANN_CACHE: None if cache_bytes is None else encode_number(cache_bytes),
        ANN_IO: None if pod_io is None else encode_number(pod_io),
        ANN_JOB_IO: None if job_io is None else encode_number(job_io),
        ANN_SCHEDULED_AT: None if scheduled_at is None else f"{scheduled_at:.3f}",
    }
