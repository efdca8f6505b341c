"""The paper's experiments (§7), each a set of simulations, a JSON file and a PNG plot.

    matrix      Fig. 12: FIFO, SJF, Gavel x silod, alluxio, coordl, quiver (400 GPUs, 4 GB/s)
    fairness    Fig. 13: Eq. 8 fairness ratio over time under Gavel, the four cache systems,
                and SiloD with its remote-IO allocation not enforced
    bandwidth   Fig. 14a: FIFO, silod vs alluxio, remote IO from 1 to 10 GB/s
    gpu-speed   Fig. 14b: Gavel, silod vs quiver (the paper's best baseline), GPUs 1x to 4x faster
    sharing     Fig. 15: FIFO, SJF, Gavel on silod, fraction of jobs sharing datasets 0..1
    quiver-noise  Quiver's sensitivity to the error of its online profiles (sigma 0, 0.1, 0.25)
                under FIFO, SJF and Gavel, beside SiloD (not a figure of the paper)
    micro       Table 6: the 8-V100 micro-benchmark (5 jobs, 2 TB cache, 200 MB/s)
    curriculum  Fig. 16: curriculum learning, (a) the pacing functions at Step 50k and 75k,
                (b) uniform vs LRU caching of one ResNet-50 job on ImageNet-22k, 5 repeats
    irregular-mix  §6: 0-50% curriculum jobs in the trace; the two partitions vs planning every
                job as regular vs everything under LRU, regular and irregular JCT apart
    stagger     issue 22 (cache-aware staggering, HiPC'23 Fig. 3): ResNet-50 and EfficientNet-B1 on
                one dataset, the second started X% of the first's standalone runtime later;
                makespan over X, silod and alluxio caching
    cpu         issue 22: a CPU-constrained cluster (2 and 3 cores per GPU), image and text
                models mixed with the catalog's per-core rates (Plumber); each policy with its
                4-resource allocation (cores by the estimator) vs GPU-proportional cores

A library: `silod experiment` (scheduler/sim/cli.py) calls it; it imports no CLI code.
Simulations of one experiment run in worker processes; each experiment returns its payload
(also written as JSON) with a `headline` the CLI prints as a table.
"""

from __future__ import annotations

import copy
import json
import os
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from estimator.access import AccessPattern
from estimator.errors import RuntimeFailure, UserError
from policies.types import ClusterCapacity
from scheduler.sim.shards import MergedParts, Shard
from traces.catalog import DATASETS, MODELS
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
    irregular: float = 0.0  # fraction of the jobs turned into curriculum jobs (irregular-mix)
    curriculum_step: int | None = None  # the Fig. 16 single job, with this Step
    catalog_pipelines: bool = False  # give every job its catalog model's CPU stage (experiment cpu)
    stagger: float | None = None  # the stagger experiment's two jobs, the second at this fraction
    window_s: tuple[float, float] | None = None  # alibaba-openb: tasks created in [start, end) s (experiment alibaba)
    autocache_points: bool = False  # image models' pipelines get an autocache point (experiment autocache)


@dataclass(frozen=True)
class Run:
    label: str
    policy: str
    cache_system: str
    capacity: ClusterCapacity
    gpu_speed: float = 1.0
    dataset_sharing: float = 0.0
    manage_io: bool = True
    partition: bool = True  # False: irregular jobs are planned as regular ones
    irregular: float = 0.0  # fraction of curriculum jobs in the trace
    curriculum_step: int | None = None  # Fig. 16: one curriculum job with this Step
    seed: int | None = None  # a repeat's seed (default: the runner's)
    profile_noise: float = 0.0  # quiver: sigma of its profiles' log-normal error
    catalog_pipelines: bool = False  # jobs get their catalog model's cpu_rate (experiment cpu)
    stagger: float | None = None  # experiment stagger: the second job starts at this fraction
    autocache_points: bool = False  # and image models an autocache point (experiment autocache)


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


#: Fig. 16 (§7.4): ResNet-50 on ImageNet-22k with the exponential pacing of Hacohen and
#: Weinshall (starting_percent 0.04, alpha 1.9), batch 256, on 8 V100s. The paper gives neither
#: the job's length nor its cluster; the work is set so that the job takes the paper's ~367 min
#: at ideal speed, and the cluster holds half the dataset in cache with a link below f*.
CURRICULUM_GPUS = 8
CURRICULUM_PACE = dict(starting_percent=0.04, alpha=1.9, batch=256)
CURRICULUM_IDEAL_MIN = 367.0
CURRICULUM_CLUSTER = ClusterCapacity(gpus=8, cache=0.7 * TB, remote_io=400 * MB, gpus_per_node=8)
CURRICULUM_STEPS = (50_000, 75_000)
CURRICULUM_REPEATS = 5


def curriculum_trace(step: int) -> Trace:
    spec = MODELS["resnet50"]
    data = DATASETS[spec.dataset]
    f = spec.ideal_per_gpu * CURRICULUM_GPUS
    passes = CURRICULUM_IDEAL_MIN * 60 * f / data.size
    access = AccessPattern.curriculum_learning(step=step, **CURRICULUM_PACE)
    job = TraceJob("resnet50-curriculum", 0.0, CURRICULUM_GPUS, spec.name, data.name, f, passes, access)
    return Trace((job,), {data.name: data.size}, source=f"SiloD §7.4 curriculum job, Step {step}", item_sizes={data.name: data.item_size})


def with_curriculum_jobs(trace: Trace, fraction: float, seed: int) -> Trace:
    """`fraction` of the jobs (drawn with `seed`) become curriculum jobs: batch 256, starting
    at 4% and growing 1.9x every Step iterations, Step set so that the whole dataset is eligible
    halfway through the job (the pacing reaches it partway through training, as in Hacohen and
    Weinshall). Item sizes: the trace's own (`item_size` column) where it gives one, else the
    catalog dataset's that each job's copy was made from, else ImageNet's 110 KB."""
    if fraction <= 0:
        return trace
    rng = np.random.default_rng(seed + 7)
    chosen = rng.random(len(trace.jobs)) < fraction
    growths = 6  # 0.04 * 1.9^6 >= 1
    jobs, items = [], dict(trace.item_sizes)
    for job, pick in zip(trace.jobs, chosen, strict=True):
        if pick:
            item = items.get(job.dataset)
            if item is None:
                base = DATASETS.get(job.dataset.split("/")[0])
                item = items[job.dataset] = base.item_size if base is not None else 110e3
            iterations = job.total_bytes(trace.dataset_sizes[job.dataset]) / (256 * item)
            step = max(1, int(iterations / (2 * growths)))
            job = replace(job, access=AccessPattern.curriculum_learning(0.04, 1.9, step, 256))
        jobs.append(job)
    return Trace(tuple(jobs), trace.dataset_sizes, trace.source + f", {fraction:.0%} curriculum", trace.notes, items)


def with_catalog_pipelines(trace: Trace) -> Trace:
    """Every job whose model the catalog knows gets the catalog's CPU stage (traces/catalog.py:
    image models Plumber's 35.2 MB/s per core, feature and text models not CPU-bound)."""
    jobs = []
    for job in trace.jobs:
        spec = MODELS.get(job.model)
        jobs.append(replace(job, pipeline=spec.pipeline) if spec is not None and job.pipeline is None else job)
    return Trace(tuple(jobs), trace.dataset_sizes, trace.source + ", catalog CPU rates", trace.notes, trace.item_sizes)


#: The autocache experiment's pipelines: decoded images are about 6x their JPEGs (Plumber §5.4);
#: what remains after the cache point (random crop and flip of a decoded image) is taken to cost
#: a fifth of the whole pipeline per byte -- an assumption: no published per-core rate of the
#: post-decode stage for these pipelines (traces/catalog.py); the docs say so beside the figures.
AUTOCACHE_EXPANSION = 6.0
AUTOCACHE_POST_SPEEDUP = 5.0


def with_autocache_points(trace: Trace) -> Trace:
    """Every job with a CPU stage gets an autocache point after decoding (see above)."""
    from estimator.pipeline import InputPipeline

    jobs = tuple(replace(j, pipeline=InputPipeline(j.pipeline.cpu_rate, AUTOCACHE_EXPANSION, j.pipeline.cpu_rate * AUTOCACHE_POST_SPEEDUP))
                 if j.pipeline is not None and not j.pipeline.autocaches else j for j in trace.jobs)
    return Trace(jobs, trace.dataset_sizes, trace.source + ", autocache points", trace.notes, trace.item_sizes)


