"""Alibaba's 2023 GPU cluster trace "openb" (`silod trace fetch alibaba-openb`, `--format alibaba-openb`).

One row per task (pod): `name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, qos,
pod_phase, creation_time, deletion_time, scheduled_time`. The trace names no model or dataset, so,
as for the Philly traces (traces/gavel_trace.py) and as the SiloD paper does with its production
trace, tasks are mapped to the catalog:

- Only tasks that ask for GPUs and ran: CPU-only tasks (num_gpu 0) and tasks never scheduled
  (Pending, no scheduled_time) are left out and counted in the trace's notes.
- GPUs: num_gpu; a fraction of one GPU (gpu_milli < 1000, GPU sharing) counts as one GPU,
  because silod schedules whole GPUs.
- Arrival: creation_time. Duration at ideal speed: deletion_time - scheduled_time (tasks still
  running at the trace's end are cut there, as the trace is).
- Model: drawn per task, with the seed, from the synthetic traces' mix (traces/synthetic.py,
  the SiloD paper's models); f* = the model's per-V100 rate x GPUs; dataset: the model's, one
  copy per job unless `dataset_sharing` > 0 (that fraction, drawn with the seed, shares it).
- CPU: the task's own request. A task asks for the cores it needs to keep its GPUs fed, so its
  cpu_rate is f* / (cpu_milli / 1000): on its requested cores it runs at f*, on fewer it is
  CPU-bound (estimator/pipeline.py). With `--cpus-per-node` the cluster's cores then matter.

The cluster itself (openb_node_list_gpu_node.csv) has 64 or 96 cores per node and 1 to 8
GPUs; `node_summary` reads it for the experiment's cluster.
"""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from pathlib import Path

import numpy as np

from estimator.errors import UserError
from estimator.pipeline import InputPipeline
from estimator.units import MAX_GPUS
from traces.catalog import DATASETS, MODELS
from traces.model import MAX_SUBMIT_S, Trace, TraceJob
from traces.public import default_fetch_dir
from traces.synthetic import MODEL_MIX

COLUMNS = ("name", "cpu_milli", "num_gpu", "gpu_milli", "pod_phase", "creation_time", "deletion_time", "scheduled_time")


class AlibabaTraceError(UserError):
    pass


