"""An experiment's simulations split over machines (`--shard I/N`), run on a Dask cluster
(`--dask ADDRESS`), and put back together (`--merge DIR...`).

A shard runs runs I-1, I-1+N, I-1+2N, ... of the experiment's run list (round robin, so the
heavy runs of a sweep spread over the shards) and writes them to `NAME.part-I-of-N.json`. The
part records the configuration the run list was built from (trace path, --max-jobs, seed,
round, resolution, cluster), the number of jobs in the trace, and a fingerprint: a SHA-256
over the experiment, that configuration (the trace by content, not by path), every run of the
list and silod's version. `--merge` rebuilds the run list from the recorded configuration,
checks that the parts carry that fingerprint, are complete (1..N, every run once) and do not
overlap, and hands their results to the experiment's plotting code: the merged JSON and PNGs
are those of an unsharded run, apart from each run's measured `sim_wall_s` / `sim_cpu_s`.

The Dask executor ships the parsed trace to the workers (`Client.scatter`), so the trace file
need not be visible to them; the workers need silod installed (the same version) and nothing
else.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from estimator.errors import UserError
from traces.model import MAX_SUBMIT_S

if TYPE_CHECKING:
    from traces.model import Trace

PART_FORMAT = "silod-experiment-part/1"
#: More shards than any experiment has simulations; bounds what `--shard` and a part may claim
#: (a part claiming shard 1/10^20 made --merge list 10^20 missing shards).
MAX_SHARDS = 10_000
#: The configuration a part records (ExperimentRunner.config plus the cluster).
CONFIG_KEYS = ("trace", "max_jobs", "seed", "round_s", "resolution", "capacity")
#: Fields of a run's summary that are measurements of the machine, not results of the model.
TIMING_FIELDS = ("sim_wall_s", "sim_cpu_s")


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, as in Playwright's and Jest's --shard
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise UserError(f"--shard {text!r} is not I/N; give the shard number and the number of shards, e.g. --shard 2/4")
        index, count = int(match[1]), int(match[2])
        if not 1 <= count <= MAX_SHARDS:
            raise UserError(f"--shard {text}: N must be from 1 to {MAX_SHARDS:,}, more shards than any experiment has "
                            "simulations (e.g. --shard 1/4)")
        if not 1 <= index <= count:
            raise UserError(f"--shard {text}: I must be from 1 to N and N >= 1 (e.g. --shard 1/{max(count, 2)})")
        return cls(index, count)

    def picks(self, total: int) -> list[int]:
        """This shard's indices of a run list of `total` runs."""
        return list(range(self.index - 1, total, self.count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def part_file_name(experiment: str, shard: Shard) -> str:
    return f"{experiment.replace('-', '_')}.part-{shard.index}-of-{shard.count}.json"


def trace_digest(trace: Trace) -> str:
    """SHA-256 of what the simulator reads from a trace (jobs, dataset and item sizes), not of
    the file: the same trace loaded from another path or machine has the same digest."""
    text = repr((trace.jobs, sorted(trace.dataset_sizes.items()), sorted(trace.item_sizes.items())))
    return hashlib.sha256(text.encode()).hexdigest()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("silod")
    except PackageNotFoundError:
        return "unknown"


def fingerprint(experiment: str, source: dict, round_s: float, resolution: int, runs: Sequence[dict], digest: str) -> str:
    """`source` and `runs` as JSON-able dicts (dataclasses.asdict of TraceSource and Run)."""
    # The trace by content (`digest`) and its file by name only: shards on machines that keep
    # the trace at different paths are the same experiment.
    src = dict(source)
    if src["path"] is not None:
        src["path"] = Path(src["path"]).name
    body = {"experiment": experiment, "source": src, "round_s": round_s, "resolution": resolution,
            "runs": list(runs), "trace": digest, "silod": _version()}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()


@dataclass(frozen=True)
class Part:
    path: Path
    experiment: str
    fingerprint: str
    shard: Shard
    total_runs: int
    config: dict
    trace_jobs: int
    trace_digest: str
    results: dict[int, dict]  # index -> a run's result as JSON (experiments.result_to_json)


def write_part(out: Path, experiment: str, shard: Shard, fp: str, config: dict, trace_jobs: int, digest: str,
               total_runs: int, results: dict[int, dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / part_file_name(experiment, shard)
    body = {"format": PART_FORMAT, "experiment": experiment, "fingerprint": fp, "shard": [shard.index, shard.count],
            "total_runs": total_runs, "config": config, "trace_jobs": trace_jobs, "trace_digest": digest,
            "results": [{"index": i, **results[i]} for i in sorted(results)]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)  # a reader never sees half a part
    return path


def _not_finite(text: str) -> float:
    """json.loads hook for NaN, Infinity and numbers beyond a float (1e400): a part holds none."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is not finite")
    return value


def _whole(value: object, what: str, low: int, high: int | None = None) -> int:
    # bool is an int to Python, and int(1.5) is 1: a part holds exact whole numbers only.
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low:,}" if high is None else f"from {low:,} to {high:,}"
        raise ValueError(f"{what} is {value!r}, not a whole number {bounds}")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cluster_value(item: tuple[str, object]) -> bool:
    """A summary's cluster entry: numbers, None where CPU is not modelled, and two texts."""
    key, value = item
    return _is_number(value) or value is None or (key in ("description", "cpu_allocation") and isinstance(value, str))


def _check_result(r: dict, read_result: Callable[[dict], object]) -> None:
    """A run's result as the plotting code reads it (what result_to_json writes)."""
    read_result(r)  # the run, the fairness series and queued_until
    summary = r["summary"]
    if not isinstance(summary, dict) or not isinstance(r["jct_by_kind"], dict):
        raise ValueError(f"run {r['index']}: summary and jct_by_kind must be objects")
    for key, value in [*summary.items(), *r["jct_by_kind"].items()]:
        ok = isinstance(value, str) if key in ("policy", "cache_system") else \
            isinstance(value, dict) and all(map(_cluster_value, value.items())) if key == "cluster" else _is_number(value)
        if not ok:
            raise ValueError(f"run {r['index']}: {key} is {value!r}")
    # Finite is not enough: 1e308 s merged into a table of 300-digit JCTs. No simulated time (a
    # JCT, a makespan; jct_by_kind is seconds too) passes the simulator's horizon, and nothing a
    # run counts is negative. (Utilisation is not bounded by 1 here: with jobs left unfinished at
    # the horizon it is taken over the finished jobs' makespan.)
    seconds = [(k, v) for k, v in summary.items() if k.endswith("_s")] + list(r["jct_by_kind"].items())
    for key, value in seconds:
        if not 0 <= value <= MAX_SUBMIT_S:
            raise ValueError(f"run {r['index']}: {key} is {value!r} s, outside 0 to {MAX_SUBMIT_S:.3g} s (the simulator's horizon)")
    for key, value in summary.items():
        if _is_number(value) and value < 0:
            raise ValueError(f"run {r['index']}: {key} is {value!r}, which no run gives (negative)")


def _check_config(config: object) -> dict:
    from policies.types import ClusterCapacity

    if not isinstance(config, dict) or any(k not in config for k in CONFIG_KEYS):
        raise ValueError(f"config must be an object with {', '.join(CONFIG_KEYS)}")
    if config["trace"] is not None and not isinstance(config["trace"], str):
        raise ValueError(f"config trace is {config['trace']!r}, not a path")
    if config["max_jobs"] is not None:
        _whole(config["max_jobs"], "config max_jobs", 1)
    _whole(config["seed"], "config seed", 0, 2**32 - 1)
    _whole(config["resolution"], "config resolution", 1)
    if isinstance(config["round_s"], bool) or not isinstance(config["round_s"], (int, float)) or not config["round_s"] > 0:
        raise ValueError(f"config round_s is {config['round_s']!r}, not a number of seconds > 0")
    ClusterCapacity(**config["capacity"])  # TypeError on a missing or unknown field, UserError on a bad value
    return config


def _load_part(path: Path, read_result: Callable[[dict], object]) -> Part:
    try:
        # A FIFO or device named like a part (or a symlink to one) would block the read or never end.
        if not path.is_file():
            raise ValueError("not a regular file")
        body = json.loads(path.read_text(encoding="utf-8"), parse_constant=_not_finite, parse_float=_not_finite)
        if not isinstance(body, dict):
            raise ValueError(f"a JSON {type(body).__name__}, not an object")
        if body.get("format") != PART_FORMAT:
            raise ValueError(f"format {body.get('format')!r}, expected {PART_FORMAT!r}")
        shard = body["shard"]
        if not isinstance(shard, list) or len(shard) != 2:
            raise ValueError(f"shard is {shard!r}, not [I, N]")
        count = _whole(shard[1], "shard N", 1, MAX_SHARDS)
        index = _whole(shard[0], "shard I", 1, count)
        for key in ("experiment", "fingerprint", "trace_digest"):
            if not isinstance(body[key], str):
                raise ValueError(f"{key} is {body[key]!r}, not a string")
        if not isinstance(body["results"], list) or not all(isinstance(r, dict) for r in body["results"]):
            raise ValueError("results must be a list of objects")
        results = {_whole(r["index"], "a result's index", 0): r for r in body["results"]}
        for r in results.values():
            _check_result(r, read_result)  # a damaged run fails here, naming the file, not in the plotting code
        return Part(path, body["experiment"], body["fingerprint"], Shard(index, count), _whole(body["total_runs"], "total_runs", 0),
                    _check_config(body["config"]), _whole(body["trace_jobs"], "trace_jobs", 0), body["trace_digest"], results)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # UserError is a ValueError: a bad cluster in the config is reported with the file too.
        detail = f"no field {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
        raise UserError(f"{path} is not a part written by `silod experiment --shard` ({detail}); remove it or rerun that shard") from None


@dataclass(frozen=True)
class MergedParts:
    experiment: str
    fingerprint: str
    config: dict
    trace_jobs: int
    trace_digest: str
    results: dict[int, dict]
    paths: tuple[Path, ...]


def load_parts(experiment: str, dirs: Sequence[Path], read_result: Callable[[dict], object]) -> MergedParts:
    """The parts of `experiment` in `dirs`, checked: one experiment, configuration and trace
    (the fingerprint), every shard 1..N exactly once, every run exactly once, and every run's
    result readable by `read_result` (experiments.result_from_json, passed in: experiments
    imports this module)."""
    stem = experiment.replace("-", "_")
    paths: list[Path] = []
    given: dict[Path, Path] = {}
    for d in dirs:
        if not d.is_dir():
            raise UserError(f"--merge {d}: not a directory; give the --out directories of the shards")
        same = given.setdefault(d.resolve(), d)
        if same is not d:
            raise UserError(f"--merge names the directory {d} twice ({same} and {d}); give each directory once")
        paths += sorted(d.glob(f"{stem}.part-*-of-*.json"))
    if not paths:
        raise UserError(f"no part of experiment {experiment} in {', '.join(map(str, dirs))}; "
                        f"run `silod experiment {experiment} --shard I/N --out DIR` for I = 1..N first")
    parts = [_load_part(p, read_result) for p in paths]
    first = parts[0]
    for p in parts:
        if p.experiment != experiment:
            raise UserError(f"{p.path} is a part of experiment {p.experiment}, not {experiment}")
        if p.fingerprint != first.fingerprint:
            raise UserError(f"{p.path} and {first.path} are parts of different runs of {experiment} (configuration, trace or "
                            f"silod version differ: {p.config} vs {first.config}); merge parts of one sharded run only")
        if p.shard.count != first.shard.count:
            raise UserError(f"{p.path} is shard {p.shard} and {first.path} shard {first.shard}: one run split into different N; "
                            "merge the parts of one split only")
        if p.total_runs != first.total_runs:  # the fingerprint covers it; a hand-edited part might not
            raise UserError(f"{p.path} splits {p.total_runs} runs and {first.path} {first.total_runs}; one of them was edited, "
                            "rerun its shard")
    seen: dict[int, Path] = {}
    for p in parts:
        if p.shard.index in seen:
            raise UserError(f"shard {p.shard} of {experiment} is given twice ({seen[p.shard.index]} and {p.path}); "
                            "keep one of them")
        seen[p.shard.index] = p.path
    missing = [i for i in range(1, first.shard.count + 1) if i not in seen]
    if missing:
        listed = ", ".join(f"{i}/{first.shard.count}" for i in missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise UserError(f"experiment {experiment}: shard(s) {listed} missing "
                        f"from {', '.join(map(str, dirs))}; run them (--shard I/{first.shard.count}) or add their directories")
    results: dict[int, dict] = {}
    owner: dict[int, Path] = {}
    for p in parts:
        # A range, not a list: total_runs comes from the file (10^12 was a MemoryError).
        expected = range(p.shard.index - 1, p.total_runs, p.shard.count)
        if len(p.results) != len(expected) or any(i not in expected for i in p.results):
            raise UserError(f"{p.path} holds runs {sorted(p.results)[:20]}, but shard {p.shard} of {p.total_runs} runs is "
                            f"{list(expected[:20])}{' ...' if len(expected) > 20 else ''}; the part is damaged, rerun that shard")
        for i, r in p.results.items():
            if i in owner:  # unreachable with consistent shards; a hand-edited part could do it
                raise UserError(f"run {i} of {experiment} is in both {owner[i]} and {p.path}")
            owner[i] = p.path
            results[i] = r
    if sorted(results) != list(range(first.total_runs)):
        raise UserError(f"experiment {experiment}: the parts hold {len(results)} of {first.total_runs} runs; rerun the missing shards")
    return MergedParts(experiment, first.fingerprint, first.config, first.trace_jobs, first.trace_digest, results, tuple(paths))


class ShardWritten(Exception):
    """Raised by ExperimentRunner.run_all in shard mode after writing its part: the rest of the
    experiment (plots, JSON) needs every part and happens at --merge."""

    def __init__(self, path: Path, ran: int, total: int):
        super().__init__(f"wrote {path}")
        self.path, self.ran, self.total = path, ran, total
