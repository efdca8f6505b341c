"""The silod trace CSV (docs/simulator.md, "Trace formats").

    job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs

`duration` (seconds at ideal speed) may replace `epochs`; empty dataset_size and
ideal_throughput are filled from the catalog. Optional columns `access` (epoch | curriculum |
irregular) and, for curriculum, `starting_percent`, `alpha`, `step`, `batch` say how the job
reads (estimator/access.py); without them every job is `epoch`. Optional `item_size` (bytes per
item of the row's dataset) lets the simulator count a curriculum job's items and iterations;
catalog datasets have one. Optional input-pipeline columns `cpu_rate` (source bytes/s one core
preprocesses; empty = not CPU-bound), `autocache_expansion` and `post_cpu_rate` (the autocache
point: preprocessed bytes per source byte, and the per-core rate after it), estimator/pipeline.py.
Optional loader columns `loader_workers`, `loader_item_bytes`, `loader_miss_s` (all three or
none): the job's data loader and its misses' service time, m = W s / L (policies/loader.py).
An empty cpu_rate means not CPU-bound; the catalog's per-model rates (traces/catalog.py) are
not filled in here, because an empty cell has to keep that meaning. Every problem is reported with file, line and
column, and what to write instead.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import TextIO

from estimator.access import CURRICULUM_FIELDS, EPOCH, parse_access
from estimator.errors import UserError, did_you_mean
from estimator.model import MAX_LOADER_ITEM_BYTES, MAX_LOADER_MISS_S, MAX_LOADER_WORKERS
from estimator.model import loader_miss_rate as model_loader_miss_rate
from estimator.pipeline import PIPELINE_FIELDS, parse_pipeline
from estimator.units import MAX_GPUS, UnitError, parse_rate, parse_size
from traces.catalog import DATASETS, MODELS, lookup_model
from traces.model import MAX_SUBMIT_S, Trace, TraceJob
from traces.public import where_to_get

REQUIRED = ("job_id", "submit_time", "num_gpus", "model", "dataset", "dataset_size", "ideal_throughput")
COLUMNS = (*REQUIRED, "epochs")
ACCESS_COLUMNS = ("access", *CURRICULUM_FIELDS)  # optional; see estimator/access.py
ITEM_SIZE = "item_size"  # optional: bytes per item of the row's dataset
# Every column the reader knows. Any other column is an error: a misspelled optional column
# (`acess`) would otherwise be ignored and the run would silently use the default.
#: Optional, all three or none: the job's data loader (W worker processes, s-byte items) and the
#: seconds L a miss holds a worker; the job's loader miss rate is m = W s / L (TraceJob.loader_miss_rate).
LOADER_COLUMNS = ("loader_workers", "loader_item_bytes", "loader_miss_s")
KNOWN_COLUMNS = (*COLUMNS, "duration", *ACCESS_COLUMNS, ITEM_SIZE, *PIPELINE_FIELDS, *LOADER_COLUMNS)
MAX_GPUS_PER_JOB = MAX_GPUS
#: The REST API's bound too (POST /v1/jobs): beyond it a job's bytes overflow the float counts.
MAX_EPOCHS = 1e6


class TraceError(UserError):
    pass


def _fail(path: Path, line: int, column: str | None, problem: str) -> TraceError:
    where = f"{path}, line {line}" + (f", column {column!r}" if column else "")
    return TraceError(f"{where}: {problem}")


def _number(text: str, path: Path, line: int, column: str, *, integer: bool = False) -> float:
    try:
        if not text.isascii():  # int() and float() read any script's digits: '٣' would be 3
            raise ValueError(text)
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "a whole number" if integer else "a number"
        raise _fail(path, line, column, f"{text!r} is not {kind}") from None
    if not math.isfinite(value):
        raise _fail(path, line, column, f"{text!r} is not a finite number")
    return value


def load_csv_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        # utf-8-sig: spreadsheet programs write a byte-order mark, which is not part of the header
        handle = path.open(newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError(f"trace file {path} does not exist; {where_to_get()}") from None
    except IsADirectoryError:
        raise TraceError(f"trace {path} is a directory; give a CSV file") from None
    except PermissionError:
        raise TraceError(f"trace file {path} cannot be read (permission denied)") from None
    try:
        with handle:
            return _read_rows(path, handle)
    except UnicodeDecodeError as exc:
        raise TraceError(f"trace file {path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}); "
                         f"give a CSV file with the header {','.join(COLUMNS)}") from None
    except csv.Error as exc:
        raise TraceError(f"trace file {path} is not a readable CSV file ({exc}); give a CSV file with the header {','.join(COLUMNS)}") from None


def _read_rows(path: Path, handle: TextIO) -> Trace:
    reader = csv.DictReader(handle)
    header = reader.fieldnames
    if not header:
        raise TraceError(f"{path}: the file is empty; it needs the header line {','.join(COLUMNS)} and one row per job")
    header = [h.strip() for h in header]
    reader.fieldnames = header
    twice = [c for i, c in enumerate(header) if c in header[:i]]
    if twice:
        # csv.DictReader keeps the last of two same-named columns: the first would be ignored.
        raise _fail(path, 1, twice[0], "appears twice in the header; give each column once")
    missing = [c for c in REQUIRED if c not in header]
    if "epochs" not in header and "duration" not in header:
        missing.append("epochs (or duration)")
    if missing:
        raise _fail(path, 1, None, f"missing column(s) {', '.join(missing)}; the header must be {','.join(COLUMNS)}")
    unknown = [c for c in header if c not in KNOWN_COLUMNS]
    if unknown:
        c = unknown[0]
        raise _fail(path, 1, c, f"unknown column{did_you_mean(c, KNOWN_COLUMNS)}; the columns are "
                                f"{', '.join(KNOWN_COLUMNS)} (docs/simulator.md, \"Trace formats\")")
    jobs: list[TraceJob] = []
    sizes: dict[str, float] = {}
    item_sizes: dict[str, float] = {}
    seen_ids: set[str] = set()
    for row in reader:
        line = reader.line_num
        if None in row:
            raise _fail(path, line, None, f"more fields than the {len(header)} columns of the header")
        if all(not (v or "").strip() for v in row.values()):
            continue
        job = _parse_row(row, path, line, sizes, seen_ids)
        _item_size(row.get(ITEM_SIZE), job.dataset, sizes[job.dataset], path, line, item_sizes)
        jobs.append(job)
    if not jobs:
        raise TraceError(f"{path}: no jobs; add at least one row after the header")
    jobs.sort(key=lambda j: (j.submit_time, j.job_id))
    return Trace(tuple(jobs), sizes, source=str(path), item_sizes=item_sizes)


def _item_size(text: str | None, dataset: str, dataset_size: float, path: Path, line: int, known: dict[str, float]) -> None:
    text = (text or "").strip()
    if not text:
        return
    try:
        size = parse_size(text, ITEM_SIZE)
    except UnitError as exc:
        raise _fail(path, line, ITEM_SIZE, str(exc)) from None
    if not 0 < size <= dataset_size:
        raise _fail(path, line, ITEM_SIZE, f"{size:.0f} B must be > 0 and at most the dataset's {dataset_size:.0f} B (bytes per item, e.g. 110KB)")
    if dataset in known and not math.isclose(known[dataset], size, rel_tol=1e-9):
        raise _fail(path, line, ITEM_SIZE, f"dataset {dataset!r} was given item size {known[dataset]:.0f} B on an earlier line; one dataset has one item size")
    known[dataset] = size


def _parse_row(row: dict[str, str], path: Path, line: int, sizes: dict[str, float], seen: set[str]) -> TraceJob:
    get = {k: (v or "").strip() for k, v in row.items()}
    job_id = get["job_id"]
    if not job_id:
        raise _fail(path, line, "job_id", "empty; every job needs an id")
    if job_id in seen:
        raise _fail(path, line, "job_id", f"duplicate job id {job_id!r}")
    seen.add(job_id)
    submit = _number(get["submit_time"], path, line, "submit_time")
    if submit < 0:
        raise _fail(path, line, "submit_time", f"{submit} is negative; use seconds from the trace start (>= 0)")
    if submit > MAX_SUBMIT_S:
        raise _fail(path, line, "submit_time", f"{submit:g} s is after the simulator's horizon ({MAX_SUBMIT_S:.3g} s, ten years); "
                                               "use seconds from the trace start (not a Unix timestamp or milliseconds)")
    gpus = int(_number(get["num_gpus"], path, line, "num_gpus", integer=True))
    if not 1 <= gpus <= MAX_GPUS_PER_JOB:
        raise _fail(path, line, "num_gpus", f"{gpus} is not a GPU count; use an integer between 1 and {MAX_GPUS_PER_JOB:,}")
    model, dataset = get["model"], get["dataset"]
    if not dataset:
        raise _fail(path, line, "dataset", "empty; name the dataset the job reads")
    size = _size(get["dataset_size"], dataset, path, line)
    if size < 1:
        raise _fail(path, line, "dataset_size", f"{size:g} B; a dataset is at least 1 byte (e.g. 143GB)")
    if dataset in sizes and not math.isclose(sizes[dataset], size, rel_tol=1e-9):
        raise _fail(path, line, "dataset_size", f"dataset {dataset!r} was given size {sizes[dataset]:.0f} B on an earlier line; one dataset has one size")
    sizes[dataset] = size
    ideal = _ideal(get["ideal_throughput"], model, gpus, path, line)
    if ideal <= 0:
        raise _fail(path, line, "ideal_throughput", "must be > 0 bytes/s")
    if get.get("epochs", ""):
        epochs = _number(get["epochs"], path, line, "epochs")
        if epochs <= 0:
            raise _fail(path, line, "epochs", f"{epochs} must be > 0 (fractions such as 0.07 are fine)")
    elif get.get("duration", ""):
        duration = _number(get["duration"], path, line, "duration")
        if duration <= 0:
            raise _fail(path, line, "duration", f"{duration} must be > 0 seconds")
        epochs = duration * ideal / size
        if epochs > MAX_EPOCHS:
            raise _fail(path, line, "duration", f"{duration:g} s at {ideal:g} B/s reads the {size:g}-byte dataset {epochs:.3g} "
                                                f"times; at most {MAX_EPOCHS:g} epochs (check the units of duration and ideal_throughput)")
    else:
        raise _fail(path, line, "epochs", "empty; give epochs or a duration in seconds")
    if epochs > MAX_EPOCHS:
        raise _fail(path, line, "epochs", f"{epochs:g} is more than {MAX_EPOCHS:g} epochs; a job reads its dataset at most that often")
    return TraceJob(job_id, submit, gpus, model, dataset, ideal, epochs, _access(get, path, line), _pipeline(get, path, line),
                    loader_miss_rate=_loader(get, path, line))


def _loader(get: dict[str, str], path: Path, line: int) -> float | None:
    """m = W s / L from the three loader columns (all empty: None, the paper's model)."""
    given = [c for c in LOADER_COLUMNS if get.get(c, "")]
    if not given:
        return None
    if len(given) < len(LOADER_COLUMNS):
        missing = next(c for c in LOADER_COLUMNS if c not in given)
        raise _fail(path, line, missing, "empty; the loader columns come together: loader_workers (worker processes), "
                                         "loader_item_bytes (one item, e.g. 110KB) and loader_miss_s (seconds a miss holds a worker)")
    workers = _number(get["loader_workers"], path, line, "loader_workers", integer=True)
    if not 1 <= workers <= MAX_LOADER_WORKERS:
        raise _fail(path, line, "loader_workers", f"{workers} is not a worker count; use an integer from 1 to {MAX_LOADER_WORKERS}")
    try:
        item = parse_size(get["loader_item_bytes"], "loader_item_bytes")
    except UnitError as exc:
        raise _fail(path, line, "loader_item_bytes", str(exc)) from None
    if not 0 < item <= MAX_LOADER_ITEM_BYTES:
        raise _fail(path, line, "loader_item_bytes", f"{item:g} B must be > 0 and at most 1 TiB (one item's size, e.g. 110KB)")
    miss = _number(get["loader_miss_s"], path, line, "loader_miss_s")
    if not 0 < miss <= MAX_LOADER_MISS_S:
        raise _fail(path, line, "loader_miss_s", f"{miss:g} must be > 0 and at most {MAX_LOADER_MISS_S:g} seconds (how long a "
                                                 "miss holds a loader worker, e.g. 0.003); leave the loader columns empty for a "
                                                 "loader that hides its misses")
    return float(model_loader_miss_rate(workers, item, miss))


def _pipeline(get: dict[str, str], path: Path, line: int):
    if not any(get.get(c, "") for c in PIPELINE_FIELDS):
        return None
    try:
        return parse_pipeline(*(get.get(c) for c in PIPELINE_FIELDS))
    except UserError as exc:
        column = next((c for c in PIPELINE_FIELDS if str(exc).startswith(c)), "cpu_rate")
        raise _fail(path, line, column, str(exc)) from None


def _access(get: dict[str, str], path: Path, line: int):
    if not any(get.get(c, "") for c in ACCESS_COLUMNS):
        return EPOCH
    try:
        return parse_access(get.get("access"), *(get.get(c) for c in CURRICULUM_FIELDS))
    except UserError as exc:
        # Name the column the message starts with (every access message names its field first).
        column = next((c for c in ACCESS_COLUMNS if str(exc).startswith(c)), "access")
        raise _fail(path, line, column, str(exc)) from None


def _size(text: str, dataset: str, path: Path, line: int) -> float:
    if not text:
        if dataset in DATASETS:
            return DATASETS[dataset].size
        raise _fail(path, line, "dataset_size", f"empty and {dataset!r} is not in the catalog ({', '.join(sorted(DATASETS))}); give a size such as 143GB")
    try:
        return parse_size(text, "dataset_size")
    except UnitError as exc:
        raise _fail(path, line, "dataset_size", str(exc)) from None


def _ideal(text: str, model: str, gpus: int, path: Path, line: int) -> float:
    if not text:
        if not model:
            raise _fail(path, line, "ideal_throughput", "empty and no model given; give bytes/s such as 114MB/s")
        try:
            return lookup_model(model).ideal_per_gpu * gpus
        except UserError:
            raise _fail(path, line, "model", f"unknown model {model!r} and no ideal_throughput; give ideal_throughput or use one of {', '.join(sorted(MODELS))}") from None
    try:
        return parse_rate(text, "ideal_throughput")
    except UnitError as exc:
        raise _fail(path, line, "ideal_throughput", str(exc)) from None


def write_csv_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` as a silod CSV that load_csv_trace reads back to the same jobs: every number
    in Python's shortest exact form (repr), so a simulation of the file is the simulation of
    the trace (`silod trace export`)."""
    declared = [j.job_id for j in trace.jobs if j.declared_throughput is not None]
    if declared:
        raise UserError(f"job {declared[0]} has a declared f* apart from its real one (Python API only); the trace CSV has no "
                        "column for it, so the file would simulate another trace")
    # The access columns only when a job needs them, so all-epoch traces keep the plain header.
    with_access = any(not j.access.regular for j in trace.jobs)
    with_items = bool(trace.item_sizes)
    with_pipeline = any(j.pipeline is not None for j in trace.jobs)
    with_loader = any(j.loader_miss_rate is not None for j in trace.jobs)

    def num(v: float | None) -> str:
        return "" if v is None else repr(v) if isinstance(v, float) else str(v)

    rows = [(*COLUMNS, *(ACCESS_COLUMNS if with_access else ()), *((ITEM_SIZE,) if with_items else ()),
             *(PIPELINE_FIELDS if with_pipeline else ()), *(LOADER_COLUMNS if with_loader else ()))]
    for j in trace.jobs:
        row = [j.job_id, num(float(j.submit_time)), j.num_gpus, j.model, j.dataset,
               num(float(trace.dataset_sizes[j.dataset])), num(float(j.ideal_throughput)), num(float(j.epochs))]
        if with_access:
            row += [v if isinstance(v, str) else num(v) for v in j.access.fields().values()]
        if with_items:
            item = trace.item_sizes.get(j.dataset)
            row.append(num(None if item is None else float(item)))
        if with_pipeline:
            p = j.pipeline
            row += ["", "", ""] if p is None else [num(float(p.cpu_rate)), num(p.autocache_expansion), num(p.post_cpu_rate)]
        if with_loader:
            # Only m = W s / L is kept: written as 1 worker, s = m bytes, L = 1 s (the same m, exactly).
            m = j.loader_miss_rate
            row += ["", "", ""] if m is None else ["1", num(float(m)), "1.0"]
        rows.append(row)
    # Written beside the target and renamed over it: a failure half-way (a full disk) leaves the
    # user's earlier file whole instead of a cut-off trace.
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", newline="", encoding="utf-8") as handle:
            csv.writer(handle).writerows(rows)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"could not write the trace {path} ({exc.strerror or exc}); "
                        f"{'the file there is unchanged' if path.exists() else 'nothing was written'}: free space or choose another --out") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