def _number(row: dict, column: str, path: Path, line: int, *, allow_empty: bool = False) -> float | None:
    text = (row.get(column) or "").strip()
    if not text:
        if allow_empty:
            return None
        raise AlibabaTraceError(f"{path}, line {line}, column {column!r}: empty; the openb trace gives a number here")
    try:
        value = float(text)
    except ValueError:
        raise AlibabaTraceError(f"{path}, line {line}, column {column!r}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise AlibabaTraceError(f"{path}, line {line}, column {column!r}: {text!r} must be a finite number >= 0")
    return value


def load_alibaba_trace(path: str | Path, *, dataset_sharing: float = 0.0, max_jobs: int | None = None, seed: int = 0,
                       window_s: tuple[float, float] | None = None) -> Trace:
    """`window_s` = (start, end): only tasks created in [start, end) seconds of the trace, their
    arrivals shifted so the window starts at 0 (models are still drawn for every row, so a task
    maps to the same model whatever the window)."""
    path = Path(path)
    if window_s is not None and not (0 <= window_s[0] < window_s[1]):
        raise AlibabaTraceError(f"window {window_s!r} must be (start, end) seconds with 0 <= start < end")
    if path.is_dir():
        path = path / "openb_pod_list_default.csv"
    if not path.is_file():
        raise AlibabaTraceError(f"Alibaba openb trace {path} does not exist; silod does not ship it: `silod trace fetch alibaba-openb` "
                                f"downloads it (into {default_fetch_dir('alibaba-openb')}); pass that folder or its "
                                "openb_pod_list_default.csv as --trace")
    if not 0.0 <= dataset_sharing <= 1.0:
        raise AlibabaTraceError(f"--dataset-sharing {dataset_sharing} must be a fraction between 0 and 1")
    rng = np.random.default_rng(seed)
    names = list(MODEL_MIX)
    probs = np.array([MODEL_MIX[n] for n in names])
    jobs: list[TraceJob] = []
    sizes: dict[str, float] = {}
    skipped: Counter = Counter()
    try:
        # Decoded whole, here, so that a byte that is not UTF-8 is reported with the file's name.
        handle = io.StringIO(path.read_bytes().decode("utf-8"), newline="")
    except UnicodeDecodeError as exc:
        raise AlibabaTraceError(f"Alibaba openb trace {path} is not UTF-8 text (byte {exc.start}); give openb_pod_list_default.csv "
                                "as published") from None
    except OSError as exc:
        raise AlibabaTraceError(f"Alibaba openb trace {path} cannot be read: {exc.strerror}") from None
    seen: dict[str, int] = {}
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise AlibabaTraceError(f"{path}: missing column(s) {', '.join(missing)}; is this openb_pod_list_default.csv "
                                    "(--format alibaba-openb)?")
        for row in reader:
            line = reader.line_num
            if None in row or None in row.values():
                # DictReader fills a short row with None (it was read as "never scheduled" and skipped
                # without a word) and files a long row's extra fields under the key None.
                fields = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or ())
                raise AlibabaTraceError(f"{path}, line {line}: {fields} fields, but the header has {len(reader.fieldnames)}; "
                                        "is the file cut short or damaged?")
            gpus = _number(row, "num_gpu", path, line)
            # Draw for every row, so a task's model does not depend on which rows were skipped.
            model = names[int(rng.choice(len(names), p=probs))]
            shared = rng.random() < dataset_sharing
            if gpus < 1:
                skipped["CPU-only"] += 1
                continue
            scheduled = _number(row, "scheduled_time", path, line, allow_empty=True)
            if scheduled is None:
                skipped["never scheduled"] += 1
                continue
            created = _number(row, "creation_time", path, line)
            if created > MAX_SUBMIT_S:
                raise AlibabaTraceError(f"{path}, line {line}, column 'creation_time': {created:g} s is after the simulator's horizon "
                                        f"({MAX_SUBMIT_S:.3g} s, ten years); the openb trace gives seconds from its start")
            if window_s is not None:
                if not window_s[0] <= created < window_s[1]:
                    skipped["outside the window"] += 1
                    continue
                created -= window_s[0]
            duration = _number(row, "deletion_time", path, line) - scheduled
            if duration <= 0:
                skipped["zero duration"] += 1
                continue
            n_gpus = int(gpus)
            if n_gpus != gpus or n_gpus > MAX_GPUS:
                raise AlibabaTraceError(f"{path}, line {line}, column 'num_gpu': {gpus!r} is not a GPU count")
            spec = MODELS[model]
            rate = spec.ideal_per_gpu * n_gpus
            job_id = (row.get("name") or "").strip() or f"openb-{line}"
            if job_id in seen:  # two jobs with one id crashed the simulator (KeyError)
                raise AlibabaTraceError(f"{path}, line {line}, column 'name': task {job_id!r} is also on line {seen[job_id]}; "
                                        "every task needs its own name")
            seen[job_id] = line
            dataset = spec.dataset if shared else f"{spec.dataset}/{job_id}"
            size = DATASETS[spec.dataset].size
            sizes[dataset] = size
            cores = (_number(row, "cpu_milli", path, line) or 0.0) / 1000.0
            try:
                pipeline = InputPipeline(rate / cores) if cores > 0 else None
            except UserError:  # a request so small that f* per core is no rate (inf)
                raise AlibabaTraceError(f"{path}, line {line}, column 'cpu_milli': {cores * 1000:g} is too small a CPU request for a "
                                        "task that uses GPUs; the openb trace gives thousandths of a core (e.g. 12000)") from None
            jobs.append(TraceJob(job_id, created, n_gpus, spec.name, dataset, rate, duration * rate / size, pipeline=pipeline))
    if not jobs:
        raise AlibabaTraceError(f"{path}: no GPU task that ran{' in the window' if window_s else ''}; nothing to simulate")
    jobs.sort(key=lambda j: (j.submit_time, j.job_id))
    if max_jobs is not None:
        jobs = jobs[:max_jobs]
        sizes = {j.dataset: sizes[j.dataset] for j in jobs}
    notes = tuple(f"left out {n} {why} task(s)" for why, n in sorted(skipped.items()))
    window = "" if window_s is None else f", tasks created in [{window_s[0]:g}, {window_s[1]:g}) s"
    return Trace(tuple(jobs), sizes, source=f"{path} (alibaba-openb, seed {seed}{window})", notes=notes)


def node_summary(path: str | Path) -> dict:
    """GPUs, GPU nodes and cores of the openb cluster (openb_node_list_gpu_node.csv)."""
    path = Path(path)
    if path.is_dir():
        path = path / "openb_node_list_gpu_node.csv"
    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    gpus = sum(int(r["gpu"]) for r in rows)
    cores = sum(float(r["cpu_milli"]) for r in rows) / 1000.0
    return {"nodes": len(rows), "gpus": gpus, "cores": cores, "cores_per_gpu": cores / gpus if gpus else float("nan")}


__all__ = ["AlibabaTraceError", "load_alibaba_trace", "node_summary"]
