"""Cluster capacities from command-line flags or a YAML file with the same keys."""

from __future__ import annotations

from pathlib import Path

import yaml

from estimator.errors import UserError
from estimator.units import parse_gpus, parse_rate, parse_size
from policies.types import ClusterCapacity

CLUSTER_KEYS = ("gpus", "gpus_per_node", "cache", "remote_io", "gpu_speed", "irregular_share", "cpus_per_node", "cpu_allocation")


def _cpus(value, what: str) -> float | None:
    """CPU cores per node (None: CPU not modelled). Whole or fractional cores, > 0."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise UserError(f"{what} {value!r} is not a core count; give the CPU cores of one node, e.g. 24")
    try:
        number = float(str(value).strip())
    except ValueError:
        raise UserError(f"{what} {value!r} is not a core count; give the CPU cores of one node, e.g. 24") from None
    if not 0 < number <= 1e6:  # NaN fails this too
        raise UserError(f"{what} {number:g} must be > 0 and at most 1,000,000 (the CPU cores of one node, e.g. 24);"
                        f" omit it when CPU is not constrained")
    return number


def _gpus(value, what: str) -> int:
    return parse_gpus(value, what)  # the bounds live in estimator.units


def _fraction(value, what: str) -> float | None:
    """The irregular partition's pinned share of cache and remote IO, or None (by demand)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise UserError(f"{what} {value!r} is not a fraction; give a number in [0, 1] such as 0.2")
    try:
        number = float(str(value))
    except ValueError:
        raise UserError(f"{what} {value!r} is not a fraction; give a number in [0, 1] such as 0.2") from None
    if not 0.0 <= number <= 1.0:  # NaN fails this too
        raise UserError(f"{what} {number} must be in [0, 1]: the fraction of cache and remote IO kept for irregular jobs")
    return number


def _cpu_rule(value) -> str:
    from policies.types import CPU_ALLOCATIONS

    rule = "model" if value is None else str(value).strip().lower()
    if rule not in CPU_ALLOCATIONS:
        raise UserError(f"--cpu-allocation {value!r} is unknown; use {' or '.join(CPU_ALLOCATIONS)}")
    return rule


FLAG_NAMES = {key: "--" + key.replace("_", "-") for key in CLUSTER_KEYS}


def _read_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"cluster file {p} does not exist; check --cluster")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise UserError(f"cluster file {p} is not a text file; give a YAML file with keys {', '.join(CLUSTER_KEYS)}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"cluster file {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"cluster file {p} must be a mapping with keys {', '.join(CLUSTER_KEYS)}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = set(data) - set(CLUSTER_KEYS)
    if unknown:
        raise UserError(f"cluster file {p}: unknown key(s) {sorted(unknown)}; valid keys: {', '.join(CLUSTER_KEYS)}")
    return data


def cluster_overrides(path: str | Path | None, **flags: object) -> list[str]:
    """One line per flag that overrides a key of the cluster file, e.g. "--gpus 8 overrides
    gpus: 32 in cluster.yaml". A flag wins (as everywhere on the command line), but not
    silently: the caller prints these before it starts."""
    if path is None:
        return []
    data = _read_file(path)
    notes = []
    for key, flag in flags.items():
        if flag is not None and key in data and str(data[key]) != str(flag):
            notes.append(f"{FLAG_NAMES[key]} {flag} overrides {key}: {data[key]} in {path}")
    return notes


def describe_cluster(capacity: ClusterCapacity, gpu_speed: float = 1.0) -> str:
    """The cluster in one line, as a person checks it: "96 GPUs (24 nodes of 4), cache 24TB,
    remote IO 1GB/s, CPU not modelled"."""
    from estimator.units import format_rate, format_size

    parts = [f"{capacity.gpus:,} GPUs ({capacity.nodes:,} node{'s' if capacity.nodes != 1 else ''} of {capacity.gpus_per_node})"]
    if gpu_speed != 1.0:
        parts[0] += f" at {gpu_speed:g}x speed"
    parts.append(f"cache {format_size(capacity.cache)}")
    parts.append(f"remote IO {format_rate(capacity.remote_io)}")
    if capacity.cpus_per_node is None:
        parts.append("CPU not modelled")
    else:
        parts.append(f"{capacity.cpus:g} CPU cores ({capacity.cpus_per_node:g} per node, {capacity.cpu_allocation})")
    if capacity.irregular_share is not None:
        parts.append(f"irregular share {capacity.irregular_share:g}")
    return ", ".join(parts)


def load_cluster(
    path: str | Path | None = None,
    *,
    gpus: int | str | None = None,
    gpus_per_node: int | str | None = None,
    cache: str | float | None = None,
    remote_io: str | float | None = None,
    gpu_speed: float | str | None = None,
    irregular_share: float | str | None = None,
    cpus_per_node: float | str | None = None,
    cpu_allocation: str | None = None,
    defaults: dict | None = None,
) -> tuple[ClusterCapacity, float]:
    """(capacity, gpu_speed). Flags override the file (`cluster_overrides` says which); the file
    overrides `defaults`. An error names the flag or the file's key the bad value came from."""
    values: dict = dict(defaults or {})
    what = dict(FLAG_NAMES)  # how an error names a value: the flag, or the file's key
    if path is not None:
        data = _read_file(path)
        values.update(data)
        what.update({key: f"cluster file {path}: {key}" for key in data})
    for key, flag in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("cache", cache), ("remote_io", remote_io), ("gpu_speed", gpu_speed),
                      ("irregular_share", irregular_share), ("cpus_per_node", cpus_per_node), ("cpu_allocation", cpu_allocation)):
        if flag is not None:
            values[key] = flag
            what[key] = FLAG_NAMES[key]
    if values.get("cpu_allocation") is not None and values.get("cpus_per_node") is None:
        raise UserError("--cpu-allocation (cluster key cpu_allocation) chooses how the cores of --cpus-per-node are divided; "
                        "give --cpus-per-node (cpus_per_node) too, or drop it: without it CPU is not modelled")
    missing = [k for k in ("gpus", "cache", "remote_io") if k not in values]
    if missing:
        raise UserError(f"cluster is missing {', '.join('--' + m.replace('_', '-') for m in missing)} (or give --cluster FILE)")
    total = _gpus(values["gpus"], what["gpus"])
    per_node = _gpus(values.get("gpus_per_node", min(8, total)), what["gpus_per_node"])
    speed_raw = values.get("gpu_speed", 1.0)
    try:
        speed = float(speed_raw)
    except (TypeError, ValueError):
        raise UserError(f"{what['gpu_speed']} {speed_raw!r} is not a number") from None
    if not (0 < speed < 1e6):
        raise UserError(f"{what['gpu_speed']} {speed} must be a positive factor, e.g. 2 for twice as fast")
    if parse_rate(values["remote_io"], what["remote_io"]) <= 0:
        raise UserError(f"{what['remote_io']} must be > 0: with no remote bandwidth no job can read its first epoch")
    capacity = ClusterCapacity(
        gpus=total,
        cache=parse_size(values["cache"], what["cache"]),
        remote_io=parse_rate(values["remote_io"], what["remote_io"]),
        gpus_per_node=per_node,
        irregular_share=_fraction(values.get("irregular_share"), what["irregular_share"]),
        cpus_per_node=_cpus(values.get("cpus_per_node"), what["cpus_per_node"]),
        cpu_allocation=_cpu_rule(values.get("cpu_allocation")),
    )
    return capacity, speed