@lru_cache(maxsize=8)
def build_trace(source: TraceSource) -> Trace:
    if source.stagger is not None:
        return stagger_trace(source.stagger)
    if source.autocache_points:
        return with_autocache_points(build_trace(replace(source, autocache_points=False)))
    if source.catalog_pipelines:
        return with_catalog_pipelines(build_trace(replace(source, catalog_pipelines=False)))
    if source.curriculum_step is not None:
        return curriculum_trace(source.curriculum_step)
    if source.irregular > 0:
        return with_curriculum_jobs(build_trace(replace(source, irregular=0.0)), source.irregular, source.seed)
    if source.micro:
        return micro_benchmark_trace()
    if source.path is None:
        from traces.synthetic import generate_trace

        n = source.max_jobs or SYNTHETIC_JOBS
        return generate_trace(n, mean_interarrival_s=source.interarrival_s, dataset_sharing=source.sharing, seed=source.seed + 1)
    from traces.loader import TraceFormat, load_trace

    path = Path(source.path)
    if source.window_s is not None:
        from traces.alibaba_trace import load_alibaba_trace

        return load_alibaba_trace(path, dataset_sharing=source.sharing, max_jobs=source.max_jobs, seed=source.seed, window_s=source.window_s)
    if not path.is_file():
        from traces.public import where_to_get

        raise UserError(f"trace {path} not found; {where_to_get()}")
    return load_trace(path, TraceFormat.auto, source.sharing, source.max_jobs, source.seed)


@dataclass(frozen=True)
class RunResult:
    run: Run
    summary: dict
    fairness: tuple[tuple[float, float], ...]  # (time s, Eq. 8 ratio) per timeline row
    jct_by_kind: dict  # "regular" / "irregular" -> average JCT, s (kinds present only)
    queued_until: float = 0.0  # end of the last timeline row with jobs queued (waiting or paused)


def run_trace_source(run: Run, source: TraceSource) -> tuple[TraceSource, int]:
    """The trace a run simulates (its sharing, curriculum and stagger variant of `source`) and
    its seed."""
    seed = source.seed if run.seed is None else run.seed
    if not source.micro:
        source = replace(source, sharing=run.dataset_sharing, irregular=run.irregular, curriculum_step=run.curriculum_step,
                         catalog_pipelines=run.catalog_pipelines, stagger=run.stagger, autocache_points=run.autocache_points)
    return source, seed


def simulate_run(run: Run, source: TraceSource, round_s: float, resolution: int) -> RunResult:
    """One simulation (runs in a worker process, which builds the trace itself)."""
    src, seed = run_trace_source(run, source)
    return simulate_trace(run, build_trace(src), seed, round_s, resolution)


def simulate_trace(run: Run, trace: Trace, seed: int, round_s: float, resolution: int) -> RunResult:
    """One simulation of an already built trace (what a Dask or Ray worker runs on the shipped trace)."""
    from policies.registry import estimator_for, get_policy
    from scheduler.sim.engine import SimConfig, Simulator
    from scheduler.sim.report import summarize

    config = SimConfig(round_s=round_s, resolution=resolution, gpu_speed=run.gpu_speed, seed=seed, manage_io=run.manage_io,
                       partition=run.partition, profile_noise=run.profile_noise)
    result = Simulator(trace, run.capacity, get_policy(run.policy), estimator_for(run.cache_system), run.cache_system, config).run()
    summary = summarize(result, run.policy, run.cache_system)
    fairness = tuple((row.time_s, row.fairness_ratio) for row in result.timeline if row.fairness_ratio == row.fairness_ratio)
    kind = {j.job_id: "regular" if j.access.regular else "irregular" for j in trace.jobs}
    jcts: dict[str, list[float]] = {}
    for record in result.jobs:
        jcts.setdefault(kind[record.job_id], []).append(record.jct_s)
    queued_until = max((row.time_s for row in result.timeline if row.queued_jobs > 0), default=0.0)
    return RunResult(run, summary, fairness, {k: float(np.mean(v)) for k, v in jcts.items()}, queued_until)


@dataclass
class Distribution:
    """How `run_all` of one experiment spreads its runs: this shard's share only (writing a part
    into `out`), results taken from merged parts, or a Dask or Ray cluster (scheduler/sim/shards.py)."""

    experiment: str
    out: Path
    capacity: ClusterCapacity
    shard: Shard | None = None
    merged: MergedParts | None = None
    executor: Executor | None = None


#: The experiments that simulate the sweeps' trace (ExperimentRunner.for_sweeps), and those that
#: build their own small traces per run (nothing of the user's trace to export).
SWEEP_EXPERIMENTS = ("bandwidth", "gpu-speed", "sharing", "quiver-noise", "irregular-mix", "cpu", "autocache")
OWN_TRACE_EXPERIMENTS = ("curriculum", "stagger")


def experiment_trace(name: str, trace_path: Path | None, max_jobs: int | None, seed: int, sharing: float = 0.0,
                     irregular: float = 0.0, catalog_pipelines: bool = False, autocache_points: bool = False) -> Trace:
    """The trace `silod experiment NAME` simulates with these options, for one point of a sweep
    (`sharing`: Fig. 15's x; `irregular`: irregular-mix's x; `catalog_pipelines`: experiment cpu;
    `autocache_points`: experiment autocache's "on")."""
    if name in OWN_TRACE_EXPERIMENTS:
        raise UserError(f"experiment {name} simulates small traces of its own, one per run (scheduler/sim/experiments.py), "
                        "not the --trace; there is no one trace to export")
    runner = ExperimentRunner(trace_path, max_jobs, seed, 360.0, 128, show_progress=False, workers=1)
    if name == "alibaba":
        return build_trace(alibaba_source(runner))
    if name in SWEEP_EXPERIMENTS:
        runner = runner.for_sweeps()
    source = replace(runner.source, micro=name == "micro", sharing=sharing, irregular=irregular, catalog_pipelines=catalog_pipelines,
                     autocache_points=autocache_points)
    return build_trace(source)


def result_to_json(result: RunResult) -> dict:
    """A run's result as a shard's part stores it (JSON keeps every float exactly)."""
    return {"run": asdict(result.run), "summary": result.summary, "fairness": [list(p) for p in result.fairness],
            "jct_by_kind": result.jct_by_kind, "queued_until": result.queued_until}


def result_from_json(data: dict) -> RunResult:
    run = Run(**{**data["run"], "capacity": ClusterCapacity(**data["run"]["capacity"])})
    return RunResult(run, data["summary"], tuple((float(t), float(v)) for t, v in data["fairness"]), data["jct_by_kind"],
                     float(data["queued_until"]))


#: What a Dask or Ray cluster is to silod (issue 47): both run any Python a client sends them, and
#: the silod client unpickles what they send back (Dask's and Ray's protocols deserialise pickled
#: frames whatever the result's type: a hostile scheduler or worker runs code in the client). So
#: the cluster is trusted both ways, and a cluster anyone on the network reaches is remote code
#: execution for anyone: silod refuses a non-loopback address unless its transport is TLS (Dask:
#: tls://, with certificates in Dask's configuration; Ray: RAY_USE_TLS=1, mutual TLS) or the
#: operator says --insecure-cluster. Ray has no authentication of its own: TLS certificates are
#: the only thing that keeps a stranger's driver out.
INSECURE_HELP = ("Dask and Ray run any client's Python and silod unpickles what they return: use tls:// with"
                 " certificates (Dask: distributed.comm.tls.* in its configuration), an SSH tunnel to a scheduler"
                 " bound to 127.0.0.1, or for Ray RAY_USE_TLS=1 with its certificates; on a private network"
                 " that only you reach, say --insecure-cluster (docs/simulator.md, \"Sweeps on Dask or Ray\")")


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere, so it is not taken for loopback


