"""`silod demo`: the whole system on one machine, with real FUSE mounts and real data.

1. Generate two small real datasets (files of random bytes) in WORKDIR/remote, the "remote"
   store (file://). Dataset A is small and read by two fast jobs (high cache efficiency f*/d);
   dataset B is larger and read by two slower jobs.
2. SiloD run: a data manager (`silod datamanager`, a subprocess), the scheduler service core
   (in-process, SQLite) with the SiloD estimator and the chosen policy, the local backend
   (one worker process + one `silod mount` per job), four jobs, a cache smaller than the data
   and a remote link that cannot feed everyone at full speed. A live table shows the jobs.
3. Storage-unaware run: the same jobs, policy and cluster with the vanilla estimator (perf = f*)
   and no data manager: each job gets a fixed equal share of the link and a private cache of
   its GPU share (CoorDL-style), as the local backend does for unmanaged storage.
4. JCTs of both runs side by side.

`silod demo --cpu` shows the input pipeline as a resource instead (issue 22): the cluster has
few CPU cores, one job decodes its items on CPU (its workers do real CPU work per item, limited
to the cores the scheduler gives it: scheduler/backends/cpu_limit.py) and one job does not. The
same jobs run twice: with the cores allocated by the estimator (the CPU-bound job gets the cores
the other job does not need) and with GPU-proportional cores (today's practice). Its cache and
link are ample, so more cache would buy it nothing (the live table's `bound` column says cpu):
more cores speed it up.

The SiloD run is wired as `silod serve --backend local --datamanager URL` is: the service fills
each dataset's measured cached bytes into the snapshot from the data manager's status (so the
policy plans remote IO on the filled part of the cache, not on the allocation), and
`WorkConservingPusher` gives unused link capacity to jobs that want more.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from estimator.errors import UserError

MB = 1e6


@dataclass(frozen=True)
class DemoDataset:
    name: str
    files: int
    min_size: int
    max_size: int


@dataclass(frozen=True)
class DemoJob:
    name: str
    dataset: str
    ideal: float  # f*, bytes/s
    epochs: float
    cpu_rate: float | None = None  # bytes/s per core of its CPU stage; None: not CPU-bound
    #: runs the real PyTorch training script (silod_client/examples/train_cnn.py) instead of the stand-in
    pytorch: bool = False


@dataclass(frozen=True)
class Scenario:
    datasets: tuple[DemoDataset, ...]
    jobs: tuple[DemoJob, ...]
    gpus: int
    cache: float  # bytes
    remote_io: float  # bytes/s
    timeout_s: float
    cpus_per_node: float | None = None  # CPU modelled (and enforced by the local backend) when set


FULL = Scenario(
    datasets=(DemoDataset("images-a", 150, 100_000, 300_000), DemoDataset("images-b", 200, 250_000, 550_000)),
    jobs=(DemoJob("resnet-a1", "images-a", 10 * MB, 4), DemoJob("resnet-a2", "images-a", 10 * MB, 4),
          DemoJob("effnet-b1", "images-b", 5 * MB, 3), DemoJob("effnet-b2", "images-b", 5 * MB, 3)),
    gpus=4, cache=40 * MB, remote_io=12 * MB, timeout_s=300,
)
QUICK = Scenario(
    datasets=(DemoDataset("images-a", 50, 100_000, 240_000), DemoDataset("images-b", 60, 200_000, 400_000)),
    jobs=(DemoJob("resnet-a1", "images-a", 8 * MB, 3), DemoJob("resnet-a2", "images-a", 8 * MB, 3),
          DemoJob("effnet-b1", "images-b", 4 * MB, 2), DemoJob("effnet-b2", "images-b", 4 * MB, 2)),
    gpus=4, cache=10 * MB, remote_io=7 * MB, timeout_s=120,
)

# One node of 2 GPUs and half a core (small, so that the limit binds even on a busy machine):
# GPU-proportional gives each job a quarter of a core; the estimator gives the decoding job the
# whole half (the text job needs none). Items are random bytes, so each costs exactly
# size / cpu_rate of CPU (the calibrated loop). Cache and link are ample.
CPU_FULL = Scenario(
    datasets=(DemoDataset("images-c", 50, 20_000, 40_000), DemoDataset("text-d", 40, 20_000, 40_000)),
    jobs=(DemoJob("decode-c", "images-c", 4 * MB, 3, cpu_rate=0.4 * MB), DemoJob("text-d", "text-d", 1 * MB, 3)),
    gpus=2, cache=100 * MB, remote_io=50 * MB, timeout_s=300, cpus_per_node=0.5,
)
CPU_QUICK = Scenario(
    datasets=(DemoDataset("images-c", 30, 20_000, 30_000), DemoDataset("text-d", 30, 20_000, 30_000)),
    jobs=(DemoJob("decode-c", "images-c", 4 * MB, 2, cpu_rate=0.4 * MB), DemoJob("text-d", "text-d", 1 * MB, 2)),
    gpus=2, cache=100 * MB, remote_io=50 * MB, timeout_s=150, cpus_per_node=0.5,
)


# `--pytorch`: the real PyTorch job (a small CNN on JPEGs decoded by a DataLoader's workers) next
# to a stand-in job, each on its own dataset of real JPEGs; a cache that holds half of them and a
# link that cannot feed both at full speed. Its declared f* is a guess (the service measures it).
TORCH_FULL = Scenario(
    datasets=(DemoDataset("jpegs-torch", 240, 0, 0), DemoDataset("jpegs-standin", 240, 0, 0)),
    jobs=(DemoJob("cnn-torch", "jpegs-torch", 3 * MB, 4, pytorch=True), DemoJob("standin", "jpegs-standin", 3 * MB, 4)),
    gpus=2, cache=6 * MB, remote_io=3 * MB, timeout_s=400,
)
TORCH_QUICK = Scenario(
    datasets=(DemoDataset("jpegs-torch", 120, 0, 0), DemoDataset("jpegs-standin", 120, 0, 0)),
    jobs=(DemoJob("cnn-torch", "jpegs-torch", 3 * MB, 3, pytorch=True), DemoJob("standin", "jpegs-standin", 3 * MB, 3)),
    gpus=2, cache=3 * MB, remote_io=1.5 * MB, timeout_s=240,
)


def make_jpegs(root: Path, count: int, seed: int, side: int = 96) -> int:
    """`count` real JPEG images (noise, so they do not compress to nothing: ~20 KB at 96x96) in
    ten class directories; their total size."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(count):
        sub = root / f"class{i % 10:02d}"
        sub.mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        path = sub / f"img{i:05d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        total += path.stat().st_size
    return total


