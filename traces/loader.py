"""Load a trace from a file in any format silod reads (CSV, Gavel/Philly TSV, Alibaba openb CSV)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from estimator.errors import UserError


class TraceFormat(str, Enum):
    auto = "auto"
    csv = "csv"
    gavel = "gavel"
    alibaba_openb = "alibaba-openb"


def _is_openb(path: Path) -> bool:
    """The openb pod list (its own header), or the folder that holds it."""
    if path.is_dir():
        return (path / "openb_pod_list_default.csv").is_file()
    try:
        with path.open(encoding="utf-8") as fh:
            return fh.readline().startswith("name,cpu_milli,")
    except (OSError, UnicodeDecodeError):
        return False


def load_trace(path: Path, fmt: TraceFormat, dataset_sharing: float = 0.0, max_jobs: int | None = None, seed: int = 0,
               scale_missing: str | None = None):
    """`scale_missing` (Gavel traces only): how jobs whose GPU count has no throughput entry get
    their rate (traces.gavel_trace.SCALE_MISSING; None: linear)."""
    from traces.csv_trace import load_csv_trace
    from traces.gavel_trace import load_gavel_trace

    if fmt == TraceFormat.auto:
        fmt = TraceFormat.gavel if path.suffix == ".trace" else TraceFormat.alibaba_openb if _is_openb(path) else TraceFormat.csv
    if fmt == TraceFormat.alibaba_openb:
        from traces.alibaba_trace import load_alibaba_trace

        return load_alibaba_trace(path, dataset_sharing=dataset_sharing, max_jobs=max_jobs, seed=seed)
    if fmt == TraceFormat.gavel:
        return load_gavel_trace(path, dataset_sharing=dataset_sharing, max_jobs=max_jobs, seed=seed, scale_missing=scale_missing or "linear")
    if scale_missing is not None:
        raise UserError("--scale-missing applies to --format gavel (Gavel's throughput table); drop it for this trace")
    if dataset_sharing:
        raise UserError("--dataset-sharing applies to --format gavel; in a CSV trace, jobs share a dataset by naming it")
    trace = load_csv_trace(path)
    if max_jobs is not None:
        from traces.model import Trace

        trace = Trace(trace.jobs[:max_jobs], trace.dataset_sizes, trace.source, trace.notes, trace.item_sizes)
    return trace