def check_cluster_address(kind: str, address: str, insecure: bool = False) -> None:
    """Refuse `--dask`/`--ray ADDRESS` that is neither loopback nor TLS, unless `insecure`."""
    from urllib.parse import urlsplit

    parsed = urlsplit(address if "://" in address else f"//{address}")
    scheme = (parsed.scheme or ("tcp" if kind == "dask" else "")).lower()
    try:
        host, port = parsed.hostname or "", parsed.port
    except ValueError:
        host, port = "", None
    if kind == "ray" and (not host or port is None):
        # A malformed address is named as such before any question of where it points.
        raise UserError(f"--ray {address!r} is not HOST:PORT; give the address `ray start --head` prints, e.g. --ray 127.0.0.1:6379")
    if not host:
        raise UserError(f"--{kind} {address!r} names no host; e.g. --{kind} "
                        + ("tls://scheduler.example:8786" if kind == "dask" else "127.0.0.1:6379"))
    if kind == "dask":
        tls = scheme in ("tls", "wss")
        if scheme == "inproc":
            return
    else:
        tls = os.environ.get("RAY_USE_TLS", "").strip().lower() in ("1", "true")
    if _is_loopback(host) or tls or insecure:
        return
    what = "not tls://" if kind == "dask" else "RAY_USE_TLS is not set (Ray has no authentication of its own)"
    raise UserError(f"--{kind} {address}: {host} is not a loopback address and {what}; {INSECURE_HELP}")


@dataclass(frozen=True)
class Executor:
    """A cluster that runs the simulations instead of local worker processes: `--dask ADDRESS`
    or `--ray ADDRESS`. Both go through `run_on_cluster`; only connecting, shipping a trace,
    submitting a run and collecting results differ (`_DaskSession`, `_RaySession`). The address
    is checked (check_cluster_address) before anything connects."""

    kind: str  # "dask" | "ray"
    address: str
    insecure: bool = False  # --insecure-cluster: the operator vouches for the network

    def __post_init__(self) -> None:
        check_cluster_address(self.kind, self.address, self.insecure)

    def __str__(self) -> str:
        return f"--{self.kind} {self.address}"


class _DaskSession:
    """A dask.distributed client: the trace is scattered to every worker, runs are futures."""

    def __init__(self, address: str, connect_timeout_s: float, workers_timeout_s: float):
        try:
            from distributed import Client
        except ImportError:
            raise UserError("--dask needs dask.distributed; install it with pip install 'silod[dask]'") from None
        try:
            self.client = Client(address, timeout=f"{connect_timeout_s:g}s", set_as_default=False)
        except (OSError, TimeoutError) as exc:
            raise RuntimeFailure(f"cannot reach the Dask scheduler at {address} ({exc}); start one with `dask scheduler` "
                                 "and give its address, e.g. --dask tcp://127.0.0.1:8786") from None
        try:
            self.client.wait_for_workers(1, timeout=workers_timeout_s)
        except TimeoutError:
            self.client.close()
            raise RuntimeFailure(f"the Dask scheduler at {address} has no workers after {workers_timeout_s:g} s; "
                                 "start some with `dask worker ADDRESS --nthreads 1`") from None

    def ship(self, trace: Trace):
        return self.client.scatter(trace, broadcast=True)

    def submit(self, run: Run, trace, seed: int, round_s: float, resolution: int):
        return self.client.submit(simulate_trace, run, trace, seed, round_s, resolution, pure=False)

    def completed(self, futures: list) -> Iterator[tuple[object, RunResult]]:
        from distributed import as_completed as dask_completed

        for future in dask_completed(futures, loop=self.client.loop):
            yield future, future.result()

    def close(self) -> None:
        self.client.close()


class _RaySession:
    """A driver attached to a running Ray cluster (`ray start --head` prints the address): the
    trace goes into the object store once (`ray.put`), runs are remote tasks of one CPU."""

    def __init__(self, address: str, connect_timeout_s: float, workers_timeout_s: float):
        import socket
        from urllib.parse import urlsplit

        parsed = urlsplit(address if "://" in address else f"//{address}")
        try:
            host, port = parsed.hostname, parsed.port
        except ValueError:
            host = port = None
        if not host or port is None:
            raise UserError(f"--ray {address!r} is not HOST:PORT; give the address `ray start --head` prints, e.g. --ray 127.0.0.1:6379")
        # Probe first: Ray retries an unreachable cluster without end, printing a warning every few seconds.
        try:
            socket.create_connection((host, port), timeout=connect_timeout_s).close()
        except OSError as exc:
            raise RuntimeFailure(f"cannot reach the Ray cluster at {address} ({exc}); start one with `ray start --head` "
                                 "and give the address it prints, e.g. --ray 127.0.0.1:6379") from None
        if host in ("127.0.0.1", "localhost", "::1"):
            # Ray on Linux replaces a loopback address by the machine's outward IP (to reach other
            # nodes); a cluster on one machine started with this same variable listens on loopback only.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise UserError("--ray needs Ray; install it with pip install 'silod[ray]'") from None
        self.ray = ray
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=True)
        except (ConnectionError, OSError, TimeoutError, ValueError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeFailure(f"cannot connect to the Ray cluster at {address} ({first}); give the address "
                                 "`ray start --head` prints, e.g. --ray 127.0.0.1:6379") from None
        deadline = time.monotonic() + workers_timeout_s
        while ray.cluster_resources().get("CPU", 0) < 1:
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeFailure(f"the Ray cluster at {address} has no CPUs after {workers_timeout_s:g} s; "
                                     "start nodes with `ray start --address ADDRESS --num-cpus N`")
            time.sleep(0.5)
        self.task = ray.remote(num_cpus=1)(simulate_trace)

    def ship(self, trace: Trace):
        return self.ray.put(trace)

    def submit(self, run: Run, trace, seed: int, round_s: float, resolution: int):
        return self.task.remote(run, trace, seed, round_s, resolution)  # the ObjectRef arrives as the trace

    def completed(self, futures: list) -> Iterator[tuple[object, RunResult]]:
        pending = list(futures)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1)
            yield ready[0], self.ray.get(ready[0])

    def close(self) -> None:
        self.ray.shutdown()  # ends this driver's job; the cluster keeps running


def run_on_cluster(executor: Executor, jobs: list[tuple[int, Run]], source: TraceSource, round_s: float, resolution: int,
                   connect_timeout_s: float = 10.0, workers_timeout_s: float = 60.0) -> Iterator[tuple[int, RunResult]]:
    """Run `jobs` on the executor's cluster; yields (index, result) as they finish. Every
    distinct trace the runs need is built here once and shipped to the cluster, so the workers
    need silod installed (the same version) but not the trace file."""
    sessions = {"dask": _DaskSession, "ray": _RaySession}
    session = sessions[executor.kind](executor.address, connect_timeout_s, workers_timeout_s)
    try:
        shipped: dict = {}
        futures = {}
        for i, run in jobs:
            src, seed = run_trace_source(run, source)
            if src not in shipped:
                shipped[src] = session.ship(build_trace(src))
            futures[session.submit(run, shipped[src], seed, round_s, resolution)] = i
        for future, result in session.completed(list(futures)):
            yield futures[future], result
    finally:
        session.close()


