"""Gavel/Philly TSV traces (shipped in traces/gavel-msr, `--format gavel`).

Arrival times, GPU counts and step counts come from the trace; step rates from Gavel's
`simulation_throughputs.json` (V100, running alone). The Gavel job types train on small public
datasets (CIFAR-10, multi30k, ...) that never stress remote IO, so, as the SiloD paper does with
its production trace (§7), each job family is mapped to a model and dataset of the paper's
catalog (Table 4, Fig. 6). Durations stay the trace's (steps / steps-per-second); the data rate
f* is the catalog's per-GPU rate times Gavel's measured multi-GPU speed-up; epochs follow as
duration x f* / dataset size. The mapping is FAMILIES below; docs/simulator.md (`--format gavel`)
gives it as a table and says what the throughput table holds.

Gavel's table (simulation_throughputs.json, v100) does not have every GPU count for every job
type: A3C, CycleGAN and the Recommendation types have 1-GPU entries only, no type has one above 8
GPUs, while the msr traces ask for up to 64 (per VC: traces/gavel-msr/README.md); Gavel's own
simulator cannot run those jobs. The
reader runs them by an explicit rule (`scale_missing`, `--scale-missing`) and warns with their
count: `linear` (the default) scales the rate of the largest measured count below by the GPU
ratio; `nearest` takes that count's measured rate as it is (no speed-up beyond what was measured).

As in the paper, every job reads its own copy of its dataset unless `dataset_sharing` > 0, in
which case that fraction of jobs (chosen with the seed) reads the family's shared dataset.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from estimator.errors import UserError
from estimator.units import MAX_GPUS
from traces.catalog import DATASETS, MODELS
from traces.model import MAX_SUBMIT_S, Trace, TraceJob
from traces.public import SHIPPED_GAVEL_DIR, where_to_get


@dataclass(frozen=True, slots=True)
class FamilyMapping:
    family: str  # prefix of Gavel's job_type
    model: str  # catalog model whose per-GPU data rate the job gets
    dataset: str  # catalog dataset whose size the job reads
    why: str


FAMILIES: tuple[FamilyMapping, ...] = (
    FamilyMapping("ResNet-50", "resnet50", "imagenet-22k", "same model; the paper's large image set"),
    FamilyMapping("ResNet-18", "efficientnetb1", "imagenet-1k", "light image classifier on the smaller image set"),
    FamilyMapping("CycleGAN", "resnet152", "openimages", "compute-heavy image model on Open Images"),
    FamilyMapping("Recommendation", "vlad", "youtube-8m", "low data-rate model on a large feature set"),
    FamilyMapping("Transformer", "bert", "web-search", "language model on the web-search corpus"),
    FamilyMapping("LM", "bert", "web-search", "language model on the web-search corpus"),
    FamilyMapping("A3C", "a3c", "none", "reinforcement learning: reads no dataset"),
)

# A3C reads no training data; it is modelled with a tiny dataset and data rate so it never
# touches the remote link or the cache.
_A3C_DATASET_SIZE = 1e6
_A3C_RATE = 1e3


def _family(job_type: str) -> FamilyMapping:
    for fam in FAMILIES:
        if job_type.startswith(fam.family):
            return fam
    raise UserError(f"Gavel job type {job_type!r} has no mapping; known families: {', '.join(f.family for f in FAMILIES)}")


#: How a job whose GPU count has no throughput entry gets its rate (see the module docstring).
SCALE_MISSING = ("linear", "nearest")


def _steps_per_second(table: dict, job_type: str, gpus: int, where: str, scale_missing: str = "linear") -> float:
    """Gavel's measured rate; for a GPU count it has no entry for, the largest measured count
    below it, scaled by the GPU ratio (`linear`) or as measured (`nearest`). `where` names the
    throughputs file and the trace line that asked, for the errors."""
    measured = [k for k in (8, 4, 2, 1) if k <= gpus and f"('{job_type}', {k})" in table]
    if not measured:
        raise UserError(f"{where}: no throughput for {job_type!r} on {gpus} or fewer GPUs; add its v100 entries to the file "
                        f"or use Gavel's file shipped in {SHIPPED_GAVEL_DIR}")
    k = measured[0]
    key = f"('{job_type}', {k})"
    entry = table[key]
    rate = entry.get("null") if isinstance(entry, dict) else None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise UserError(f"{where}: v100 entry {key} needs \"null\": the steps per second running alone, "
                        f"a number > 0 (it is {rate if isinstance(entry, dict) else entry!r:.80}); use Gavel's file shipped in {SHIPPED_GAVEL_DIR}")
    return float(rate) * gpus / k if scale_missing == "linear" else float(rate)


def _measured(table: dict, job_type: str, gpus: int) -> bool:
    return f"('{job_type}', {gpus})" in table


def default_throughputs_path(trace_path: Path) -> Path:
    return trace_path.parent / "simulation_throughputs.json"


def load_gavel_trace(
    path: str | Path,
    throughputs: str | Path | None = None,
    *,
    dataset_sharing: float = 0.0,
    max_jobs: int | None = None,
    seed: int = 0,
    scale_missing: str = "linear",
) -> Trace:
    path = Path(path)
    if scale_missing not in SCALE_MISSING:
        raise UserError(f"--scale-missing {scale_missing!r} is not one of {', '.join(SCALE_MISSING)}")
    if not path.is_file():
        raise UserError(f"trace file {path} does not exist; {where_to_get()}")
    if not 0.0 <= dataset_sharing <= 1.0:
        raise UserError(f"dataset sharing {dataset_sharing} must be a fraction between 0 and 1")
    tp_path = Path(throughputs) if throughputs else default_throughputs_path(path)
    if not tp_path.is_file():
        raise UserError(f"{tp_path} not found; a Gavel trace needs Gavel's simulation_throughputs.json in the same "
                        f"directory (as in {SHIPPED_GAVEL_DIR})")
    try:
        table = json.loads(tp_path.read_text(encoding="utf-8"))["v100"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise UserError(f"{tp_path} is not Gavel's simulation_throughputs.json (JSON with a 'v100' table)") from None
    rng = np.random.default_rng(seed)
    jobs: list[TraceJob] = []
    missing = 0  # jobs whose GPU count has no throughput entry
    sizes: dict[str, float] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UserError(f"trace file {path} is not UTF-8 text (byte {exc.start}); a Gavel trace is a tab-separated text file") from None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        cols = raw.split("\t")
        if len(cols) != 7:
            raise UserError(f"{path}:{number}: expected 7 tab-separated columns, found {len(cols)}")
        job_type, _cmd, _flag, _needs_data, steps_text, arrival_text, gpus_text = cols
        try:
            steps, arrival, gpus = float(steps_text), float(arrival_text), int(gpus_text)
        except ValueError:
            raise UserError(f"{path}:{number}: total_steps, arrival_time and scale_factor must be numbers") from None
        if steps <= 0 or arrival < 0 or not 1 <= gpus <= MAX_GPUS or not math.isfinite(steps + arrival):
            raise UserError(f"{path}:{number}: steps must be > 0, arrival >= 0 and GPUs between 1 and {MAX_GPUS:,}")
        if arrival > MAX_SUBMIT_S:
            raise UserError(f"{path}:{number}: arrival_time {arrival:g} s is after the simulator's horizon ({MAX_SUBMIT_S:.3g} s, "
                            "ten years); give seconds from the trace start")
        fam = _family(job_type)
        where = f"{tp_path} (asked by {path}:{number})"
        rate_here = _steps_per_second(table, job_type, gpus, where, scale_missing)
        missing += not _measured(table, job_type, gpus)
        duration = steps / rate_here
        speedup = rate_here / _steps_per_second(table, job_type, 1, where)
        job_id = f"job{len(jobs):05d}"
        if fam.model == "a3c":
            rate, size, base = _A3C_RATE * speedup, _A3C_DATASET_SIZE, "rl-env"
        else:
            rate, size, base = MODELS[fam.model].ideal_per_gpu * speedup, DATASETS[fam.dataset].size, fam.dataset
        shared = rng.random() < dataset_sharing
        dataset = base if shared else f"{base}/{job_id}"
        sizes[dataset] = size
        jobs.append(TraceJob(job_id, arrival, gpus, job_type, dataset, rate, duration * rate / size))
        if max_jobs is not None and len(jobs) >= max_jobs:
            break
    if not jobs:
        raise UserError(f"{path}: no jobs in the trace")
    jobs.sort(key=lambda j: (j.submit_time, j.job_id))
    notes = [f"gavel format, dataset_sharing={dataset_sharing}"]
    if missing:
        what = ("the rate of the largest measured GPU count below, scaled by the GPU ratio" if scale_missing == "linear"
                else "the rate measured at the largest GPU count below, not scaled")
        note = (f"{missing} of {len(jobs)} jobs have a GPU count with no entry in {tp_path.name} (--scale-missing {scale_missing}: "
                f"{what}); Gavel's own simulator cannot run them")
        notes.append(note)
        warnings.warn(f"{path}: {note}", UserWarning, stacklevel=2)
    return Trace(tuple(jobs), sizes, source=str(path), notes=tuple(notes))
