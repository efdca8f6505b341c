"""The paper's experiments (§7), each a set of simulations, a JSON file and a PNG plot.

    matrix      Fig. 12: FIFO, SJF, Gavel x silod, alluxio, coordl, quiver (400 GPUs, 4 GB/s)
    fairness    Fig. 13: Eq. 8 fairness ratio over time under Gavel, the four cache systems,
                and SiloD with its remote-IO allocation not enforced
    bandwidth   Fig. 14a: FIFO, silod vs alluxio, remote IO from 1 to 10 GB/s
    gpu-speed   Fig. 14b: Gavel, silod vs quiver (the paper's best baseline), GPUs 1x to 4x faster
    sharing     Fig. 15: FIFO, SJF, Gavel on silod, fraction of jobs sharing datasets 0..1
    micro       Table 6: the 8-V100 micro-benchmark (5 jobs, 2 TB cache, 200 MB/s)

A library: `silod experiment` (scheduler/cli_sim.py) calls it; it imports no CLI code.
Simulations of one experiment run in worker processes; each experiment returns its payload
(also written as JSON) with a `headline` the CLI prints as a table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from estimator.errors import UserError
from policies.types import ClusterCapacity
from traces.model import Trace, TraceJob

GB = 1e9
TB = 1e12
MB = 1e6

LARGE_CLUSTER = dict(gpus=400, gpus_per_node=4, cache=100 * TB, remote_io=4 * GB)
#: The paper's large-scale trace is generated from Philly's job-duration distribution (§7); the
#: Gavel/Philly VC traces are too lightly loaded for a 400-GPU cluster to queue (see README).
SYNTHETIC_JOBS = 2000
SYNTHETIC_INTERARRIVAL_S = 300.0
#: The sweeps (Figs. 14a, 14b, 15) run dozens of simulations: half the jobs at twice the arrival
#: rate, so the queue builds up as in the 2,000-job trace. (The first 600 jobs of that trace at
#: its own rate leave a 400-GPU cluster unloaded: every point of a sweep came out the same.)
SWEEP_JOBS = 1000
SWEEP_INTERARRIVAL_S = 150.0
CACHE_SYSTEMS = ("silod", "alluxio", "coordl", "quiver")
BASELINES = ("alluxio", "coordl", "quiver")


@dataclass(frozen=True)
class TraceSource:
    """How to build a trace, so that worker processes build it themselves (deterministic)."""

    path: str | None  # None: the synthetic Philly-distribution trace, or the micro-benchmark
    max_jobs: int | None
    seed: int
    sharing: float = 0.0
    micro: bool = False
    interarrival_s: float = SYNTHETIC_INTERARRIVAL_S  # synthetic trace only


@dataclass(frozen=True)
class Run:
    label: str
    policy: str
    cache_system: str
    capacity: ClusterCapacity
    gpu_speed: float = 1.0
    dataset_sharing: float = 0.0
    manage_io: bool = True


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


@lru_cache(maxsize=8)
def build_trace(source: TraceSource) -> Trace:
    if source.micro:
        return micro_benchmark_trace()
    if source.path is None:
        from traces.synthetic import generate_trace

        n = source.max_jobs or SYNTHETIC_JOBS
        return generate_trace(n, mean_interarrival_s=source.interarrival_s, dataset_sharing=source.sharing, seed=source.seed + 1)
    from traces.loader import TraceFormat, load_trace

    path = Path(source.path)
    if not path.is_file():
        raise UserError(f"trace {path} not found; pass --trace (the Gavel/Philly traces live in ../shared/traces/gavel-msr)")
    return load_trace(path, TraceFormat.auto, source.sharing, source.max_jobs, source.seed)


@dataclass(frozen=True)
class RunResult:
    run: Run
    summary: dict
    fairness: tuple[tuple[float, float], ...]  # (time s, Eq. 8 ratio) per timeline row


def simulate_run(run: Run, source: TraceSource, round_s: float, resolution: int) -> RunResult:
    """One simulation (runs in a worker process)."""
    from policies.registry import estimator_for, get_policy
    from scheduler.backends.sim.engine import SimConfig, Simulator
    from scheduler.backends.sim.report import summarize

    trace = build_trace(replace(source, sharing=run.dataset_sharing) if not source.micro else source)
    config = SimConfig(round_s=round_s, resolution=resolution, gpu_speed=run.gpu_speed, seed=source.seed, manage_io=run.manage_io)
    result = Simulator(trace, run.capacity, get_policy(run.policy), estimator_for(run.cache_system), run.cache_system, config).run()
    summary = summarize(result, run.policy, run.cache_system)
    fairness = tuple((row.time_s, row.fairness_ratio) for row in result.timeline if row.fairness_ratio == row.fairness_ratio)
    return RunResult(run, summary, fairness)


class ExperimentRunner:
    """Runs an experiment's simulations on worker processes, with one progress display."""

    def __init__(self, trace_path: Path | None, max_jobs: int | None, seed: int, round_s: float, resolution: int,
                 show_progress: bool = True, workers: int | None = None):
        self.source = TraceSource(str(trace_path) if trace_path is not None else None, max_jobs, seed)
        self.round_s = round_s
        self.resolution = resolution
        self.show_progress = show_progress
        self.workers = max(1, workers if workers is not None else min(2, os.cpu_count() or 1))

    def trace(self, sharing: float = 0.0) -> Trace:
        return build_trace(replace(self.source, sharing=sharing))

    def for_sweeps(self) -> ExperimentRunner:
        """The same runner on the sweeps' trace (SWEEP_JOBS at SWEEP_INTERARRIVAL_S), unless the
        user chose the trace or its length."""
        if self.source.path is not None or self.source.max_jobs is not None:
            return self
        sweeps = ExperimentRunner(None, SWEEP_JOBS, self.source.seed, self.round_s, self.resolution, self.show_progress, self.workers)
        sweeps.source = replace(sweeps.source, interarrival_s=SWEEP_INTERARRIVAL_S)
        return sweeps

    def describe(self, capacity: ClusterCapacity, sharing: float = 0.0) -> str:
        """Cluster and trace, for figure titles."""
        trace = self.trace(sharing)
        origin = (Path(self.source.path).name if self.source.path
                  else f"synthetic Philly-distribution trace (mean inter-arrival {self.source.interarrival_s:g} s)")
        return (f"{capacity.gpus} GPUs, {capacity.cache / TB:g} TB cache, {capacity.remote_io / GB:g} GB/s remote IO; "
                f"{origin}, {len(trace)} jobs")

    def run_all(self, runs: list[Run], micro: bool = False) -> list[RunResult]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        source = replace(self.source, micro=True) if micro else self.source
        if not micro:
            self.trace()  # fail here, with the user's error, before starting workers
        results: dict[int, RunResult] = {}
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not self.show_progress, transient=True) as bar:
            task = bar.add_task("simulations", total=len(runs))
            if self.workers == 1 or len(runs) == 1:
                for i, run in enumerate(runs):
                    bar.update(task, description=run.label)
                    results[i] = simulate_run(run, source, self.round_s, self.resolution)
                    bar.advance(task)
            else:
                with ProcessPoolExecutor(max_workers=self.workers) as pool:
                    futures = {pool.submit(simulate_run, run, source, self.round_s, self.resolution): i for i, run in enumerate(runs)}
                    for future in as_completed(futures):
                        results[futures[future]] = future.result()
                        bar.update(task, description=f"done: {runs[futures[future]].label}")
                        bar.advance(task)
        return [results[i] for i in range(len(runs))]


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


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def _best_baseline(table: dict, policy: str, key: str = "avg_jct_s") -> tuple[str, float]:
    name = min(BASELINES, key=lambda c: table[f"{policy}/{c}"][key])
    return name, table[f"{policy}/{name}"][key]