class ExperimentRunner:
    """Runs an experiment's simulations on worker processes (or a Dask or Ray cluster, or one shard of
    them), with one progress display."""

    def __init__(self, trace_path: Path | None, max_jobs: int | None, seed: int, round_s: float, resolution: int,
                 show_progress: bool = True, workers: int | None = None):
        self.source = TraceSource(str(trace_path) if trace_path is not None else None, max_jobs, seed)
        self.round_s = round_s
        self.resolution = resolution
        self.show_progress = show_progress
        self.workers = max(1, workers if workers is not None else min(2, os.cpu_count() or 1))
        #: What the user asked for, recorded in a shard's part so that --merge rebuilds the run list.
        self.config = {"trace": self.source.path, "max_jobs": max_jobs, "seed": seed, "round_s": round_s, "resolution": resolution}
        self.distribution: Distribution | None = None

    @classmethod
    def from_parts(cls, merged: MergedParts, out: Path, show_progress: bool = True) -> tuple[ExperimentRunner, ClusterCapacity]:
        """The runner (and cluster) the parts were computed with, serving their results."""
        c = merged.config
        trace = Path(c["trace"]) if c["trace"] is not None else None
        runner = cls(trace, c["max_jobs"], c["seed"], c["round_s"], c["resolution"], show_progress, workers=1)
        capacity = ClusterCapacity(**c["capacity"])
        runner.distribution = Distribution(merged.experiment, out, capacity, merged=merged)
        return runner, capacity

    def trace(self, sharing: float = 0.0) -> Trace:
        return build_trace(replace(self.source, sharing=sharing))

    def for_sweeps(self) -> ExperimentRunner:
        """The same runner on the sweeps' trace (SWEEP_JOBS at SWEEP_INTERARRIVAL_S), unless the
        user chose the trace or its length."""
        if self.source.path is not None or self.source.max_jobs is not None:
            return self
        sweeps = copy.copy(self)
        sweeps.source = replace(self.source, max_jobs=SWEEP_JOBS, interarrival_s=SWEEP_INTERARRIVAL_S)
        return sweeps

    def describe(self, capacity: ClusterCapacity, sharing: float = 0.0, io_varied: bool = False) -> str:
        """Cluster and trace, for figure titles (`io_varied`: the plot's x axis is the remote IO)."""
        merged = self.distribution.merged if self.distribution is not None else None
        # When merging, the parts say how long the trace was: the trace file may not be here.
        jobs = merged.trace_jobs if merged is not None else len(self.trace(sharing))
        origin = (Path(self.source.path).name if self.source.path
                  else f"synthetic Philly-distribution trace (mean inter-arrival {self.source.interarrival_s:g} s)")
        io = "remote IO on the x axis" if io_varied else f"{capacity.remote_io / GB:g} GB/s remote IO"
        return f"{capacity.gpus} GPUs, {capacity.cache / TB:g} TB cache, {io}; {origin}, {jobs} jobs"

    def run_all(self, runs: list[Run], micro: bool = False) -> list[RunResult]:
        """The results of `runs`, in order. In shard mode this runs the shard's share, writes the
        part and raises ShardWritten (the plots need every part); when merging it runs nothing."""
        from scheduler.sim.shards import ShardWritten, fingerprint, trace_digest, write_part

        source = replace(self.source, micro=True) if micro else self.source
        dist = self.distribution
        if dist is not None and dist.merged is not None:
            merged = dist.merged
            if fingerprint(dist.experiment, asdict(source), self.round_s, self.resolution, [asdict(r) for r in runs],
                           merged.trace_digest) != merged.fingerprint:
                raise UserError(f"the parts of {dist.experiment} ({', '.join(map(str, merged.paths))}) were written for another run list "
                                "than this silod builds from their configuration (another silod version?); rerun the shards with this one")
            results = [result_from_json(merged.results[i]) for i in range(len(runs))]
            for i, (run, r) in enumerate(zip(runs, results, strict=True)):
                if r.run != run:  # the fingerprint covers it; a hand-edited part might not
                    raise UserError(f"run {i} of {dist.experiment} in the parts is {r.run.label!r}, expected {run.label!r}")
            return results
        base = build_trace(source)  # fail here, with the user's error, before starting workers
        picks = list(range(len(runs))) if dist is None or dist.shard is None else dist.shard.picks(len(runs))
        results = self._execute([(i, runs[i]) for i in picks], source, None if dist is None else dist.executor)
        if dist is not None and dist.shard is not None:
            digest = trace_digest(base)
            config = {**self.config, "capacity": asdict(dist.capacity)}
            fp = fingerprint(dist.experiment, asdict(source), self.round_s, self.resolution, [asdict(r) for r in runs], digest)
            path = write_part(dist.out, dist.experiment, dist.shard, fp, config, len(base), digest, len(runs),
                              {i: result_to_json(r) for i, r in results.items()})
            raise ShardWritten(path, len(picks), len(runs))
        return [results[i] for i in range(len(runs))]

    def _execute(self, jobs: list[tuple[int, Run]], source: TraceSource, executor: Executor | None) -> dict[int, RunResult]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        results: dict[int, RunResult] = {}
        labels = dict(jobs)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not self.show_progress, transient=True) as bar:
            task = bar.add_task("simulations", total=len(jobs))

            def done(i: int, result: RunResult) -> None:
                results[i] = result
                bar.update(task, description=f"done: {labels[i].label}")
                bar.advance(task)

            if executor is not None:
                for i, result in run_on_cluster(executor, jobs, source, self.round_s, self.resolution):
                    done(i, result)
            elif self.workers == 1 or len(jobs) <= 1:
                for i, run in jobs:
                    bar.update(task, description=run.label)
                    done(i, simulate_run(run, source, self.round_s, self.resolution))
            else:
                with ProcessPoolExecutor(max_workers=self.workers) as pool:
                    futures = {pool.submit(simulate_run, run, source, self.round_s, self.resolution): i for i, run in longest_first(jobs)}
                    for future in as_completed(futures):
                        done(futures[future], future.result())
        return results


def longest_first(jobs: list[tuple[int, Run]]) -> list[tuple[int, Run]]:
    """`jobs` in the order to hand them to workers: the costliest first (longest processing time
    first), so that no long run starts last while the other workers sit idle. On the Fig. 12
    matrix (2026-11-29, CPU s per run) an LRU cell costs 2-3x a uniform one (Alluxio 32-42 s,
    the others 11-23 s) and a time-sharing policy's about 1.5x (Gavel 18-42 s, FIFO/SJF 11-33 s);
    in the matrix's own order Gavel/Alluxio, the longest, started ninth of twelve. Results are
    kept by index, so the order changes only when each run finishes."""
    from policies.registry import get_policy
    from scheduler.sim.cache_systems import AlluxioLRUCache

    def cost(run: Run) -> float:
        return (2.5 if run.cache_system == AlluxioLRUCache.name else 1.0) * (1.5 if get_policy(run.policy).time_sharing else 1.0)

    return sorted(jobs, key=lambda job: -cost(job[1]))


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