def torch_problem() -> str | None:
    """Why the PyTorch job cannot run here (None when it can)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed: pip install torch==2.13.0 (or the silod[torch] extra)"
    return None


def pytorch_program(epochs: float, workers: int = 2) -> list[str]:
    import sys

    return [sys.executable, "-m", "silod_client.examples.train_cnn", "--epochs", str(max(1, int(round(epochs)))),
            "--workers", str(workers), "--report-interval", "2"]


def make_dataset(root: Path, spec: DemoDataset, seed: int) -> int:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(spec.files):
        size = rng.randint(spec.min_size, spec.max_size)
        sub = root / f"class{i % 10:02d}"
        sub.mkdir(exist_ok=True)
        (sub / f"img{i:05d}.jpg").write_bytes(rng.randbytes(size))
        total += size
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DataManager:
    """`silod datamanager` as a subprocess on a free port."""

    def __init__(self, state: Path, log_path: Path):
        from scheduler.backends.local import silod_cmd

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [*silod_cmd(), "datamanager", "--listen", f"127.0.0.1:{self.port}", "--state", str(state)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        import httpx

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"the data manager exited with code {self.proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/status", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        self.close()
        raise UserError(f"the data manager did not answer within 30 s; see {log_path}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@dataclass
class RunResult:
    label: str
    jct: dict[str, float | None]  # job name -> seconds (None: did not finish)
    states: dict[str, str]
    makespan: float | None
    wall_s: float

    @property
    def avg_jct(self) -> float | None:
        vals = [v for v in self.jct.values() if v is not None]
        return sum(vals) / len(vals) if vals and len(vals) == len(self.jct) else None


@dataclass(frozen=True)
class JobRow:
    """One line of the live table, already formatted."""

    job: str
    data: str
    ideal: str
    state: str
    done: str
    epoch: str
    gpus: str
    cache: str
    io_cap: str
    hit: str
    speed: str
    cores: str = "-"
    bound: str = "-"


# (header, JobRow field, shown without --wide). The default set fits an 80-column terminal;
# --wide adds the dataset, f* and epoch columns.
COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("job", "job", True), ("data", "data", False), ("f*", "ideal", False), ("state", "state", True),
    ("done", "done", True), ("ep", "epoch", False), ("GPU", "gpus", True), ("cache", "cache", True),
    ("IO cap", "io_cap", True), ("hit", "hit", True), ("speed", "speed", True),
    ("cores", "cores", False), ("bound", "bound", False),
)
# `--cpu`: the cores and what bounds each job replace the storage columns in the 80-column set.
CPU_DEFAULT = ("job", "state", "done", "ep", "GPU", "cores", "bound", "speed")


def render_table(title: str, rows: list[JobRow], wide: bool = False, cpu: bool = False) -> Any:
    from rich.table import Table

    def shown(header: str, default: bool) -> bool:
        return wide or (header in CPU_DEFAULT if cpu else default and header not in ("cores", "bound"))

    table = Table(title=title)
    for header, attr, default in COLUMNS:
        if shown(header, default):
            table.add_column(header, justify="left" if attr in ("job", "data", "state", "bound") else "right",
                             no_wrap=True)
    for row in rows:
        table.add_row(*(getattr(row, attr) for header, attr, default in COLUMNS if shown(header, default)))
    return table


def _job_rows(service: Any, names: dict[str, str]) -> list[JobRow]:
    from estimator.units import format_rate, format_size
    from scheduler.service.scheduler_process import Principal

    admin = Principal("admin", is_admin=True)
    cache = {c.dataset: c.bytes for c in service.allocations(admin).cache}
    rows = []
    for j in service.list_jobs(admin):
        st = service.backend.job_status(j.id) or {}
        mount = st.get("mount") or {}
        io = mount.get("io_rate_bytes_per_s")
        hit = st.get("hit_ratio")
        running = j.state == "running"
        if j.dataset in cache:
            cache_text = format_size(cache[j.dataset])
        elif running and mount.get("cache_allocation_bytes") is not None:
            cache_text = format_size(mount["cache_allocation_bytes"]) + " own"
        else:
            cache_text = "-"
        rows.append(JobRow(
            job=names.get(j.id, j.name), data=j.dataset[-1:].upper(), ideal=format_rate(j.ideal_throughput),
            state=j.state, done=f"{j.consumed_bytes / j.total_bytes:.0%}",
            epoch=str(st.get("epoch", "-")) if running else "-", gpus=f"{j.allocated_gpus}/{j.gpus}",
            cache=cache_text, io_cap=(format_rate(io) if io is not None else "none") if running else "-",
            hit=f"{hit:.0%}" if (hit is not None and running) else "-",
            speed=format_rate(st.get("throughput") or 0.0) if running else "-",
            cores="-" if not running or j.allocated_cpus is None else f"{j.allocated_cpus:.1f}",
            bound=(j.bottleneck.bound if j.bottleneck is not None else "-") if running else "-",
        ))
    return rows


def _table(title: str, service: Any, names: dict[str, str], wide: bool = False, cpu: bool = False) -> Any:
    return render_table(title, _job_rows(service, names), wide, cpu)


@dataclass
class DemoApi:
    """`silod demo --serve HOST:PORT`: the REST API, the web view and /metrics over the demo's
    service while each run lasts (uvicorn in a thread of this process), with one admin token:
    SILOD_ADMIN_TOKEN if set, else a random one that is printed."""

    host: str
    port: int
    token: str

    @classmethod
    def from_option(cls, value: str) -> DemoApi:
        import os
        import secrets

        from scheduler.service.cli import parse_free_listen

        host, port = parse_free_listen(value, "--serve")
        return cls(host, port, os.environ.get("SILOD_ADMIN_TOKEN") or secrets.token_hex(16))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def describe(self) -> list[str]:
        return [f"web view: {self.url}/ui#token={self.token}",
                f"terminal: SILOD_SERVER={self.url} SILOD_TOKEN={self.token} silod top",
                f"metrics:  {self.url}/metrics"]

    @contextlib.contextmanager
    def serving(self, service: Any):  # type: ignore[no-untyped-def]
        import secrets
        import threading

        import uvicorn

        from scheduler.service.api.app import create_app
        from scheduler.service.api.auth import TokenStore

        tokens = TokenStore(service.engine, secrets.token_bytes(32), admin_token=self.token)
        # Jobs that run a program (--pytorch) report their step times here, with a token of their own.
        service.job_tokens = lambda spec: tokens.mint_job_token(spec.owner, spec.job_id, 86400)
        app = create_app(service, tokens, run_loop=False)  # the demo starts and stops the loop itself
        server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                               access_log=False, lifespan="on"))
        thread = threading.Thread(target=server.run, name="silod-demo-api", daemon=True)
        thread.start()
        try:
            yield
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def run_once(label: str, scenario: Scenario, sources: dict[str, tuple[str, int]], workdir: Path, policy: str,
             managed: bool, console: Any, live_output: bool = True, wide: bool = False,
             api: DemoApi | None = None, cpu_allocation: str | None = None) -> RunResult:
    """One run of the scenario through the real service core, backend, mounts (and data manager)."""
    from rich.live import Live

    from estimator.pipeline import InputPipeline
    from estimator.units import format_size
    from policies.estimators import VanillaEstimator
    from policies.registry import get_policy
    from scheduler.backends.base import BackendConfig, load_backend
    from scheduler.backends.local import WorkConservingPusher
    from scheduler.core.cluster import load_cluster
    from scheduler.core.planner import SchedulingCore
    from scheduler.service.db import open_database
    from scheduler.service.scheduler_process import NewDataset, NewJob, Principal, SchedulerService, ServiceConfig
    from scheduler.service.cli import make_pusher
    from scheduler.service.types import JobProgram

    run_dir = workdir / label
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    capacity, speed = load_cluster(None, gpus=scenario.gpus, gpus_per_node=scenario.gpus, cache=scenario.cache,
                                   remote_io=scenario.remote_io, cpus_per_node=scenario.cpus_per_node,
                                   cpu_allocation=cpu_allocation)
    dm = DataManager(run_dir / "datamanager", run_dir / "datamanager.log") if managed else None
    # The demo's "remote store" is a local directory: the operator's allow-list names exactly it.
    from contract.uri_policy import UriPolicy

    allowed = UriPolicy(("s3", "https", (workdir / "remote").as_uri() + "/"))
    options = {"batch_bytes": "512KB"} if managed else {"batch_bytes": "512KB", "unmanaged_io": "equal",
                                                          "unmanaged_cache": "coordl"}
    if api is not None:
        options["api_url"] = api.url
    backend = load_backend("local", BackendConfig(
        capacity=capacity, state_dir=run_dir / "backend", datamanager_url=dm.url if dm else None,
        options=options, allowed_uris=allowed.allowed,
    ))
    pusher = WorkConservingPusher(make_pusher(dm.url), backend, capacity.remote_io) if dm else None
    config = ServiceConfig(capacity=capacity, policy=policy, round_seconds=2.0, poll_seconds=0.5, min_event_gap_s=1.0,
                           gpu_speed=speed, uri_policy=allowed)
    service = SchedulerService(open_database(f"sqlite:///{run_dir / 'silod.db'}"), backend, config, pusher=pusher,
                  datamanager_url=dm.url if dm else None)
    if not managed:
        service.core = SchedulingCore(get_policy(policy), VanillaEstimator(), round_s=config.round_seconds)
    admin = Principal("admin", is_admin=True)
    names: dict[str, str] = {}
    t0 = time.time()
    serving = api.serving(service) if api is not None else contextlib.nullcontext()
    try:
        serving.__enter__()
        for ds in scenario.datasets:
            uri, size = sources[ds.name]
            service.register_dataset(admin, NewDataset(ds.name, uri, float(size)))
        for job in scenario.jobs:
            pipeline = None if job.cpu_rate is None else InputPipeline(job.cpu_rate)
            program = JobProgram(tuple(pytorch_program(job.epochs))) if job.pytorch else None
            rec = service.submit_job(admin, NewJob(job.name, 1, job.dataset, epochs=job.epochs, ideal_throughput=job.ideal,
                                                   pipeline=pipeline, program=program))
            names[rec.id] = job.name
        service.start()
        cpu = scenario.cpus_per_node is not None
        title = (f"{label}: policy {policy}, {scenario.gpus} GPUs, cache {format_size(scenario.cache)}, "
                 f"remote IO {format_size(scenario.remote_io)}/s"
                 + (f", {scenario.cpus_per_node:g} CPU cores" if cpu else ""))
        deadline = time.monotonic() + scenario.timeout_s
        with Live(_table(title, service, names, wide, cpu), console=console, refresh_per_second=4,
                  transient=not live_output) as live:
            while time.monotonic() < deadline:
                jobs = service.list_jobs(admin)
                live.update(_table(title, service, names, wide, cpu))
                if all(j.state in ("finished", "failed", "cancelled") for j in jobs):
                    break
                time.sleep(0.5)
        jobs = service.list_jobs(admin)
        limiter = getattr(backend, "cpu_limiter", lambda: None)()
        if limiter is not None:
            console.print(f"{label}: CPU cores enforced with {limiter.mode}"
                          + (f" ({limiter.base})" if limiter.base else ""), highlight=False)
    finally:
        serving.__exit__(None, None, None)
        service.stop()
        backend.stop_all()
        if pusher is not None:
            pusher.close()
        if dm is not None:
            dm.close()
        service.engine.dispose()
    jct = {names[j.id]: (j.finish_time - j.submit_time) if j.state == "finished" and j.finish_time else None for j in jobs}
    finishes = [j.finish_time for j in jobs if j.finish_time and j.state == "finished"]
    submit = min(j.submit_time for j in jobs)
    return RunResult(label, jct, {names[j.id]: j.state for j in jobs},
                     (max(finishes) - submit) if len(finishes) == len(jobs) else None, time.time() - t0)


def run_demo(workdir: Path, quick: bool, policy: str = "fifo", baseline: bool = True, console: Any = None,
             wide: bool = False, api: DemoApi | None = None, cpu: bool = False, pytorch: bool = False) -> dict:
    from scheduler.console import table_console
    from rich.table import Table

    from scheduler.backends.local import fuse_problems

    problems = fuse_problems()
    if problems:
        raise UserError("silod demo needs real FUSE mounts: " + "; ".join(problems))
    shown_api = api
    if pytorch:
        problem = torch_problem()
        if problem:
            raise UserError(f"silod demo --pytorch: {problem}")
        if api is None:  # the PyTorch job reports its step times to the API: serve it on a free port
            api = DemoApi.from_option(f"127.0.0.1:{_free_port()}")
    console = console or table_console()
    if pytorch:
        scenario = TORCH_QUICK if quick else TORCH_FULL
    else:
        scenario = (CPU_QUICK if quick else CPU_FULL) if cpu else (QUICK if quick else FULL)
    workdir.mkdir(parents=True, exist_ok=True)
    sources: dict[str, tuple[str, int]] = {}
    for i, ds in enumerate(scenario.datasets):
        root = workdir / "remote" / ds.name
        shutil.rmtree(root, ignore_errors=True)
        size = make_jpegs(root, ds.files, seed=i) if pytorch else make_dataset(root, ds, seed=i)
        sources[ds.name] = (root.as_uri(), size)
    total = sum(s for _, s in sources.values())
    console.print(f"[bold]silod demo[/]: {len(scenario.datasets)} datasets ({total / MB:.1f} MB of files in "
                  f"{workdir / 'remote'}), {len(scenario.jobs)} jobs, cache {scenario.cache / MB:.0f} MB, "
                  f"remote link {scenario.remote_io / MB:.0f} MB/s"
                  + (f", {scenario.cpus_per_node:g} CPU core(s) for input pipelines" if cpu else ""))
    if shown_api is not None:
        for line in shown_api.describe():
            console.print(line, highlight=False, soft_wrap=True)
    if cpu:
        runs = [run_once("silod", scenario, sources, workdir, policy, managed=True, console=console, wide=wide, api=api,
                         cpu_allocation="model")]
        if baseline:
            runs.append(run_once("gpu-proportional", scenario, sources, workdir, policy, managed=True, console=console,
                                 wide=wide, api=api, cpu_allocation="gpu-proportional"))
    else:
        runs = [run_once("silod", scenario, sources, workdir, policy, managed=True, console=console, wide=wide, api=api)]
        if baseline:
            runs.append(run_once("storage-unaware", scenario, sources, workdir, policy, managed=False, console=console,
                                 wide=wide, api=api))
    table = Table(title="Job completion times (s)")
    table.add_column("job")
    for r in runs:
        table.add_column(r.label, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for job in scenario.jobs:
        table.add_row(job.name, *(fmt(r.jct[job.name]) if r.states[job.name] == "finished" else r.states[job.name] for r in runs))
    table.add_row("[bold]average JCT", *(f"[bold]{fmt(r.avg_jct)}" for r in runs))
    table.add_row("makespan", *(fmt(r.makespan) for r in runs))
    console.print(table)
    summary: dict = {"quick": quick, "policy": policy, "cpu": cpu, "runs": {r.label: {"jct_s": r.jct, "states": r.states,
                     "avg_jct_s": r.avg_jct, "makespan_s": r.makespan, "wall_s": r.wall_s} for r in runs}}
    if baseline and runs[0].avg_jct and runs[1].avg_jct:
        summary["avg_jct_speedup"] = runs[1].avg_jct / runs[0].avg_jct
        other = runs[1].label
        console.print(f"SiloD average JCT is {summary['avg_jct_speedup']:.2f}x better than {other} "
                      f"({runs[0].avg_jct:.1f}s vs {runs[1].avg_jct:.1f}s).")
        if cpu:
            job = scenario.jobs[0].name
            a, b = runs[0].jct.get(job), runs[1].jct.get(job)
            if a and b:
                summary["cpu_job_speedup"] = b / a
                console.print(f"{job} is CPU-bound: with the cores the text job does not need it finishes "
                              f"{b / a:.2f}x sooner ({a:.1f}s vs {b:.1f}s); its cache and link were the same.")
    return summary


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        quick: Annotated[bool, typer.Option("--quick", help="smaller data and shorter jobs (well under a minute)")] = False,
        workdir: Annotated[Path | None, typer.Option("--workdir", help="where data, caches and logs go [default: a temp dir]")] = None,
        policy: Annotated[str, typer.Option(help="scheduling policy for both runs")] = "fifo",
        baseline: Annotated[bool, typer.Option("--baseline/--no-baseline", help="also run the storage-unaware configuration")] = True,
        keep: Annotated[bool, typer.Option("--keep", help="keep the work directory (logs, caches)")] = False,
        json_out: Annotated[Path | None, typer.Option("--json", help="write the JCTs as JSON here")] = None,
        wide: Annotated[bool, typer.Option("--wide", help="all columns in the live table (dataset, f*, epoch); wider than 80")] = False,
        serve: Annotated[str | None, typer.Option("--serve", help="HOST:PORT: also serve the API, the web view (/ui) and"
                                                  " /metrics there while the demo runs")] = None,
        cpu: Annotated[bool, typer.Option("--cpu", help="the CPU demo: a CPU-bound job sped up by cores (the estimator's"
                                          " allocation vs GPU-proportional cores), not by cache")] = False,
        pytorch: Annotated[bool, typer.Option("--pytorch", help="a real PyTorch job (CNN on JPEGs, DataLoader workers) next"
                                              " to a stand-in job; needs torch")] = False,
    ) -> None:
        """The whole system on one machine: real datasets, data manager, scheduler, FUSE mounts; SiloD vs storage-unaware."""
        import json

        from policies.registry import resolve_policy_name

        policy = resolve_policy_name(policy)
        from scheduler.outputs import ensure_writable_dir, ensure_writable_file

        if json_out is not None:
            ensure_writable_file(json_out, "--json")
        if cpu and pytorch:
            raise UserError("--cpu and --pytorch are two different demos; give one")
        if pytorch and torch_problem():
            raise UserError(f"--pytorch: {torch_problem()}")
        api = DemoApi.from_option(serve) if serve is not None else None
        if workdir is not None:
            workdir = ensure_writable_dir(workdir, "--workdir").absolute()  # sources become file:// URIs
        work = workdir or Path(tempfile.mkdtemp(prefix="silod-demo-"))
        try:
            summary = run_demo(work, quick=quick, policy=policy, baseline=baseline, wide=wide, api=api, cpu=cpu,
                               pytorch=pytorch)
        finally:
            if workdir is None and not keep:
                shutil.rmtree(work, ignore_errors=True)
            elif keep or workdir is not None:
                typer.echo(f"work directory kept: {work}", err=True)
        if json_out is not None:
            json_out.write_text(json.dumps(summary, indent=2))
        unfinished = [f"{label}/{job}" for label, r in summary["runs"].items() for job, s in r["states"].items() if s != "finished"]
        if unfinished:
            typer.echo(f"error: jobs did not finish: {', '.join(unfinished)}", err=True)
            raise typer.Exit(1)

