"""Load a trace from a file in any format silod reads (CSV, Gavel/Philly TSV)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from estimator.errors import UserError


class TraceFormat(str, Enum):
    auto = "auto"
    csv = "csv"
    gavel = "gavel"


def load_trace(path: Path, fmt: TraceFormat, dataset_sharing: float = 0.0, max_jobs: int | None = None, seed: int = 0):
    from traces.csv_trace import load_csv_trace
    from traces.gavel_trace import load_gavel_trace

    if fmt == TraceFormat.auto:
        fmt = TraceFormat.gavel if path.suffix == ".trace" else TraceFormat.csv
    if fmt == TraceFormat.gavel:
        return load_gavel_trace(path, dataset_sharing=dataset_sharing, max_jobs=max_jobs, seed=seed)
    if dataset_sharing:
        raise UserError("--dataset-sharing applies to --format gavel; in a CSV trace, jobs share a dataset by naming it")
    trace = load_csv_trace(path)
    if max_jobs is not None:
        from traces.model import Trace

        trace = Trace(trace.jobs[:max_jobs], trace.dataset_sizes, trace.source, trace.notes, trace.item_sizes)
    return trace
