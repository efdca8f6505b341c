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
    """(capacity, gpu_speed). Flags override the file; the file overrides `defaults`."""
    values: dict = dict(defaults or {})
    if path is not None:
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
        values.update(data)
    for key, flag in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("cache", cache), ("remote_io", remote_io), ("gpu_speed", gpu_speed),
                      ("irregular_share", irregular_share), ("cpus_per_node", cpus_per_node), ("cpu_allocation", cpu_allocation)):
        if flag is not None:
            values[key] = flag
    if values.get("cpu_allocation") is not None and values.get("cpus_per_node") is None:
        raise UserError("--cpu-allocation (cluster key cpu_allocation) chooses how the cores of --cpus-per-node are divided; "
                        "give --cpus-per-node (cpus_per_node) too, or drop it: without it CPU is not modelled")
    missing = [k for k in ("gpus", "cache", "remote_io") if k not in values]
    if missing:
        raise UserError(f"cluster is missing {', '.join('--' + m.replace('_', '-') for m in missing)} (or give --cluster FILE)")
    total = _gpus(values["gpus"], "--gpus")
    per_node = _gpus(values.get("gpus_per_node", min(8, total)), "--gpus-per-node")
    speed_raw = values.get("gpu_speed", 1.0)
    try:
        speed = float(speed_raw)
    except (TypeError, ValueError):
        raise UserError(f"--gpu-speed {speed_raw!r} is not a number") from None
    if not (0 < speed < 1e6):
        raise UserError(f"--gpu-speed {speed} must be a positive factor, e.g. 2 for twice as fast")
    if parse_rate(values["remote_io"], "--remote-io") <= 0:
        raise UserError("--remote-io must be > 0: with no remote bandwidth no job can read its first epoch")
    capacity = ClusterCapacity(
        gpus=total,
        cache=parse_size(values["cache"], "--cache"),
        remote_io=parse_rate(values["remote_io"], "--remote-io"),
        gpus_per_node=per_node,
        irregular_share=_fraction(values.get("irregular_share"), "--irregular-share"),
        cpus_per_node=_cpus(values.get("cpus_per_node"), "--cpus-per-node"),
        cpu_allocation=_cpu_rule(values.get("cpu_allocation")),
    )
    return capacity, speed