def _policy_matrix_figure(table: dict, policies: tuple[str, ...], path: Path, title: str, fontsize: int) -> list:
    """Fig. 12's bars (average JCT and makespan per policy and cache system) saved to `path`,
    and the headline rows: SiloD against the best baseline under each policy."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.2
    for ax, key, label in ((axes[0], "avg_jct_s", "average JCT (h)"), (axes[1], "makespan_s", "makespan (h)")):
        for i, system in enumerate(CACHE_SYSTEMS):
            vals = [table[f"{p}/{system}"][key] / 3600 for p in policies]
            ax.bar([x + i * width for x in range(len(policies))], vals, width, label=system)
        ax.set_xticks([x + 1.5 * width for x in range(len(policies))], [p.upper() for p in policies])
        ax.set_ylim(bottom=0)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    headline = []
    for p in policies:
        name, best = _best_baseline(table, p)
        ours = table[f"{p}/silod"]["avg_jct_s"]
        headline.append((f"{p.upper()}: SiloD avg JCT vs best baseline ({name})", f"{_hours(ours)} vs {_hours(best)} = {best / ours:.2f}x"))
    return headline


def experiment_matrix(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    policies = ("fifo", "sjf", "gavel")
    runs = [Run(f"{p}/{c}", p, c, capacity) for p in policies for c in CACHE_SYSTEMS]
    table = {f"{r.run.policy}/{r.run.cache_system}": r.summary for r in runner.run_all(runs)}
    headline = _policy_matrix_figure(table, policies, out / "matrix.png",
                                     f"Fig. 12: policies x cache systems\n{runner.describe(capacity)}", 10)
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


def window_average(series: tuple[tuple[float, float], ...], end_s: float) -> float:
    """Time average over [0, end_s] of a timeline series whose rows each hold the average over
    the interval since the previous row (weighted by the part of each interval inside)."""
    area = span = 0.0
    prev = 0.0
    for t, v in series:
        inside = min(t, end_s) - prev
        if inside > 0 and v == v:
            area += v * inside
            span += inside
        prev = t
        if t >= end_s:
            break
    return area / span if span > 0 else float("nan")


def experiment_fairness(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    """Fig. 13. Each system's average is taken over one common window, from the start to the
    first time any system's queue empties for good (`queued_until`): past it that system's
    metric is that of an uncongested tail, so averaging each run over its own length compares
    runs of different lengths (the whole-run averages are kept in the JSON)."""
    runs = [Run(f"gavel/{c}", "gavel", c, capacity) for c in CACHE_SYSTEMS]
    runs.append(Run("gavel/silod, remote IO not allocated", "gavel", "silod", capacity, manage_io=False))
    results = runner.run_all(runs)
    window = min(r.queued_until for r in results)
    window_what = "every system still has queued jobs"
    if window <= 0:  # some system never queued (a light trace): the span every run covers
        window = min(max((t for t, _ in r.fairness), default=0.0) for r in results)
        window_what = "no queue in some system: the shortest run"
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    averages, whole_run = {}, {}
    for r in results:
        key = r.run.cache_system if r.run.manage_io else "silod (IO not allocated)"
        averages[key] = window_average(r.fairness, window)
        whole_run[key] = r.summary["avg_fairness_ratio"]
        ax.plot([t / 86400 for t, _ in r.fairness], [v for _, v in r.fairness], label=f"{key} (avg {averages[key]:.2f})", lw=0.8)
    ax.axvline(window / 86400, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("time (days)")
    ax.set_ylabel("fairness ratio (Eq. 8)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Fig. 13: fairness over time under Gavel\naverages over the common window 0-{window / 86400:.1f} days "
                 f"({window_what}; dashed line)\n" + textwrap.fill(runner.describe(capacity), 120), fontsize=9)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, FAIRNESS_DEFINITION, fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out / "fairness.png", dpi=120)
    plt.close(fig)
    drop = 1 - averages["silod (IO not allocated)"] / averages["silod"] if averages["silod"] > 0 else float("nan")
    headline = [(f"Gavel fairness ratio, {k} (0-{window / 86400:.1f} days)", f"{v:.2f} (whole run {whole_run[k]:.2f}; paper {PAPER_FIG13[k]:.2f})"
                 if k in PAPER_FIG13 else f"{v:.2f} (whole run {whole_run[k]:.2f})") for k, v in averages.items()]
    headline.append(("fairness drop when remote IO is not allocated", f"{drop:.0%} (paper 31%, to 1.94)"))
    payload = {"experiment": "fairness", "setup": runner.describe(capacity), "definition": FAIRNESS_DEFINITION,
               "window_s": window, "window": window_what, "avg_fairness_ratio": averages, "avg_fairness_ratio_whole_run": whole_run,
               "queued_until_s": {k: r.queued_until for k, r in zip(averages, results, strict=True)},
               "paper": PAPER_FIG13, "io_not_allocated_drop": drop,
               "jct_s": {k: r.summary["avg_jct_s"] for k, r in zip(averages, results, strict=True)}, "headline": headline}
    _save(out, "fairness", payload)
    return payload


def _sweep(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity, experiment: str, x_key: str, xs: list[float],
           runs: list[Run], series_of: Callable[[Run], str], title: str, xlabel: str, sharing: float = 0.0,
           io_varied: bool = False) -> dict:
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
    setup = runner.describe(capacity, sharing, io_varied)
    # Wrapped: on one line the setup ran past both edges of a 7-inch figure.
    ax.set_title(f"{title}\n" + textwrap.fill(setup, 80), fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    payload = {"experiment": experiment, "setup": setup, x_key: xs, "avg_jct_s": series}
    _save(out, name, payload)
    return payload


def experiment_bandwidth(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    rates = [1.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    runs = [Run(f"fifo/{c} @ {r:g} GB/s", "fifo", c, replace(capacity, remote_io=r * GB)) for r in rates for c in ("silod", "alluxio")]
    payload = _sweep(runner, out, capacity, "bandwidth", "remote_io_gb_s", rates, runs, lambda r: r.cache_system,
                     "Fig. 14a: FIFO, remote IO bandwidth (cluster IO varied)", "remote IO (GB/s)", io_varied=True)
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


QUIVER_NOISES = (0.0, 0.1, 0.25)


def experiment_quiver_noise(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    """How much Quiver's profile error matters: SiloD §7.1.2 observes that Quiver's online profiles
    are "not stable when the remote IO fluctuates" but gives no size for the error, so the
    baseline runs with exact profiles (sigma 0) and this sweep shows sigma 0.1 and 0.25 (a
    log-normal factor on each dataset's benefit, redrawn every 12 h)."""
    runner = runner.for_sweeps()
    policies = ("fifo", "sjf", "gavel")
    runs = [Run(f"{p}/silod", p, "silod", capacity) for p in policies]
    runs += [Run(f"{p}/quiver noise {n:g}", p, "quiver", capacity, profile_noise=n) for p in policies for n in QUIVER_NOISES]
    results = runner.run_all(runs)
    table: dict[str, dict[str, float]] = {}
    for r in results:
        key = "silod" if r.run.cache_system == "silod" else f"quiver sigma {r.run.profile_noise:g}"
        table.setdefault(r.run.policy, {})[key] = r.summary["avg_jct_s"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = ["silod", *(f"quiver sigma {n:g}" for n in QUIVER_NOISES)]
    width = 0.2
    for i, key in enumerate(keys):
        ax.bar([x + i * width for x in range(len(policies))], [table[p][key] / 3600 for p in policies], width, label=key)
    ax.set_xticks([x + 1.5 * width for x in range(len(policies))], [p.upper() for p in policies])
    ax.set_ylabel("average JCT (h)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"Quiver's profile error (log-normal sigma, redrawn every 12 h)\n{runner.describe(capacity)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "quiver_noise.png", dpi=120)
    plt.close(fig)
    headline = [(f"{p.upper()}: SiloD's avg-JCT lead over Quiver at sigma " + " / ".join(f"{n:g}" for n in QUIVER_NOISES),
                 " / ".join(f"{table[p][f'quiver sigma {n:g}'] / table[p]['silod']:.2f}x" for n in QUIVER_NOISES)) for p in policies]
    payload = {"experiment": "quiver-noise", "setup": runner.describe(capacity), "noises": list(QUIVER_NOISES), "avg_jct_s": table,
               "headline": headline}
    _save(out, "quiver_noise", payload)
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
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room above the bars for the legend
    axes[0].legend(loc="upper center", ncols=2, fontsize=8)
    fig.suptitle(f"Table 6: micro-benchmark\n{payload['setup']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "micro.png", dpi=120)
    plt.close(fig)
    payload["headline"] = [(f"{c}: avg JCT / makespan (min)", f"{v['avg_jct']:.0f} / {v['makespan']:.0f} (paper {PAPER_TABLE6_MIN[c]['avg_jct']} / {PAPER_TABLE6_MIN[c]['makespan']})")
                           for c, v in payload["ours_min"].items()]
    _save(out, "micro", payload)
    return payload




def experiment_curriculum(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity | None = None) -> dict:
    """Fig. 16: (a) the pacing functions; (b) one curriculum job under uniform and LRU caching.

    Uniform: the job planned as a regular one (SiloDPerf, its dataset cached uniformly within
    the allocation); LRU: the job in the irregular partition (its dataset LRU-cached), which is
    what silod does with a curriculum job. Each bar is the mean of CURRICULUM_REPEATS seeds,
    the error bar one standard deviation."""
    from estimator.access import CurriculumPacing

    cap = CURRICULUM_CLUSTER
    modes = (("uniform", False), ("LRU", True))
    runs = [Run(f"{name} step {step // 1000}k seed {k}", "fifo", "silod", cap, partition=part, curriculum_step=step, seed=runner.source.seed + k)
            for step in CURRICULUM_STEPS for name, part in modes for k in range(CURRICULUM_REPEATS)]
    results = runner.run_all(runs)
    jct: dict[str, dict[str, list[float]]] = {}
    for r in results:
        mode = "LRU" if r.run.partition else "uniform"
        jct.setdefault(f"{r.run.curriculum_step // 1000}k", {}).setdefault(mode, []).append(r.summary["avg_jct_s"] / 60)
    spec = MODELS["resnet50"]
    setup = (f"ResNet-50 on ImageNet-22k (1.36 TB, 110 KB items), {CURRICULUM_GPUS} V100s (f* {spec.ideal_per_gpu * CURRICULUM_GPUS / MB:.0f} MB/s), "
             f"{cap.cache / TB:g} TB cache, {cap.remote_io / MB:g} MB/s remote IO; pacing starting_percent 0.04, alpha 1.9, batch 256; "
             f"{CURRICULUM_IDEAL_MIN:g} min at ideal speed; {CURRICULUM_REPEATS} seeds per bar")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    iterations = np.linspace(0, 400_000, 801)
    for step in CURRICULUM_STEPS:
        pace = CurriculumPacing(CURRICULUM_PACE["starting_percent"], CURRICULUM_PACE["alpha"], step, CURRICULUM_PACE["batch"])
        axes[0].step(iterations / 1000, pace.fraction(iterations) * 100, where="post", label=f"Step {step // 1000}k")
    axes[0].set_xlabel("iteration (thousands)")
    axes[0].set_ylabel("eligible items (% of the dataset)")
    axes[0].set_ylim(0, 105)
    axes[0].set_title("(a) exponential pacing, g(i)/N")
    axes[0].legend()
    steps = list(jct)
    for i, (name, _) in enumerate(modes):
        means = [np.mean(jct[s][name]) for s in steps]
        errs = [np.std(jct[s][name]) for s in steps]
        axes[1].bar([x + (i - 0.5) * 0.35 for x in range(len(steps))], means, 0.35, yerr=errs, capsize=4, label=f"{name} cache")
    axes[1].axhline(CURRICULUM_IDEAL_MIN, color="grey", lw=0.8, ls="--", label="ideal (no IO stall) = paper's ~367 min")
    axes[1].set_xticks(range(len(steps)), [f"Step {s}" for s in steps])
    axes[1].set_ylabel("JCT (min)")
    axes[1].set_ylim(bottom=0)
    axes[1].set_title("(b) uniform vs LRU cache")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Fig. 16: curriculum learning\n{setup}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curriculum.png", dpi=120)
    plt.close(fig)
    summary = {s: {m: {"mean_min": float(np.mean(v)), "std_min": float(np.std(v)), "runs_min": v} for m, v in modes_.items()} for s, modes_ in jct.items()}
    headline = [(f"Step {s}: JCT uniform / LRU (min, mean ± sd)",
                 f"{v['uniform']['mean_min']:.1f} ± {v['uniform']['std_min']:.1f} / {v['LRU']['mean_min']:.1f} ± {v['LRU']['std_min']:.1f} "
                 f"(LRU/uniform {v['LRU']['mean_min'] / v['uniform']['mean_min']:.3f}; paper ~367 / ~367)") for s, v in summary.items()]
    payload = {"experiment": "curriculum", "setup": setup, "jct_min": summary, "paper_jct_min": 367, "headline": headline}
    _save(out, "curriculum", payload)
    return payload


IRREGULAR_FRACTIONS = (0.0, 0.1, 0.25, 0.5)
IRREGULAR_CONFIGS = (
    ("partition", "silod", True),  # (a) silod: irregular jobs in their own LRU partition
    ("all regular", "silod", False),  # (b) every job planned with SiloDPerf, uniform caches
    ("all LRU", "alluxio", True),  # (c) one LRU cache, storage-unaware policy
)


def experiment_irregular_mix(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity, policy: str = "fifo") -> dict:
    """§6: what the irregular partition buys and costs, on the sweeps' Philly-distribution trace
    with 0-50% of its jobs turned into curriculum jobs (`with_curriculum_jobs`)."""
    runner = runner.for_sweeps()
    runs = [Run(f"{name} {x:.0%}", policy, system, capacity, partition=part, irregular=x)
            for x in IRREGULAR_FRACTIONS for name, system, part in IRREGULAR_CONFIGS]
    table: dict[str, dict[str, dict[str, float]]] = {}
    for r in runner.run_all(runs):
        name = next(n for n, s, p in IRREGULAR_CONFIGS if s == r.run.cache_system and p == r.run.partition)
        row = {"all": r.summary["avg_jct_s"], **r.jct_by_kind}
        table.setdefault(f"{r.run.irregular:.0%}", {})[name] = row
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    fractions = list(table)
    for ax, kind in zip(axes, ("all", "regular", "irregular"), strict=True):
        for i, (name, _, _) in enumerate(IRREGULAR_CONFIGS):
            ys = [table[f][name].get(kind, float("nan")) / 3600 for f in fractions]
            ax.bar([x + (i - 1) * 0.27 for x in range(len(fractions))], ys, 0.27, label=name)
        ax.set_xticks(range(len(fractions)), fractions)
        ax.set_xlabel("curriculum jobs in the trace")
        ax.set_ylabel("average JCT (h)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{kind} jobs")
    axes[0].legend(fontsize=8)
    setup = f"{policy.upper()}; {runner.describe(capacity)}"
    fig.suptitle(f"Irregular jobs: two partitions vs all regular vs all LRU\n{setup}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "irregular_mix.png", dpi=120)
    plt.close(fig)
    headline = []
    for f, rows in table.items():
        p, reg, lru = rows["partition"], rows["all regular"], rows["all LRU"]
        text = f"all {_hours(p['all'])} / {_hours(reg['all'])} / {_hours(lru['all'])}"
        if "irregular" in p:
            text += (f"; regular jobs {_hours(p['regular'])} / {_hours(reg['regular'])} / {_hours(lru['regular'])}"
                     f"; curriculum jobs {_hours(p['irregular'])} / {_hours(reg['irregular'])} / {_hours(lru['irregular'])}")
        headline.append((f"{f} curriculum: avg JCT partition / all regular / all LRU", text))
    payload = {"experiment": "irregular-mix", "setup": setup, "avg_jct_s": table, "headline": headline}
    _save(out, "irregular_mix", payload)
    return payload


#: Cores per GPU of the CPU-constrained clusters: resnet50 needs 114 / 35.2 = 3.2 cores per V100,
#: efficientnetb1 2.0, resnet152 1.2, vlad and bert none (traces/catalog.py).
CPU_PER_GPU = (2.0, 3.0)
CPU_RULES = ("model", "gpu-proportional")


def experiment_cpu(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    policies = ("fifo", "sjf", "gavel")
    runner = runner.for_sweeps()
    runs = [Run(f"{p}/{rule} @ {k:g} cores/GPU", p, "silod",
                replace(capacity, cpus_per_node=k * capacity.gpus_per_node, cpu_allocation=rule), catalog_pipelines=True)
            for k in CPU_PER_GPU for p in policies for rule in CPU_RULES]
    results = runner.run_all(runs)
    table = {r.run.label: r.summary for r in results}
    plt = _plt()
    fig, axes = plt.subplots(1, len(CPU_PER_GPU), figsize=(6 * len(CPU_PER_GPU), 4.5), squeeze=False)
    width = 0.35
    for ax, k in zip(axes[0], CPU_PER_GPU, strict=True):
        for i, rule in enumerate(CPU_RULES):
            vals = [table[f"{p}/{rule} @ {k:g} cores/GPU"]["avg_jct_s"] / 3600 for p in policies]
            ax.bar([x + i * width for x in range(len(policies))], vals, width,
                   label="4-resource (cores by the estimator)" if rule == "model" else "GPU-proportional cores")
        ax.set_xticks([x + width / 2 for x in range(len(policies))], [p.upper() for p in policies])
        ax.set_ylabel("average JCT (h)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{k:g} cores per GPU ({k * capacity.gpus_per_node:g} per {capacity.gpus_per_node}-GPU node)")
    axes[0][0].legend(fontsize=8)
    setup = runner.describe(capacity) + "; catalog CPU rates (image 35.2 MB/s per core, text/features none); silod cache"
    fig.suptitle("CPU as a fourth resource vs GPU-proportional cores\n" + setup.replace("; ", ";\n", 1), fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "cpu.png", dpi=120)
    plt.close(fig)
    headline = []
    for k in CPU_PER_GPU:
        for p in policies:
            ours = table[f"{p}/model @ {k:g} cores/GPU"]["avg_jct_s"]
            base = table[f"{p}/gpu-proportional @ {k:g} cores/GPU"]["avg_jct_s"]
            headline.append((f"{p.upper()} @ {k:g} cores/GPU: avg JCT 4-resource vs GPU-proportional",
                             f"{_hours(ours)} vs {_hours(base)} = {base / ours:.2f}x"))
    payload = {"experiment": "cpu", "setup": setup, "cores_per_gpu": list(CPU_PER_GPU), "runs": table, "headline": headline}
    _save(out, "cpu", payload)
    return payload


#: The stagger sweep's setup: two jobs on one ImageNet-1k copy that fits the cache, a link slower
#: than either job (the first epoch is IO-bound, as in the paper's remote repository).
STAGGER_CLUSTER = ClusterCapacity(gpus=2, cache=200 * GB, remote_io=100 * MB, gpus_per_node=2)
STAGGER_EPOCHS = 3.0
STAGGER_STEPS = tuple(range(0, 101, 10))


def stagger_trace(fraction: float) -> Trace:
    """ResNet-50 at 0, EfficientNet-B1 at `fraction` of ResNet-50's standalone runtime."""
    data = DATASETS["imagenet-1k"]
    a, b = MODELS["resnet50"], MODELS["efficientnetb1"]
    alone = standalone_runtime(a.ideal_per_gpu)
    jobs = (TraceJob("resnet50", 0.0, 1, a.name, data.name, a.ideal_per_gpu, STAGGER_EPOCHS),
            TraceJob("efficientnetb1", fraction * alone, 1, b.name, data.name, b.ideal_per_gpu, STAGGER_EPOCHS))
    return Trace(jobs, {data.name: data.size}, source=f"stagger {fraction:.0%}")


@lru_cache(maxsize=4)
def standalone_runtime(ideal: float) -> float:
    """ResNet-50 alone on the stagger cluster (simulated, silod): 100% of the stagger axis."""
    from policies.registry import estimator_for, get_policy
    from scheduler.sim.engine import SimConfig, Simulator

    data = DATASETS["imagenet-1k"]
    trace = Trace((TraceJob("resnet50", 0.0, 1, "resnet50", data.name, ideal, STAGGER_EPOCHS),), {data.name: data.size})
    return Simulator(trace, STAGGER_CLUSTER, get_policy("fifo"), estimator_for("silod"), "silod", SimConfig()).run().makespan_s


def experiment_stagger(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity | None = None) -> dict:
    """Two panels. Left: SiloD's model (uniform random read orders, a cache whose fetched items
    serve every reader) -- remote bytes are the dataset's once at any stagger, so delaying the
    second job only loses parallelism. Right: the paper's setting (scheduler/sim/stagger.py: one
    read order, page cache, no sharing of fetches in flight, its Table I times), simulated item
    by item, beside the paper's model (estimator/stagger.py) calibrated as the paper does and its
    binary search's optimal stagger."""
    from estimator.stagger import makespan as model_makespan
    from estimator.stagger import optimal_stagger
    from scheduler.sim.stagger import PAPER_ITEMS, PAPER_PAIR, calibrate, simulate_pair

    runs = [Run(f"{system} stagger {step}%", "fifo", system, STAGGER_CLUSTER, stagger=step / 100)
            for system in ("silod", "alluxio") for step in STAGGER_STEPS]
    table: dict[str, list[float]] = {}
    remote: dict[str, list[float]] = {}
    for r in runner.run_all(runs):
        table.setdefault(r.run.cache_system, []).append(r.summary["makespan_s"])
        remote.setdefault(r.run.cache_system, []).append(r.summary["remote_bytes"])
    alone = standalone_runtime(MODELS["resnet50"].ideal_per_gpu)
    a, b = PAPER_PAIR
    paper_alone = simulate_pair(a, None, PAPER_ITEMS)[a.name]
    measured, predicted = [], []
    model_a, model_b = calibrate(a, b, PAPER_ITEMS)
    for step in STAGGER_STEPS:
        t_b = step / 100 * paper_alone
        times = simulate_pair(a, b, PAPER_ITEMS, stagger=t_b)
        measured.append(max(times[a.name], t_b + times[b.name]))
        predicted.append(model_makespan(model_a, model_b, PAPER_ITEMS, t_b))
    best_t, best_m = optimal_stagger(model_a, model_b, PAPER_ITEMS)
    setup = (f"SiloD model: ResNet-50 then EfficientNet-B1, {STAGGER_EPOCHS:g} epochs each on one ImageNet-1k copy (143 GB);\n2 GPUs, "
             f"200 GB cache, 100 MB/s remote IO, FIFO; ResNet-50 alone {alone / 60:.0f} min")
    paper_setup = (f"paper's setting: {a.name} then {b.name}, {a.epochs:g} epochs each, {PAPER_ITEMS} mini-batches per epoch, "
                   f"Table I times (I/O {a.io * 1e3:.0f} / {b.io * 1e3:.0f} ms, training {a.iteration * 1e3:.0f} / "
                   f"{b.iteration * 1e3:.0f} ms per iteration), one read order, page cache, fetches in flight not shared; "
                   f"{a.name} alone {paper_alone:.0f} s")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    for system, ys in table.items():
        ax.plot(STAGGER_STEPS, [y / 60 for y in ys], marker="o", label=f"{system} cache")
    ax.set_xlabel("stagger: EfficientNet-B1 starts at X% of ResNet-50's standalone runtime")
    ax.set_ylabel("makespan (min)")
    ax.set_ylim(bottom=0)
    ax.set_title("SiloD's model: random orders, fetched items shared\n" + setup.split(";", 1)[1].strip(), fontsize=8)
    ax.legend()
    ax = axes[1]
    ax.plot(STAGGER_STEPS, measured, marker="o", label="item-level simulation")
    ax.plot(STAGGER_STEPS, predicted, marker="x", linestyle="--", label="paper's model (Eqs. 1-4), calibrated on 100 iterations")
    ax.axvline(100 * best_t / paper_alone, color="grey", linestyle=":", label=f"model's optimal stagger ({100 * best_t / paper_alone:.0f}%)")
    ax.set_xlabel(f"stagger: {b.name} starts at X% of {a.name}'s standalone runtime")
    ax.set_ylabel("makespan (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("the paper's setting (HiPC'23 Fig. 3): same order, page cache, no in-flight sharing", fontsize=8)
    ax.legend(fontsize=7)
    fig.suptitle("Cache-aware staggering", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "stagger.png", dpi=120)
    plt.close(fig)
    headline = []
    for system, ys in table.items():
        best = int(np.argmin(ys))
        lo, hi = f"{min(remote[system]) / GB:.0f}", f"{max(remote[system]) / GB:.0f}"
        headline.append((f"SiloD model, {system}: makespan at 0% / best stagger / 100%",
                         f"{ys[0] / 60:.0f} / {ys[best] / 60:.0f} min at {STAGGER_STEPS[best]}% / {ys[-1] / 60:.0f} min; "
                         f"remote bytes {lo if lo == hi else f'{lo}-{hi}'} GB at every stagger"))
    best = int(np.argmin(measured))
    headline.append(("paper's setting (simulated): makespan at 0% / best / 100%",
                     f"{measured[0]:.0f} / {measured[best]:.0f} s at {STAGGER_STEPS[best]}% / {measured[-1]:.0f} s"))
    headline.append(("paper's model: optimal stagger (binary search) and its makespan",
                     f"{100 * best_t / paper_alone:.0f}% ({best_t:.0f} s): {best_m:.0f} s predicted, "
                     f"{max(simulate_pair(a, b, PAPER_ITEMS, stagger=best_t)[a.name], best_t + simulate_pair(a, b, PAPER_ITEMS, stagger=best_t)[b.name]):.0f} s simulated"))
    headline.append(("paper (Fig. 3, real ResNet-50 + EfficientNet-B0 on a node's OS cache)", "optimum near 40%, then rising"))
    payload = {"experiment": "stagger", "setup": setup.replace("\n", " "), "paper_setup": paper_setup,
               "stagger_percent": list(STAGGER_STEPS), "makespan_s": table, "remote_bytes": remote,
               "paper_setting": {"standalone_s": paper_alone, "makespan_s": measured, "model_makespan_s": predicted,
                                 "model_optimal_stagger_s": best_t, "model_optimal_makespan_s": best_m,
                                 "calibrated": {j.name: {"I": p.iteration, "W": p.wait, "W_cached": p.wait_cached, "W_conc": p.wait_conc}
                                                for j, p in ((a, model_a), (b, model_b))}},
               "headline": headline}
    _save(out, "stagger", payload)
    return payload


AUTOCACHE_CORES_PER_GPU = 2.0


def experiment_autocache(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    """Autocaching on vs off: the sweeps' trace with the catalog's CPU rates on a cluster with
    2 cores per GPU (image jobs CPU-bound), under FIFO, SJF and Gavel on the silod cache. On:
    image jobs have an autocache point (AUTOCACHE_EXPANSION, AUTOCACHE_POST_SPEEDUP) and the
    scheduler chooses per dataset; off: the same jobs without one (source caching)."""
    policies = ("fifo", "sjf", "gavel")
    runner = runner.for_sweeps()
    cluster = replace(capacity, cpus_per_node=AUTOCACHE_CORES_PER_GPU * capacity.gpus_per_node)
    runs = [Run(f"{p}/{'on' if on else 'off'}", p, "silod", cluster, catalog_pipelines=True, autocache_points=on)
            for p in policies for on in (True, False)]
    table = {r.run.label: r.summary for r in runner.run_all(runs)}
    setup = (runner.describe(capacity) + f"; {AUTOCACHE_CORES_PER_GPU:g} cores per GPU, catalog CPU rates; image pipelines' "
             f"autocache point: {AUTOCACHE_EXPANSION:g} bytes cached per source byte, post-decode stage "
             f"{AUTOCACHE_POST_SPEEDUP:g}x the whole pipeline's per-core rate (assumed); silod cache")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.35
    for ax, key, title in ((axes[0], "avg_jct_s", "average JCT (h)"), (axes[1], "makespan_s", "makespan (h)")):
        for i, on in enumerate(("on", "off")):
            ax.bar([x + i * width for x in range(len(policies))], [table[f"{p}/{on}"][key] / 3600 for p in policies], width,
                   label="autocaching (source or decoded, per dataset)" if on == "on" else "source caching only")
        ax.set_xticks([x + width / 2 for x in range(len(policies))], [p.upper() for p in policies])
        ax.set_ylim(bottom=0)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("Autocaching on vs off\n" + textwrap.fill(setup, 140), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "autocache.png", dpi=120)
    plt.close(fig)
    headline = []
    for p in policies:
        on, off = table[f"{p}/on"]["avg_jct_s"], table[f"{p}/off"]["avg_jct_s"]
        headline.append((f"{p.upper()}: avg JCT autocaching on vs off", f"{_hours(on)} vs {_hours(off)} = {off / on:.2f}x"))
    payload = {"experiment": "autocache", "setup": setup, "runs": table, "headline": headline}
    _save(out, "autocache", payload)
    return payload


#: The Alibaba comparison's window: 7 days of task arrivals (about 1,100 GPU tasks), the week
#: with the most GPU-hours offered; cluster nodes of 8 GPUs (the trace has 8-GPU tasks).
ALIBABA_WINDOW_DAYS = 7.0
ALIBABA_GPUS_PER_NODE = 8
DAY_S = 86400.0


def offered_load(trace: Trace) -> float:
    """GPUs the trace asks for on average over its arrival span: sum(GPUs x duration at f*) /
    (last arrival - first arrival). A cluster of G GPUs is loaded offered_load / G."""
    submits = np.array([j.submit_time for j in trace.jobs])
    work = sum(j.num_gpus * j.epochs * trace.dataset_sizes[j.dataset] / j.ideal_throughput for j in trace.jobs)
    span = float(submits.max() - submits.min())
    return float(work / span) if span > 0 else float("inf")


def densest_window(path: Path, seed: int, days: float = ALIBABA_WINDOW_DAYS) -> tuple[float, float]:
    """The `days`-long window of creation times (starting on a whole day) with the most
    GPU-seconds of work inside it (tasks created in it, counted up to the window's end: the
    trace's first days hold a handful of tasks that run for months and would otherwise win)."""
    from traces.alibaba_trace import load_alibaba_trace

    trace = load_alibaba_trace(path, seed=seed)
    submits = np.array([j.submit_time for j in trace.jobs])
    starts = np.arange(np.floor(submits.min() / DAY_S), np.ceil(submits.max() / DAY_S)) * DAY_S
    duration = np.array([j.epochs * trace.dataset_sizes[j.dataset] / j.ideal_throughput for j in trace.jobs])
    gpus = np.array([j.num_gpus for j in trace.jobs])
    totals = []
    for a in starts:
        inside = (submits >= a) & (submits < a + days * DAY_S)
        totals.append(float((gpus[inside] * np.minimum(duration[inside], a + days * DAY_S - submits[inside])).sum()))
    a = float(starts[int(np.argmax(totals))])
    return a, a + days * DAY_S


def alibaba_source(runner: ExperimentRunner) -> TraceSource:
    """The openb trace's densest week, as experiment alibaba simulates it (--trace: the file or
    its directory; default: where `silod trace fetch alibaba-openb` puts it)."""
    from traces.public import ALIBABA_OPENB, default_fetch_dir

    path = Path(runner.source.path) if runner.source.path is not None else default_fetch_dir(ALIBABA_OPENB.name)
    if path.is_dir():
        path = path / "openb_pod_list_default.csv"
    if not path.is_file():
        raise UserError(f"experiment alibaba needs Alibaba's openb trace, which silod does not ship ({ALIBABA_OPENB.why_fetched}) "
                        f"and {path} does not hold: run `silod trace fetch alibaba-openb` (it downloads the trace into "
                        f"{default_fetch_dir(ALIBABA_OPENB.name)}, checked by SHA-256), or pass --trace DIR")
    return replace(runner.source, path=str(path), window_s=densest_window(path, runner.source.seed))


def experiment_alibaba(runner: ExperimentRunner, out: Path, capacity: ClusterCapacity) -> dict:
    """Fig. 12 (policies x cache systems) on Alibaba's openb trace, loaded like the Philly run.

    The openb trace is light for any cluster (6,203 GPU tasks over 149 days, 16.6 GPUs offered
    on average, most arrivals in the last 36 days). Scaling its arrivals would change the trace;
    instead the cluster is sized to it: the densest week of arrivals, and as many 8-GPU nodes as
    make its offered load per GPU closest to the Philly-distribution trace's on the given cluster
    (the matrix run: 2,000 jobs offer 442 GPUs to 400). Cache and remote IO per GPU are the given
    cluster's (100 TB and 4 GB/s per 400 GPUs by default). CPU is not modelled, as in Fig. 12."""
    from traces.synthetic import generate_trace

    source = alibaba_source(runner)
    window = source.window_s
    trace = build_trace(source)
    philly = generate_trace(SYNTHETIC_JOBS, mean_interarrival_s=SYNTHETIC_INTERARRIVAL_S, seed=runner.source.seed + 1)
    target = offered_load(philly) / capacity.gpus
    offered = offered_load(trace)
    nodes = max(1, int(round(offered / target / ALIBABA_GPUS_PER_NODE)))
    gpus = nodes * ALIBABA_GPUS_PER_NODE
    cluster = ClusterCapacity(gpus=gpus, cache=capacity.cache * gpus / capacity.gpus, remote_io=capacity.remote_io * gpus / capacity.gpus,
                              gpus_per_node=ALIBABA_GPUS_PER_NODE)
    sub = copy.copy(runner)  # keeps the shard, merge or Dask distribution
    sub.source = source
    policies = ("fifo", "sjf", "gavel")
    runs = [Run(f"{p}/{c}", p, c, cluster) for p in policies for c in CACHE_SYSTEMS]
    table = {f"{r.run.policy}/{r.run.cache_system}": r.summary for r in sub.run_all(runs)}
    setup = (f"{gpus} GPUs ({nodes} nodes of {ALIBABA_GPUS_PER_NODE}), {cluster.cache / TB:g} TB cache, {cluster.remote_io / GB:g} GB/s "
             f"remote IO; openb tasks created on days {window[0] / DAY_S:g}-{window[1] / DAY_S:g} ({len(trace)} GPU tasks), "
             f"offered load {offered:.1f} GPUs = {offered / gpus:.2f} per GPU (Philly trace: {target:.2f})")
    headline = _policy_matrix_figure(table, policies, out / "alibaba.png",
                                     "Fig. 12 on Alibaba's openb trace\n" + textwrap.fill(setup, 150), 9)
    payload = {"experiment": "alibaba", "setup": setup, "window_s": list(window), "gpus": gpus, "runs": table, "headline": headline}
    _save(out, "alibaba", payload)
    return payload


EXPERIMENTS: dict[str, Callable] = {
    "matrix": experiment_matrix,
    "fairness": experiment_fairness,
    "bandwidth": experiment_bandwidth,
    "gpu-speed": experiment_gpu_speed,
    "sharing": experiment_sharing,
    "quiver-noise": experiment_quiver_noise,
    "micro": experiment_micro,
    "curriculum": experiment_curriculum,
    "irregular-mix": experiment_irregular_mix,
    "cpu": experiment_cpu,
    "stagger": experiment_stagger,
    "alibaba": experiment_alibaba,
    "autocache": experiment_autocache,
}
