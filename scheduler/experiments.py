"""The paper's experiments (§7), each a set of simulations, a JSON file and a PNG plot.

    matrix      Fig. 12: FIFO, SJF, Gavel x silod, alluxio, coordl, quiver (400 GPUs, 4 GB/s)
    fairness    Fig. 13: Eq. 8 fairness ratio over time under Gavel, the four cache systems
    bandwidth   Fig. 14a: FIFO, silod vs alluxio, remote IO from 1 to 10 GB/s
    gpu-speed   Fig. 14b: Gavel, silod vs quiver, GPUs 1x to 4x faster
    sharing     Fig. 15: FIFO, SJF, Gavel on silod, fraction of jobs sharing datasets 0..1
    micro       Table 6: the 8-V100 micro-benchmark (5 jobs, 2 TB cache, 200 MB/s)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from estimator.errors import UserError
from policies.types import ClusterCapacity
from traces.model import Trace, TraceJob

GB = 1e9
TB = 1e12
MB = 1e6

PHILLY_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "gavel-msr" / "6c71a0.trace"
LARGE_CLUSTER = dict(gpus=400, gpus_per_node=4, cache=100 * TB, remote_io=4 * GB)
#: The paper's large-scale trace is generated from Philly's job-duration distribution (§7); the
#: Gavel/Philly VC traces are too lightly loaded for a 400-GPU cluster to queue (see README).
SYNTHETIC_JOBS = 2000
SYNTHETIC_INTERARRIVAL_S = 300.0
CACHE_SYSTEMS = ("silod", "alluxio", "coordl", "quiver")


@dataclass(frozen=True)
class Run:
    label: str
    policy: str
    cache_system: str
    capacity: ClusterCapacity
    gpu_speed: float = 1.0
    dataset_sharing: float = 0.0


def micro_benchmark_trace() -> Trace:
    """§7.1.1: four 1-GPU image jobs on four 1.3 TB datasets, one 4-GPU BERT on 20.9 TB.

    Epochs are the paper's (13 for ResNet-50, 10 for EfficientNetB1, 0.07 for BERT, about
    3,500 minutes each at ideal speed); BERT's rate is the 8 MB/s §7.1.1 gives for 4 GPUs.
    """
    jobs = (
        TraceJob("resnet50-a", 0.0, 1, "resnet50", "images-a", 114 * MB, 13.0),
        TraceJob("resnet50-b", 0.0, 1, "resnet50", "images-b", 114 * MB, 13.0),
        TraceJob("efficientnetb1-a", 0.0, 1, "efficientnetb1", "images-c", 69 * MB, 10.0),
        TraceJob("efficientnetb1-b", 0.0, 1, "efficientnetb1", "images-d", 69 * MB, 10.0),
        TraceJob("bert", 0.0, 4, "bert", "web-search", 8 * MB, 0.07),
    )
    sizes = {"images-a": 1.3 * TB, "images-b": 1.3 * TB, "images-c": 1.3 * TB, "images-d": 1.3 * TB, "web-search": 20.9 * TB}
    return Trace(jobs, sizes, source="SiloD §7.1.1 micro-benchmark")


class ExperimentRunner:
    """Runs simulations with one rich progress display and caches traces by sharing fraction."""

    def __init__(self, trace_path: Path | None, max_jobs: int | None, seed: int, round_s: float, resolution: int, show_progress: bool = True):
        self.trace_path = trace_path
        self.max_jobs = max_jobs
        self.seed = seed
        self.round_s = round_s
        self.resolution = resolution
        self.show_progress = show_progress
        self._traces: dict[float, Trace] = {}

    def trace(self, sharing: float) -> Trace:
        from scheduler.cli_sim import TraceFormat, load_trace

        if sharing not in self._traces and self.trace_path is None:
            from traces.synthetic import generate_trace

            n = self.max_jobs or SYNTHETIC_JOBS
            self._traces[sharing] = generate_trace(n, mean_interarrival_s=SYNTHETIC_INTERARRIVAL_S, dataset_sharing=sharing, seed=self.seed + 1)
        if sharing not in self._traces:
            if not self.trace_path.is_file():
                raise UserError(f"trace {self.trace_path} not found; pass --trace (the Gavel/Philly traces live in ../shared/traces/gavel-msr)")
            self._traces[sharing] = load_trace(self.trace_path, TraceFormat.auto, sharing, self.max_jobs, self.seed)
        return self._traces[sharing]

    def run_all(self, runs: list[Run], trace_for: Callable[[Run], Trace] | None = None) -> list[tuple[Run, dict, object]]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from policies.registry import estimator_for, get_policy
        from scheduler.backends.sim.engine import SimConfig, Simulator
        from scheduler.backends.sim.report import summarize

        results = []
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not self.show_progress) as bar:
            overall = bar.add_task("experiment", total=len(runs))
            for run in runs:
                trace = trace_for(run) if trace_for else self.trace(run.dataset_sharing)
                task = bar.add_task(f"  {run.label}", total=1.0)
                config = SimConfig(round_s=self.round_s, resolution=self.resolution, gpu_speed=run.gpu_speed, seed=self.seed)
                sim = Simulator(trace, run.capacity, get_policy(run.policy), estimator_for(run.cache_system), run.cache_system, config,
                                progress=lambda f, t=task: bar.update(t, completed=f))
                result = sim.run()
                bar.remove_task(task)
                bar.advance(overall)
                results.append((run, summarize(result, run.policy, run.cache_system), result))
        return results


def _capacity(**overrides) -> ClusterCapacity:
    values = {**LARGE_CLUSTER, **overrides}
    return ClusterCapacity(gpus=values["gpus"], cache=values["cache"], remote_io=values["remote_io"], gpus_per_node=values["gpus_per_node"])


def _save(out: Path, name: str, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def experiment_matrix(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    runs = [Run(f"{p}/{c}", p, c, capacity) for p in ("fifo", "sjf", "gavel") for c in CACHE_SYSTEMS]
    results = runner.run_all(runs)
    table = {f"{r.policy}/{r.cache_system}": s for r, s, _ in results}
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    policies = ("fifo", "sjf", "gavel")
    width = 0.2
    for ax, key, title in ((axes[0], "avg_jct_s", "average JCT (h)"), (axes[1], "makespan_s", "makespan (h)")):
        for i, system in enumerate(CACHE_SYSTEMS):
            vals = [table[f"{p}/{system}"][key] / 3600 for p in policies]
            ax.bar([x + i * width for x in range(len(policies))], vals, width, label=system)
        ax.set_xticks([x + 1.5 * width for x in range(len(policies))], [p.upper() for p in policies])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("Fig. 12: policies x cache systems")
    fig.tight_layout()
    fig.savefig(out / "matrix.png", dpi=120)
    plt.close(fig)
    payload = {"experiment": "matrix", "runs": table}
    _save(out, "matrix", payload)
    return payload


def experiment_fairness(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    runs = [Run(f"gavel/{c}", "gavel", c, capacity) for c in CACHE_SYSTEMS]
    results = runner.run_all(runs)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    payload = {"experiment": "fairness", "avg_fairness_ratio": {}}
    for run, summary, result in results:
        pts = [(row.time_s / 86400, row.fairness_ratio) for row in result.timeline if row.fairness_ratio == row.fairness_ratio]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{run.cache_system} (avg {summary['avg_fairness_ratio']:.2f})", lw=0.8)
        payload["avg_fairness_ratio"][run.cache_system] = summary["avg_fairness_ratio"]
    ax.set_xlabel("time (days)")
    ax.set_ylabel("fairness ratio (Eq. 8, measured)")
    ax.set_title("Fig. 13: fairness over time under Gavel")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fairness.png", dpi=120)
    plt.close(fig)
    _save(out, "fairness", payload)
    return payload


def _sweep_plot(out: Path, name: str, title: str, xlabel: str, xs: list[float], series: dict[str, list[float]]) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(xs, [y / 3600 for y in ys], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("average JCT (h)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)


def _sweep(runner: ExperimentRunner, out: Path, experiment: str, x_key: str, xs: list[float], runs: list[Run],
           series_of: Callable[[Run], str], title: str, xlabel: str) -> dict:
    """Run a sweep (runs ordered x-major), plot average JCT per series over x, save the JSON."""
    results = runner.run_all(runs)
    series: dict[str, list[float]] = {}
    for run, summary, _ in results:
        series.setdefault(series_of(run), []).append(summary["avg_jct_s"])
    name = experiment.replace("-", "_")
    _sweep_plot(out, name, title, xlabel, xs, series)
    payload = {"experiment": experiment, x_key: xs, "avg_jct_s": series}
    _save(out, name, payload)
    return payload


def experiment_bandwidth(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    rates = [1.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    runs = [Run(f"fifo/{c} @ {r:g} GB/s", "fifo", c, _replace(capacity, remote_io=r * GB)) for r in rates for c in ("silod", "alluxio")]
    return _sweep(runner, out, "bandwidth", "remote_io_gb_s", rates, runs, lambda r: r.cache_system,
                  "Fig. 14a: FIFO, remote IO bandwidth", "remote IO (GB/s)")


def experiment_gpu_speed(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    speeds = [1.0, 2.0, 3.0, 4.0]
    runs = [Run(f"gavel/{c} x{s:g}", "gavel", c, capacity, gpu_speed=s) for s in speeds for c in ("silod", "quiver")]
    return _sweep(runner, out, "gpu-speed", "gpu_speed", speeds, runs, lambda r: r.cache_system,
                  "Fig. 14b: Gavel, GPU speed", "GPU speed (x V100)")


def experiment_sharing(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0]
    runs = [Run(f"{p}/silod sharing {f:g}", p, "silod", capacity, dataset_sharing=f) for f in fractions for p in ("fifo", "sjf", "gavel")]
    return _sweep(runner, out, "sharing", "fractions", fractions, runs, lambda r: r.policy,
                  "Fig. 15: dataset sharing (SiloD)", "fraction of jobs sharing datasets")


PAPER_TABLE6_MIN = {  # SiloD Table 6, real V100 runs, minutes
    "silod": {"avg_jct": 3366, "makespan": 3807},
    "coordl": {"avg_jct": 4278, "makespan": 4870},
    "alluxio": {"avg_jct": 4378, "makespan": 5080},
    "quiver": {"avg_jct": 3609, "makespan": 3933},
}


def experiment_micro(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity | None = None) -> dict:
    cap = ClusterCapacity(gpus=8, cache=2 * TB, remote_io=200 * MB, gpus_per_node=4)
    trace = micro_benchmark_trace()
    runs = [Run(f"fifo/{c}", "fifo", c, cap) for c in CACHE_SYSTEMS]
    results = runner.run_all(runs, trace_for=lambda run: trace)
    payload = {"experiment": "micro", "ours_min": {}, "paper_min": PAPER_TABLE6_MIN}
    for run, summary, _ in results:
        payload["ours_min"][run.cache_system] = {"avg_jct": summary["avg_jct_s"] / 60, "makespan": summary["makespan_s"] / 60}
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("avg_jct", "makespan"), strict=True):
        xs = range(len(CACHE_SYSTEMS))
        ax.bar([x - 0.2 for x in xs], [payload["ours_min"][c][key] for c in CACHE_SYSTEMS], 0.4, label="silod simulator")
        ax.bar([x + 0.2 for x in xs], [PAPER_TABLE6_MIN[c][key] for c in CACHE_SYSTEMS], 0.4, label="paper (real V100)")
        ax.set_xticks(list(xs), CACHE_SYSTEMS)
        ax.set_title(f"{key.replace('_', ' ')} (min)")
    axes[0].legend()
    fig.suptitle("Table 6: 8-V100 micro-benchmark")
    fig.tight_layout()
    fig.savefig(out / "micro.png", dpi=120)
    plt.close(fig)
    _save(out, "micro", payload)
    return payload


def _replace(capacity: ClusterCapacity, **changes) -> ClusterCapacity:
    from dataclasses import replace

    return replace(capacity, **changes)


EXPERIMENTS: dict[str, Callable] = {
    "matrix": experiment_matrix,
    "fairness": experiment_fairness,
    "bandwidth": experiment_bandwidth,
    "gpu-speed": experiment_gpu_speed,
    "sharing": experiment_sharing,
    "micro": experiment_micro,
}
