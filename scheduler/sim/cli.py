"""`silod simulate` and `silod experiment`: the trace-driven simulator's commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from estimator.errors import UserError, resolve_name
import traces
from traces.loader import TraceFormat, load_trace

# Located through the `traces` package (shipped as its package data), not relative to this file,
# which moves whenever the scheduler's layout does.
SHIPPED_TRACE = Path(traces.__file__).resolve().parent / "sample-96gpu.csv"
DEFAULT_CLUSTER = {"gpus": 96, "gpus_per_node": 4, "cache": "24TB", "remote_io": "1GB/s"}


MAX_SEED = 2**32 - 1
DEFAULT_ROUND_S = 360.0
DEFAULT_RESOLUTION = 128


def check_seed(seed: int) -> None:
    """Seeds feed numpy's and Python's generators, which reject negative numbers deep inside a
    run; say so before anything runs."""
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed {seed} must be a whole number from 0 to {MAX_SEED}")


def run_simulation(trace, capacity, gpu_speed: float, policy: str, cache_system: str, round_s: float, resolution: int, seed: int,
                   progress_label: str | None = None, partition: bool = True, profile_noise: float = 0.0, stagger: bool = False,
                   decision_interval: float = 0.0):
    """Build and run one simulation; shows a progress bar when `progress_label` is given."""
    from policies.registry import estimator_for, get_policy, resolve_policy_name
    from scheduler.sim.cache_systems import CACHE_SYSTEMS
    from scheduler.sim.engine import SimConfig, Simulator

    cache_system = resolve_name("cache system", cache_system, CACHE_SYSTEMS)
    policy = resolve_policy_name(policy)
    pol = get_policy(policy)
    config = SimConfig(round_s=round_s, resolution=resolution, gpu_speed=gpu_speed, seed=seed, partition=partition,
                       profile_noise=profile_noise, stagger=stagger, decision_interval_s=decision_interval)
    if progress_label is None:
        return Simulator(trace, capacity, pol, estimator_for(cache_system), cache_system, config).run()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(progress_label, total=1.0)
        sim = Simulator(trace, capacity, pol, estimator_for(cache_system), cache_system, config,
                        progress=lambda frac: bar.update(task, completed=frac))
        return sim.run()


def _load_trace_warning(*args):
    """load_trace, its warnings (the Gavel reader's count of jobs without a throughput entry)
    printed as one plain line each on stderr, not Python's warning format."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = load_trace(*args)
    for w in caught:
        typer.echo(f"warning: {w.message}", err=True)
    return tr


def register(app: typer.Typer) -> None:
    _register_trace(app)

    @app.command()
    def simulate(
        trace: Annotated[Path, typer.Option(help="trace file (silod CSV, Gavel TSV with --format gavel, or Alibaba openb with --format alibaba-openb)")] = SHIPPED_TRACE,
        format: Annotated[TraceFormat, typer.Option("--format", help="trace format; auto: .trace files are Gavel TSV, the openb pod list (or its folder) is alibaba-openb")] = TraceFormat.auto,
        cluster: Annotated[Optional[Path], typer.Option(help="YAML file with gpus, gpus_per_node, cache, remote_io, gpu_speed, irregular_share, cpus_per_node, cpu_allocation (traces/cluster.example.yaml); a flag given too overrides its key, with a note")] = None,
        gpus: Annotated[Optional[str], typer.Option(help="GPUs in the cluster [default 96]")] = None,
        gpus_per_node: Annotated[Optional[str], typer.Option(help="GPUs per node [default 4]")] = None,
        cache: Annotated[Optional[str], typer.Option(help="total cache, e.g. 24TB [default 24TB]")] = None,
        remote_io: Annotated[Optional[str], typer.Option(help="remote IO limit, e.g. 1GB/s or 8Gbps [default 1GB/s]")] = None,
        gpu_speed: Annotated[Optional[float], typer.Option(help="scale every job's f* (faster GPUs)")] = None,
        irregular_share: Annotated[Optional[str], typer.Option(help="pin the irregular jobs' partition to this fraction of cache and remote IO [default: by demand, every round]")] = None,
        cpus_per_node: Annotated[Optional[str], typer.Option(help="CPU cores per node for input pipelines; jobs with a cpu_rate are then bound by their cores [default: CPU not constrained]")] = None,
        cpu_allocation: Annotated[Optional[str], typer.Option(help="with --cpus-per-node: model (the policy allocates cores as a resource) | gpu-proportional (cores follow GPUs, the baseline) [default: model]")] = None,
        irregular_partition: Annotated[bool, typer.Option(help="schedule irregular jobs (access curriculum/irregular) in their own partition with LRU caching; --no-irregular-partition plans every job as regular (SiloDPerf, uniform cache)")] = True,
        policy: Annotated[str, typer.Option(help="fifo (backfilling) | fifo-strict (head-of-line, Gavel's) | sjf | gavel | greedy | a registered plug-in")] = "fifo",
        cache_system: Annotated[str, typer.Option(help="silod | alluxio | coordl | quiver")] = "silod",
        round: Annotated[float, typer.Option("--round", help="scheduling round, seconds")] = 360.0,
        resolution: Annotated[int, typer.Option(help="chunks per dataset, twice that on Alluxio's LRU (higher = closer to item level, slower)")] = 128,
        dataset_sharing: Annotated[float, typer.Option(help="Gavel traces: fraction of jobs that share their family's dataset")] = 0.0,
        max_jobs: Annotated[Optional[int], typer.Option(help="use only the first N jobs")] = None,
        seed: Annotated[int, typer.Option(help="random seed (epoch orders, profiles)")] = 0,
        profile_noise: Annotated[float, typer.Option(help="quiver only: sigma of the log-normal error of its online profiles, redrawn every 12 h (0 = exact; see docs/simulator.md)")] = 0.0,
        stagger: Annotated[bool, typer.Option(help="staggered starts: hold a job whose dataset a running job is reading for the first time while the cache-aware staggering model (HiPC'23) predicts a shorter makespan from a later start (see docs/input-pipeline.md)")] = False,
        decision_interval: Annotated[float, typer.Option(help="allocation-recompute interval: at most one policy decision per this many seconds while jobs run; rounds in between use the allocation in force (Gavel's default is 1920; 0 = at every arrival, completion and demand change; see docs/gavel.md)")] = 0.0,
        scale_missing: Annotated[Optional[str], typer.Option(help="Gavel traces: rate of a job whose GPU count has no throughput entry: linear (the largest measured count below, scaled by GPUs) | nearest (its measured rate, not scaled) [default: linear, with a warning that counts them]")] = None,
        out: Annotated[Path, typer.Option(help="output directory")] = Path("out/simulate"),
        quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    ) -> None:
        """Run one trace-driven simulation and write summary.json, jobs.csv and timeline.csv."""
        from scheduler.sim.report import write_outputs
        from scheduler.core.cluster import load_cluster

        if max_jobs is not None and max_jobs < 1:
            raise UserError(f"--max-jobs {max_jobs} must be >= 1")
        check_seed(seed)
        if not decision_interval >= 0:
            raise UserError(f"--decision-interval {decision_interval} must be >= 0 seconds (0: decide at every event, the default)")
        from policies.registry import resolve_policy_name
        from scheduler.outputs import ensure_writable_dir
        from scheduler.sim.cache_systems import CACHE_SYSTEMS

        policy = resolve_policy_name(policy)
        cache_system = resolve_name("cache system", cache_system, CACHE_SYSTEMS)

        ensure_writable_dir(out, "--out")
        from scheduler.core.cluster import cluster_overrides

        for note in cluster_overrides(cluster, gpus=gpus, gpus_per_node=gpus_per_node, cache=cache, remote_io=remote_io,
                                      gpu_speed=gpu_speed, irregular_share=irregular_share, cpus_per_node=cpus_per_node,
                                      cpu_allocation=cpu_allocation):
            typer.echo(f"note: {note}", err=True)
        capacity, speed = load_cluster(cluster, gpus=gpus, gpus_per_node=gpus_per_node, cache=cache,
                                       remote_io=remote_io, gpu_speed=gpu_speed, irregular_share=irregular_share,
                                       cpus_per_node=cpus_per_node, cpu_allocation=cpu_allocation, defaults=DEFAULT_CLUSTER)
        tr = _load_trace_warning(trace, format, dataset_sharing, max_jobs, seed, scale_missing)
        result = run_simulation(tr, capacity, speed, policy, cache_system, round, resolution, seed,
                                None if quiet else f"{policy}/{cache_system}", partition=irregular_partition,
                                profile_noise=profile_noise, stagger=stagger, decision_interval=decision_interval)
        extra = {"trace": str(trace), "gpu_speed": speed}
        if decision_interval:
            extra["decision_interval_s"] = decision_interval
        if cache_system == "quiver":
            extra["profile_noise"] = profile_noise
        summary = write_outputs(result, out, policy, cache_system, extra)
        _print_summary(summary, out)
        if result.unfinished:
            shown = ", ".join(result.unfinished[:5]) + (f" and {len(result.unfinished) - 5} more" if len(result.unfinished) > 5 else "")
            typer.echo(f"warning: {len(result.unfinished)} job(s) did not finish ({shown}) and are not in the JCTs: the simulation "
                       "stops at its ten-year horizon, or when no job can progress (e.g. --remote-io 0 with nothing cached)", err=True)


    @app.command()
    def experiment(
        name: Annotated[str, typer.Argument(help="matrix | fairness | bandwidth | gpu-speed | sharing | quiver-noise | micro | curriculum | irregular-mix | cpu | stagger | alibaba | autocache | all")],
        parts: Annotated[Optional[list[Path]], typer.Argument(help="with --merge: the --out directories of the shards", show_default=False)] = None,
        out: Annotated[Path, typer.Option(help="output directory (JSON and PNG per experiment; with --shard, the part)")] = Path("out/experiments"),
        trace: Annotated[Optional[Path], typer.Option(help="trace for the large-cluster experiments [default: a synthetic 2,000-job trace with Philly's duration distribution, as §7 builds it]")] = None,
        max_jobs: Annotated[Optional[int], typer.Option(help="use only the first N jobs of the trace (quicker)")] = None,
        gpus: Annotated[Optional[str], typer.Option(help="GPUs [default 400]")] = None,
        cache: Annotated[Optional[str], typer.Option(help="total cache [default 100TB]")] = None,
        remote_io: Annotated[Optional[str], typer.Option(help="remote IO [default 4GB/s]")] = None,
        round: Annotated[float, typer.Option("--round", help="scheduling round, seconds")] = DEFAULT_ROUND_S,
        resolution: Annotated[int, typer.Option(help="chunks per dataset (twice that on Alluxio's LRU)")] = DEFAULT_RESOLUTION,
        seed: Annotated[int, typer.Option(help="random seed")] = 0,
        quiet: Annotated[bool, typer.Option(help="no progress bars")] = False,
        workers: Annotated[Optional[int], typer.Option(help="simulations run in parallel [default: min(2, CPUs)]")] = None,
        shard: Annotated[Optional[str], typer.Option(help="I/N: run only shard I of N of the simulations (round robin) and write NAME.part-I-of-N.json into --out; plot with --merge")] = None,
        merge: Annotated[bool, typer.Option("--merge", help="plot from the parts in the directories given after the name (written by --shard); the configuration comes from the parts")] = False,
        dask: Annotated[Optional[str], typer.Option(help="run the simulations on the Dask cluster whose scheduler is at this address (tcp://HOST:PORT; needs silod's dask extra); the trace is shipped to the workers")] = None,
        ray: Annotated[Optional[str], typer.Option(help="run the simulations on the Ray cluster at this address (HOST:PORT, as `ray start --head` prints it; needs silod's ray extra); the trace is shipped to the workers")] = None,
        insecure_cluster: Annotated[bool, typer.Option("--insecure-cluster", help="allow a --dask/--ray address that is neither loopback nor TLS: Dask and Ray run any client's code, so only on a private network that no one else reaches")] = False,
    ) -> None:
        """Reproduce one of the paper's experiments (§7) and plot it; prints the headline numbers."""
        from scheduler.core.cluster import load_cluster
        from scheduler.sim.experiments import EXPERIMENTS, LARGE_CLUSTER, Distribution, Executor, ExperimentRunner, result_from_json
        from scheduler.sim.shards import Shard, ShardWritten, load_parts

        names = list(EXPERIMENTS) if name.casefold() == "all" else [resolve_name("experiment", name, [*EXPERIMENTS, "all"])]
        if max_jobs is not None and max_jobs < 1:
            raise UserError(f"--max-jobs {max_jobs} must be >= 1")
        if workers is not None and workers < 1:
            raise UserError(f"--workers {workers} must be >= 1")
        check_seed(seed)
        if parts and not merge:
            raise UserError(f"unexpected argument(s) {' '.join(map(str, parts))}; directories after the name are for --merge")
        from scheduler.outputs import ensure_writable_dir

        if merge:
            if not parts:
                raise UserError("--merge needs the shards' --out directories after the name: silod experiment NAME --merge DIR...")
            given = [flag for flag, value in (("--trace", trace), ("--max-jobs", max_jobs), ("--gpus", gpus), ("--cache", cache),
                                              ("--remote-io", remote_io), ("--workers", workers), ("--shard", shard), ("--dask", dask),
                                              ("--ray", ray))
                     if value is not None]
            given += [flag for flag, value, default in (("--round", round, DEFAULT_ROUND_S), ("--resolution", resolution, DEFAULT_RESOLUTION),
                                                        ("--seed", seed, 0)) if value != default]
            if given:
                raise UserError(f"--merge takes the configuration from the parts; drop {', '.join(given)}")
            merged = [load_parts(n, parts, result_from_json) for n in names]  # every check before anything is written
            ensure_writable_dir(out, "--out")
            headlines = []
            for m in merged:
                runner, capacity = ExperimentRunner.from_parts(m, out, show_progress=not quiet)
                payload = EXPERIMENTS[m.experiment](runner, out, capacity)
                typer.echo(f"{m.experiment}: merged {len(m.paths)} part(s), {len(m.results)} simulations; "
                           f"wrote {out / (m.experiment.replace('-', '_') + '.json')} and .png")
                headlines.append((m.experiment, payload.get("setup", ""), payload.get("headline", [])))
            _print_headlines(headlines)
            return
        split = Shard.parse(shard) if shard is not None else None
        if dask is not None and ray is not None:
            raise UserError("--dask and --ray each name the cluster that runs the simulations; give one of them")
        executor = (Executor("dask", dask, insecure_cluster) if dask is not None
                    else Executor("ray", ray, insecure_cluster) if ray is not None else None)
        capacity, _ = load_cluster(None, gpus=gpus, cache=cache, remote_io=remote_io, defaults=LARGE_CLUSTER)
        runner = ExperimentRunner(trace, max_jobs, seed, round, resolution, show_progress=not quiet, workers=workers)
        ensure_writable_dir(out, "--out")
        headlines = []
        for n in names:
            runner.distribution = Distribution(n, out, capacity, shard=split, executor=executor)
            try:
                payload = EXPERIMENTS[n](runner, out, capacity)
            except ShardWritten as part:
                typer.echo(f"{n}: shard {split}: {part.ran} of {part.total} simulations, wrote {part.path}; "
                           f"when every shard is done: silod experiment {n} --merge DIR...")
                continue
            typer.echo(f"{n}: wrote {out / (n.replace('-', '_') + '.json')} and .png")
            headlines.append((n, payload.get("setup", ""), payload.get("headline", [])))
        if headlines:
            _print_headlines(headlines)


def _register_trace(app: typer.Typer) -> None:
    from traces import cli as trace_cli

    trace_app = typer.Typer(help="Work with traces: export the exact trace a simulation or an experiment runs; "
                                 "fetch the public traces silod does not ship; print where a public trace is.",
                            no_args_is_help=True)
    app.add_typer(trace_app, name="trace")
    trace_cli.register(trace_app)

    @trace_app.command("export")
    def export(
        out: Annotated[Path, typer.Option(help="the silod trace CSV to write", show_default=False)],
        trace: Annotated[Optional[Path], typer.Option(help="trace file (silod CSV, Gavel TSV, Alibaba openb) [default: the shipped sample, or with --experiment the experiment's synthetic trace]")] = None,
        format: Annotated[TraceFormat, typer.Option("--format", help="trace format, as for silod simulate")] = TraceFormat.auto,
        dataset_sharing: Annotated[float, typer.Option(help="Gavel/openb traces: fraction of jobs that share their family's dataset")] = 0.0,
        max_jobs: Annotated[Optional[int], typer.Option(help="use only the first N jobs")] = None,
        seed: Annotated[int, typer.Option(help="random seed (dataset sharing, synthetic traces)")] = 0,
        experiment: Annotated[Optional[str], typer.Option(help="the trace `silod experiment NAME` simulates with these --trace/--max-jobs/--seed (the sweeps' 1,000-job trace for the sweeps)")] = None,
        irregular: Annotated[float, typer.Option(help="with --experiment: fraction of jobs turned into curriculum jobs (irregular-mix's x axis)")] = 0.0,
        catalog_cpu: Annotated[bool, typer.Option(help="with --experiment: every job gets its catalog model's CPU stage (experiment cpu)")] = False,
        autocache_points: Annotated[bool, typer.Option(help="with --experiment autocache and --catalog-cpu: image jobs get an autocache point (its \"on\" runs)")] = False,
    ) -> None:
        """Write the exact trace a simulation runs (after --format, --max-jobs, --dataset-sharing, or an
        experiment's synthetic trace) as a silod CSV; `silod simulate --trace FILE` reads it back to the
        same simulation, on any machine."""
        from traces.csv_trace import write_csv_trace

        if max_jobs is not None and max_jobs < 1:
            raise UserError(f"--max-jobs {max_jobs} must be >= 1")
        check_seed(seed)
        if not 0.0 <= dataset_sharing <= 1.0:
            raise UserError(f"--dataset-sharing {dataset_sharing} must be a fraction from 0 to 1")
        if not 0.0 <= irregular <= 1.0:
            raise UserError(f"--irregular {irregular} must be a fraction from 0 to 1")
        if experiment is None:
            if irregular or catalog_cpu or autocache_points:
                raise UserError("--irregular, --catalog-cpu and --autocache-points pick a point of an experiment; add --experiment NAME")
            tr = load_trace(trace or SHIPPED_TRACE, format, dataset_sharing, max_jobs, seed)
        else:
            from scheduler.sim.experiments import EXPERIMENTS, experiment_trace

            name = resolve_name("experiment", experiment, list(EXPERIMENTS))
            if format != TraceFormat.auto:
                raise UserError("--format with --experiment: experiments detect the format of --trace themselves; drop --format")
            tr = experiment_trace(name, trace, max_jobs, seed, dataset_sharing, irregular, catalog_cpu, autocache_points)
        if out.is_dir():
            raise UserError(f"--out {out} is a directory; give a file name such as {out / 'trace.csv'}")
        from scheduler.outputs import ensure_writable_dir

        ensure_writable_dir(out.parent, "--out's directory")  # a file there was "error: ...: File exists", exit 1
        write_csv_trace(tr, out)
        typer.echo(f"wrote {out}: {len(tr)} jobs, {len({j.dataset for j in tr.jobs})} datasets")


def _print_headlines(headlines: list) -> None:
    from scheduler.console import table_console
    from rich.table import Table

    console = table_console()
    for name, setup, rows in headlines:
        table = Table(title=f"{name}: {setup}", title_justify="left", show_header=False)
        table.add_column("what", overflow="fold")
        table.add_column("result", overflow="fold")
        for what, value in rows:
            table.add_row(what, value)
        console.print(table)


def _print_summary(summary: dict, out: Path) -> None:
    from scheduler.console import table_console
    from rich.table import Table

    table = Table(title=f"{summary['policy']} on {summary['cache_system']}: {summary['jobs']} jobs")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label in (("avg_jct_s", "average JCT"), ("p50_jct_s", "median JCT"), ("p99_jct_s", "p99 JCT"), ("makespan_s", "makespan")):
        table.add_row(label, f"{summary[key] / 3600:.2f} h")
    table.add_row("fairness ratio (Eq. 8, time average)", f"{summary['avg_fairness_ratio']:.3f}")
    table.add_row("GPU utilisation", f"{summary['gpu_utilization']:.1%}")
    table.add_row("remote IO utilisation", f"{summary['remote_io_utilization']:.1%}")
    table.add_row("simulation wall / CPU time", f"{summary['sim_wall_s']:.1f} s / {summary['sim_cpu_s']:.1f} s")
    console = table_console()
    console.print(table)
    # Its own line, unwrapped: what was simulated is the first thing to check (a unit typo in
    # --cache shows here, not only in the JCTs).
    print(f"cluster: {summary['cluster']['description']}", flush=True)
    console.print(f"wrote {out}/summary.json, jobs.csv, timeline.csv")