#: SiloD §7.2 gives no per-policy numbers for Fig. 12, only: up to 7.4x on average JCT and
#: 2.57x on makespan over the baselines, and up to 1.25x (JCT) / 1.31x (makespan) over Quiver.
PAPER_FIG12 = "paper: up to 7.4x over any baseline, up to 1.25x over Quiver"


def experiment_matrix(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    policies = ("fifo", "sjf", "gavel")
    runs = [Run(f"{p}/{c}", p, c, capacity) for p in policies for c in CACHE_SYSTEMS]
    table = {f"{r.run.policy}/{r.run.cache_system}": r.summary for r in runner.run_all(runs)}
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.2
    for ax, key, title in ((axes[0], "avg_jct_s", "average JCT (h)"), (axes[1], "makespan_s", "makespan (h)")):
        for i, system in enumerate(CACHE_SYSTEMS):
            vals = [table[f"{p}/{system}"][key] / 3600 for p in policies]
            ax.bar([x + i * width for x in range(len(policies))], vals, width, label=system)
        ax.set_xticks([x + 1.5 * width for x in range(len(policies))], [p.upper() for p in policies])
        ax.set_ylim(bottom=0)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"Fig. 12: policies x cache systems\n{runner.describe(capacity)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "matrix.png", dpi=120)
    plt.close(fig)
    headline = []
    for p in policies:
        name, best = _best_baseline(table, p)
        ours = table[f"{p}/silod"]["avg_jct_s"]
        headline.append((f"{p.upper()}: SiloD avg JCT vs best baseline ({name})",
                         f"{_hours(ours)} vs {_hours(best)} = {best / ours:.2f}x"))
    headline.append(("Fig. 12 in the paper", PAPER_FIG12))
    payload = {"experiment": "matrix", "setup": runner.describe(capacity), "runs": table, "headline": headline}
    _save(out, "matrix", payload)
    return payload


PAPER_FIG13 = {"silod": 2.56, "coordl": 1.51, "alluxio": 1.39, "quiver": 1.35}
FAIRNESS_DEFINITION = (
    "Eq. 8: at every step, min over active jobs of perf(j, R_j) / perf(j, R_equal); perf(j, R_j) is the job's share of GPU "
    "time times the throughput it reads at while running; R_equal divides GPUs, cache and remote IO equally among the "
    "active jobs (SiloDPerf); avg = time average"
)


def experiment_fairness(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    runs = [Run(f"gavel/{c}", "gavel", c, capacity) for c in CACHE_SYSTEMS]
    runs.append(Run("gavel/silod, remote IO not allocated", "gavel", "silod", capacity, manage_io=False))
    results = runner.run_all(runs)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    averages = {}
    for r in results:
        key = r.run.cache_system if r.run.manage_io else "silod (IO not allocated)"
        averages[key] = r.summary["avg_fairness_ratio"]
        ax.plot([t / 86400 for t, _ in r.fairness], [v for _, v in r.fairness], label=f"{key} (avg {averages[key]:.2f})", lw=0.8)
    ax.set_xlabel("time (days)")
    ax.set_ylabel("fairness ratio (Eq. 8)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Fig. 13: fairness over time under Gavel\n{runner.describe(capacity)}", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, FAIRNESS_DEFINITION, fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out / "fairness.png", dpi=120)
    plt.close(fig)
    drop = 1 - averages["silod (IO not allocated)"] / averages["silod"] if averages["silod"] > 0 else float("nan")
    headline = [(f"Gavel fairness ratio, {k}", f"{v:.2f} (paper {PAPER_FIG13[k]:.2f})" if k in PAPER_FIG13 else f"{v:.2f}") for k, v in averages.items()]
    headline.append(("fairness drop when remote IO is not allocated", f"{drop:.0%} (paper 31%, to 1.94)"))
    payload = {"experiment": "fairness", "setup": runner.describe(capacity), "definition": FAIRNESS_DEFINITION,
               "avg_fairness_ratio": averages, "paper": PAPER_FIG13, "io_not_allocated_drop": drop,
               "jct_s": {k: r.summary["avg_jct_s"] for k, r in zip(averages, results, strict=True)}, "headline": headline}
    _save(out, "fairness", payload)
    return payload


def _sweep(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity, experiment: str, x_key: str, xs: list[float],
           runs: list[Run], series_of: Callable[[Run], str], title: str, xlabel: str, sharing: float = 0.0) -> dict:
    """Run a sweep (runs ordered x-major), plot average JCT per series over x, save the JSON."""
    runner = runner.for_sweeps()
    series: dict[str, list[float]] = {}
    for r in runner.run_all(runs):
        series.setdefault(series_of(r.run), []).append(r.summary["avg_jct_s"])
    name = experiment.replace("-", "_")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ys in series.items():
        ax.plot(xs, [y / 3600 for y in ys], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("average JCT (h)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title}\n{runner.describe(capacity, sharing)}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    payload = {"experiment": experiment, "setup": runner.describe(capacity, sharing), x_key: xs, "avg_jct_s": series}
    _save(out, name, payload)
    return payload


def experiment_bandwidth(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    rates = [1.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    runs = [Run(f"fifo/{c} @ {r:g} GB/s", "fifo", c, replace(capacity, remote_io=r * GB)) for r in rates for c in ("silod", "alluxio")]
    payload = _sweep(runner, out, capacity, "bandwidth", "remote_io_gb_s", rates, runs, lambda r: r.cache_system,
                     "Fig. 14a: FIFO, remote IO bandwidth (cluster IO varied)", "remote IO (GB/s)")
    s, a = payload["avg_jct_s"]["silod"], payload["avg_jct_s"]["alluxio"]
    payload["headline"] = [(f"FIFO at {r:g} GB/s: alluxio / silod avg JCT", f"{y / x:.2f}x") for r, x, y in zip(rates, s, a, strict=True)]
    _save(out, "bandwidth", payload)
    return payload


def experiment_gpu_speed(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    speeds = [1.0, 2.0, 3.0, 4.0]
    # The paper compares with Quiver, its best baseline under Gavel (§7.2).
    runs = [Run(f"gavel/{c} x{s:g}", "gavel", c, capacity, gpu_speed=s) for s in speeds for c in ("silod", "quiver")]
    payload = _sweep(runner, out, capacity, "gpu-speed", "gpu_speed", speeds, runs, lambda r: r.cache_system,
                     "Fig. 14b: Gavel, GPU speed (every job's f* scaled)", "GPU speed (x V100)")
    series = payload["avg_jct_s"]
    headline = []
    for i, s in enumerate(speeds):
        headline.append((f"Gavel x{s:g}: quiver / silod avg JCT", f"{series['quiver'][i] / series['silod'][i]:.2f}x"
                         + (" (paper 2.17x)" if s == 4.0 else "")))
    payload["headline"] = headline
    _save(out, "gpu_speed", payload)
    return payload


def experiment_sharing(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0]
    runs = [Run(f"{p}/silod sharing {f:g}", p, "silod", capacity, dataset_sharing=f) for f in fractions for p in ("fifo", "sjf", "gavel")]
    payload = _sweep(runner, out, capacity, "sharing", "fractions", fractions, runs, lambda r: r.policy,
                     "Fig. 15: dataset sharing (SiloD)", "fraction of jobs sharing datasets")
    payload["headline"] = [(f"{p.upper()} avg JCT, sharing 0 -> 1", f"{_hours(ys[0])} -> {_hours(ys[-1])} ({ys[0] / ys[-1]:.2f}x)")
                           for p, ys in payload["avg_jct_s"].items()]
    _save(out, "sharing", payload)
    return payload


PAPER_TABLE6_MIN = {  # SiloD Table 6, real V100 runs, minutes
    "silod": {"avg_jct": 3366, "makespan": 3807},
    "coordl": {"avg_jct": 4278, "makespan": 4870},
    "alluxio": {"avg_jct": 4378, "makespan": 5080},
    "quiver": {"avg_jct": 3609, "makespan": 3933},
}


def experiment_micro(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity | None = None) -> dict:
    cap = ClusterCapacity(gpus=8, cache=2 * TB, remote_io=200 * MB, gpus_per_node=4)
    runs = [Run(f"fifo/{c}", "fifo", c, cap) for c in CACHE_SYSTEMS]
    payload = {"experiment": "micro", "setup": "8 V100s, 2 TB cache, 200 MB/s remote IO; SiloD §7.1.1 micro-benchmark, 5 jobs",
               "ours_min": {}, "paper_min": PAPER_TABLE6_MIN}
    for r in runner.run_all(runs, micro=True):
        payload["ours_min"][r.run.cache_system] = {"avg_jct": r.summary["avg_jct_s"] / 60, "makespan": r.summary["makespan_s"] / 60}
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key in zip(axes, ("avg_jct", "makespan"), strict=True):
        xs = range(len(CACHE_SYSTEMS))
        ax.bar([x - 0.2 for x in xs], [payload["ours_min"][c][key] for c in CACHE_SYSTEMS], 0.4, label="silod simulator")
        ax.bar([x + 0.2 for x in xs], [PAPER_TABLE6_MIN[c][key] for c in CACHE_SYSTEMS], 0.4, label="paper (real V100)")
        ax.set_xticks(list(xs), CACHE_SYSTEMS)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{key.replace('_', ' ')} (min)")
    axes[0].legend()
    fig.suptitle(f"Table 6: micro-benchmark\n{payload['setup']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "micro.png", dpi=120)
    plt.close(fig)
    payload["headline"] = [(f"{c}: avg JCT / makespan (min)", f"{v['avg_jct']:.0f} / {v['makespan']:.0f} (paper {PAPER_TABLE6_MIN[c]['avg_jct']} / {PAPER_TABLE6_MIN[c]['makespan']})")
                           for c, v in payload["ours_min"].items()]
    _save(out, "micro", payload)
    return payload


EXPERIMENTS: dict[str, Callable] = {
    "matrix": experiment_matrix,
    "fairness": experiment_fairness,
    "bandwidth": experiment_bandwidth,
    "gpu-speed": experiment_gpu_speed,
    "sharing": experiment_sharing,
    "micro": experiment_micro,
}
