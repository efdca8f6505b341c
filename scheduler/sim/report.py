"""What a simulation writes: summary.json, jobs.csv, timeline.csv (docs/simulator.md)."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from estimator.pipeline import RESOURCES
from scheduler.core.cluster import describe_cluster
from scheduler.sim.diagnosis import main_bottleneck
from scheduler.sim.engine import SimResult, TimelineRow


def summarize(result: SimResult, policy: str, cache_system: str, gpu_speed: float = 1.0) -> dict:
    jct = np.array([r.jct_s for r in result.jobs], dtype=float)
    cap = result.capacity
    horizon = result.makespan_s - min((r.submit_s for r in result.jobs), default=0.0)
    horizon = max(horizon, 1e-9)
    return {
        "policy": policy,
        "cache_system": cache_system,
        "jobs": len(result.jobs),
        "unfinished_jobs": len(result.unfinished),
        "avg_jct_s": float(jct.mean()) if jct.size else 0.0,
        "makespan_s": result.makespan_s,
        "p50_jct_s": float(np.percentile(jct, 50)) if jct.size else 0.0,
        "p99_jct_s": float(np.percentile(jct, 99)) if jct.size else 0.0,
        "avg_fairness_ratio": result.fairness_time_avg,
        "gpu_utilization": result.gpu_seconds_used / (cap.gpus * horizon),
        "remote_io_utilization": result.remote_bytes / (cap.remote_io * horizon) if cap.remote_io > 0 else 0.0,
        "remote_bytes": result.remote_bytes,
        "cluster": {"gpus": cap.gpus, "gpus_per_node": cap.gpus_per_node, "nodes": cap.nodes, "cache_bytes": cap.cache,
                    "remote_io_bytes_per_s": cap.remote_io, "cpus_per_node": cap.cpus_per_node,
                    "cpus": cap.cpus if cap.cpus_per_node is not None else None,
                    "cpu_allocation": cap.cpu_allocation if cap.cpus_per_node is not None else None,
                    "irregular_share": cap.irregular_share, "gpu_speed": gpu_speed,
                    "description": describe_cluster(cap, gpu_speed)},
        "sim_steps": result.steps,
        "sim_wall_s": result.sim_wall_s,
        "sim_cpu_s": result.sim_cpu_s,
    }


def write_outputs(result: SimResult, out_dir: str | Path, policy: str, cache_system: str, extra: dict | None = None) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result, policy, cache_system, float((extra or {}).get("gpu_speed", 1.0)))
    if extra:
        summary.update(extra)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (out / "jobs.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["job_id", "submit_s", "start_s", "finish_s", "jct_s", "gpus", "dataset", "remote_bytes", "hit_bytes", "epoch_hit_ratios",
                    *(f"bound_{k}_s" for k in RESOURCES), "bottleneck", "declared_ideal", "measured_ideal"])
        for r in sorted(result.jobs, key=lambda r: r.submit_s):
            bound = dict(r.bound_s)
            w.writerow([r.job_id, f"{r.submit_s:.3f}", f"{r.start_s:.3f}", f"{r.finish_s:.3f}", f"{r.jct_s:.3f}", r.gpus, r.dataset,
                        f"{r.remote_bytes:.0f}", f"{r.hit_bytes:.0f}", ";".join(f"{h:.4f}" for h in r.epoch_hit_ratios),
                        *(f"{bound.get(k, 0.0):.3f}" for k in RESOURCES), main_bottleneck(bound),
                        f"{r.declared_ideal:.0f}", "" if r.measured_ideal != r.measured_ideal else f"{r.measured_ideal:.0f}"])
    names = [f.name for f in fields(TimelineRow)]
    with (out / "timeline.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(names)
        for row in result.timeline:
            d = asdict(row)
            w.writerow([f"{d[n]:.6g}" if isinstance(d[n], float) else d[n] for n in names])
    return summary
