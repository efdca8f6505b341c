"""The local backend: a cluster of N virtual GPUs on this machine, with real FUSE mounts.

`silod serve --backend local` loads `create_backend(config)`. Starting a job spawns a worker
process (`python -m scheduler.backends.local_worker JOBDIR/spec.json`, see that module) that
mounts the job's dataset with `silod mount` and trains the paper's "accelerated GPU" way (real
reads, `sleep()` for the compute). The backend only launches, watches and stops workers; it
never blocks for long.

State directory (``BackendConfig.state_dir``/local)::

    cache/                     the node's shared cache dir (--cache-dir of every managed mount):
                               jobs reading one dataset share <cache>/<dataset>/
    jobs/<job_id>/spec.json    what the current attempt runs (WorkerSpec)
    jobs/<job_id>/worker.pid   {"pid", "start_time", "attempt"}: identifies the live worker
    jobs/<job_id>/status.json  written by the worker: progress, throughput, mount counters
    jobs/<job_id>/mnt/         the job's mount point; worker.log, mount.log, mount-stats.json
    jobs/<job_id>/reported     the terminal state was handed to the service (see poll)

Fault tolerance: workers run in their own sessions (process groups), so they survive the
service (`kill -9` included). A new backend object re-adopts every worker whose pid file still
names a live process (same pid *and* same start time, so a recycled pid is not mistaken for
it) and reports what adopted jobs do through `poll()`; `running_jobs()` says which jobs it
runs. A worker that died with the service's view of it stale (finished while the service was
down) is reported when the service calls `stop()` or `poll()`.

Storage allocations. With a data manager (``datamanager_url``) every mount gets ``--manager``
and follows the allocations the service pushes; the static flags only seed it. Without one,
the allocation of the job's start is applied statically. When the policy leaves storage
unmanaged (``cache_bytes``/``remote_io`` None, e.g. a storage-unaware "vanilla" policy) the
backend options decide (``--backend-opt KEY=VALUE``):

- ``unmanaged_io``: ``equal`` (default: a fixed share of the cluster link proportional to the
  job's GPUs, i.e. remote_io * gpus / cluster gpus), ``none`` (unthrottled) or a rate (``5MB/s``);
- ``unmanaged_cache``: ``coordl`` (default: a private cache per job of cache * gpus / cluster
  gpus, not shared, as CoorDL), ``none`` (no cache), or a size shared per dataset (``20MB``);
- ``batch_bytes`` (default 1MB), ``prefetch_threads`` (4), ``prefetch_batches`` (2): the
  worker's training pipeline;
- ``cpu_limit``: how a job with a CPU stage (``cpu_rate``) is held to its allocated cores:
  ``auto`` (default: cgroup v2 ``cpu.max``, else cgroup v1 CFS quota, else CPU affinity; see
  scheduler/backends/cpu_limit.py), one of ``cgroup2``, ``cgroup1``, ``affinity``, or ``none``
  (preprocessing runs unlimited). The mechanism in use is logged and shown in the job's
  status (``cpu.mode``). A new allocation of cores (`update`) changes the running job's limit.

Without a data manager a cap of 0 bytes/s (the policy expects the cache to serve the job) would
pause a job with a cold cache for ever, since a static mount cannot be raised later; such a job
gets the ``equal`` share instead. With a data manager, `WorkConservingPusher` gives idle link
capacity to jobs whose measured demand is above their cap (e.g. while the cache warms up).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from estimator.errors import UserError
from estimator.units import parse_rate, parse_size
from scheduler.backends.base import (
    BackendConfig,
    DatasetInfo,
    ClusterBackend,
    ClusterDescription,
    JobAllocation,
    JobEvent,
    JobSpec,
    capacity_description,
)
from scheduler.backends.cpu_limit import MODES as CPU_MODES
from scheduler.backends.cpu_limit import CpuLimiter
from scheduler.backends.local_worker import WorkerSpec, force_unmount, read_json, write_json_atomic

log = logging.getLogger("silod.backend.local")

STOP_TIMEOUT_S = 15.0
TERMINAL = ("finished", "failed")


# SILOD_SECRET_KEYS opens every tenant's stored credentials (scheduler/service/sealed.py): a job
# (or its mount) holding it could read any tenant's secrets from a database copy (issue 47).
SERVICE_SECRETS = ("SILOD_ADMIN_TOKEN", "SILOD_TOKEN_KEY", "SILOD_METRICS_TOKEN", "SILOD_DM_SCHEDULER_TOKEN",
                   "SILOD_DM_AGENT_TOKEN", "SILOD_DM_METRICS_TOKEN", "SILOD_DM_TOKEN", "SILOD_SECRET_KEYS")


def source_env(dataset: DatasetInfo) -> dict[str, str]:
    """Environment for the job's mount: the dataset owner's credential, or anonymous s3 reads,
    so the data path never reads a tenant's dataset with this machine's own credentials."""
    from contract.credentials import ANONYMOUS_ENV, CREDENTIAL_ENV

    env = {name: "" for name in CREDENTIAL_ENV.values()}  # nothing inherited from the service
    # The service's own secrets never reach a job's processes: its admin and HMAC keys, its
    # data-manager token. The mount talks to the data manager with the agent token only.
    for name in SERVICE_SECRETS:
        env[name] = ""
    env["SILOD_DM_TOKEN"] = os.environ.get("SILOD_DM_AGENT_TOKEN", "")
    if dataset.credential is not None:
        env.update(dataset.credential.to_env())
    else:
        env[ANONYMOUS_ENV] = "1"
    return env


def silod_cmd() -> list[str]:
    """The `silod` console script of this interpreter's environment (or the same entry point)."""
    script = Path(sys.executable).parent / "silod"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from scheduler.cli import main; main()"]


def fuse_problems() -> list[str]:
    """Why real FUSE mounts cannot work here (empty when they can)."""
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse is missing (load the fuse module, or run the container with --device /dev/fuse)")
    elif os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        problems.append("/dev/fuse is not readable and writable by this user")
    if shutil.which("fusermount3") is None:
        problems.append("fusermount3 is not installed (apt-get install fuse3)")
    return problems


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (None if gone or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _child_of(pid: int, parent: int) -> bool:
    """`pid` is a live child of `parent` (the worker's own preprocessing processes only)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat[stat.rindex(")") + 2:].split()[1]) == parent


def _safe_id(job_id: str) -> bool:
    return bool(job_id) and ".." not in job_id and "/" not in job_id and job_id.replace("-", "").replace("_", "").replace(".", "").isalnum()


def _alive(pid: int, start_time: int | None) -> bool:
    st = process_start_time(pid)
    return st is not None and (start_time is None or st == start_time)


@dataclass
class _Worker:
    job_id: str
    dir: Path
    pid: int
    start_time: int | None
    attempt: int
    total_bytes: float
    popen: subprocess.Popen | None = None  # None for an adopted worker (not our child)
    reported_consumed: float = -1.0

    def alive(self) -> bool:
        if self.popen is not None:
            if self.popen.poll() is not None:
                return False
        return _alive(self.pid, self.start_time)


@dataclass(frozen=True)
class LocalOptions:
    batch_bytes: int = 1 << 20
    prefetch_threads: int = 4
    prefetch_batches: int = 2
    unmanaged_io: str = "equal"
    unmanaged_cache: str = "coordl"
    cpu_limit: str = "auto"
    #: where jobs' programs reach the API (SILOD_SERVER); `silod serve` sets its own address
    api_url: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> LocalOptions:
        known = {"batch_bytes", "prefetch_threads", "prefetch_batches", "unmanaged_io", "unmanaged_cache", "cpu_limit",
                 "api_url"}
        unknown = set(options) - known
        if unknown:
            raise UserError(f"unknown local backend option(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
        out: dict[str, Any] = {}
        if "batch_bytes" in options:
            out["batch_bytes"] = max(1, int(parse_size(options["batch_bytes"], what="batch_bytes")))
        for key in ("prefetch_threads", "prefetch_batches"):
            if key in options:
                try:
                    out[key] = int(options[key])
                except ValueError:
                    raise UserError(f"--backend-opt {key}={options[key]!r} must be an integer") from None
                if not 1 <= out[key] <= 64:
                    raise UserError(f"--backend-opt {key} must be between 1 and 64")
        if "unmanaged_io" in options:
            v = options["unmanaged_io"]
            if v not in ("equal", "none"):
                parse_rate(v, what="unmanaged_io")
            out["unmanaged_io"] = v
        if "unmanaged_cache" in options:
            v = options["unmanaged_cache"]
            if v not in ("coordl", "none"):
                parse_size(v, what="unmanaged_cache")
            out["unmanaged_cache"] = v
        if "cpu_limit" in options:
            v = options["cpu_limit"]
            if v not in ("auto", "none", *CPU_MODES):
                raise UserError(f"--backend-opt cpu_limit={v!r}: choose auto, none, {', '.join(CPU_MODES)}")
            out["cpu_limit"] = v
        if "api_url" in options:
            v = options["api_url"].strip()
            if not (v.startswith("http://") or v.startswith("https://")):
                raise UserError(f"--backend-opt api_url={v!r} must be an http(s) URL, e.g. http://127.0.0.1:8080")
            out["api_url"] = v.rstrip("/")
        return cls(**out)


class LocalBackend(ClusterBackend):
    name = "local"

    def __init__(self, config: BackendConfig):
        self.config = config
        self.options = LocalOptions.parse(config.options)
        self.root = Path(config.state_dir).absolute() / "local"
        self.jobs_dir = self.root / "jobs"
        self.cache_dir = self.root / "cache"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._description = capacity_description(config.capacity)
        self._workers: dict[str, _Worker] = {}
        self._events: list[JobEvent] = []
        self._lock = threading.RLock()
        self.preprocessed_dir = self.root / "preprocessed"  # autocaching: <dataset key>/ (backends/preprocessed.py)
        self._autocache: dict[str, tuple[float, float]] = {}  # dataset key -> (expansion, budget bytes)
        self._limiter: CpuLimiter | None = None  # detected at the first job with a CPU stage
        self._cores: dict[str, float | None] = {}  # job -> allocated cores (jobs with a CPU stage)
        self._cpu_pids: dict[str, tuple[int, ...]] = {}  # job -> preprocessing pids last limited
        # The operator's allow-list for the mounts (fuse_client checks every request against
        # it); without one a mount would trust its own --source, names resolved at connect time
        # included, and a registered name that later resolves to an internal address would pass.
        from contract.uri_policy import ENV as ALLOWED_URIS_ENV

        self._policy_env = {ALLOWED_URIS_ENV: ",".join(config.allowed_uris)} if config.allowed_uris else {}
        self.adopted: tuple[str, ...] = self._adopt()

    # ------------------------------------------------------------------ contract

    def describe(self) -> ClusterDescription:
        return self._description

    def start(self, job: JobSpec, allocation: JobAllocation) -> None:
        problems = fuse_problems()
        if problems:
            raise RuntimeError("the local backend needs real FUSE mounts: " + "; ".join(problems))
        if not _safe_id(job.job_id):
            raise RuntimeError(f"job id {job.job_id!r} cannot name a directory")
        with self._lock:
            if job.job_id in self._workers:
                self._terminate(job.job_id)
            jdir = self.jobs_dir / job.job_id
            jdir.mkdir(parents=True, exist_ok=True)
            previous = read_json(jdir / "spec.json") or {}
            attempt = int(previous.get("attempt", 0)) + 1
            force_unmount(jdir / "mnt")
            (jdir / "reported").unlink(missing_ok=True)
            (jdir / "status.json").unlink(missing_ok=True)
            cache_dir, cache_size, io_rate = self._storage_flags(job, allocation, jdir)
            cpu = self._cpu_flags(job, allocation)
            spec = WorkerSpec(
                job_id=job.job_id, attempt=attempt, dataset=job.dataset.name, source=job.dataset.uri,
                ideal_throughput=float(job.ideal_throughput), total_bytes=float(job.total_bytes),
                consumed_bytes=float(job.consumed_bytes), mountpoint=str(jdir / "mnt"), cache_dir=str(cache_dir),
                stats_file=str(jdir / "mount-stats.json"), status_file=str(jdir / "status.json"),
                mount_log=str(jdir / "mount.log"), silod_cmd=silod_cmd(), cache_size=cache_size, io_rate=io_rate,
                manager=self.config.datamanager_url, batch_bytes=self.options.batch_bytes,
                prefetch_threads=self.options.prefetch_threads, prefetch_batches=self.options.prefetch_batches,
                preprocessed_dir=str(self.preprocessed_dir / job.dataset.name),
                **cpu, **self._program_fields(job),
            )
            write_json_atomic(jdir / "spec.json", asdict(spec))
            with open(jdir / "worker.log", "ab") as logf:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "scheduler.backends.local_worker", str(jdir / "spec.json")],
                    stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,  # survives the service, and stop() can signal the group
                    env=self.worker_env(job),
                )
            start_time = process_start_time(popen.pid)
            write_json_atomic(jdir / "worker.pid", {"pid": popen.pid, "start_time": start_time, "attempt": attempt})
            self._workers[job.job_id] = _Worker(
                job.job_id, jdir, popen.pid, start_time, attempt, float(job.total_bytes), popen,
                reported_consumed=float(job.consumed_bytes),
            )
            log.info("job %s: worker %d started (attempt %d, cache %s, io %s, cpu %s)", job.job_id, popen.pid, attempt,
                     cache_size, io_rate, self._cpu_text(job.job_id) if cpu else "not CPU-bound")

    def worker_env(self, job: JobSpec) -> dict[str, str]:
        """The environment a job's worker (its mount and its program) starts with: this process's
        without the service's secrets (SERVICE_SECRETS), then the dataset owner's credential."""
        return {**{k: v for k, v in os.environ.items() if k not in SERVICE_SECRETS},
                "PYTHONUNBUFFERED": "1", **source_env(job.dataset), **self._policy_env,
                # the job's program reports with its own token (never spec.json)
                "SILOD_TOKEN": job.report_token or ""}

    def _program_fields(self, job: JobSpec) -> dict[str, Any]:
        """WorkerSpec fields of a job that runs its own program (JobIn.program)."""
        if job.program is None:
            return {}
        return {"program": list(job.program.command), "program_env": dict(job.program.env),
                "api_url": self.options.api_url}

    def update(self, job_id: str, allocation: JobAllocation) -> None:
        """A running job's cores changed: apply the new limit to its preprocessing processes."""
        with self._lock:
            if job_id not in self._cores or self._limiter is None:
                return  # not ours, or no CPU stage
            self._cores[job_id] = allocation.cpus
            self._limiter.set_limit(job_id, allocation.cpus, list(self._cpu_pids.get(job_id, ())))
            log.info("job %s: cpu limit now %s", job_id, self._cpu_text(job_id))

    def cpu_limiter(self) -> CpuLimiter | None:
        return self._limiter

    def _cpu_text(self, job_id: str) -> str:
        return "unlimited" if self._limiter is None else self._limiter.describe(self._cores.get(job_id))

    def _cpu_flags(self, job: JobSpec, alloc: JobAllocation) -> dict[str, Any]:
        """WorkerSpec fields of the CPU stage; creates the job's limit before its processes start."""
        if job.cpu_rate is None or not math.isfinite(job.cpu_rate) or job.cpu_rate <= 0:
            self._cores.pop(job.job_id, None)
            return {}
        processes = max(1, min(os.cpu_count() or 1, self.options.prefetch_threads))
        if self.options.cpu_limit == "none":
            return {"cpu_rate": float(job.cpu_rate), "cpu_processes": processes, "cpu_mode": "none"}
        if self._limiter is None:
            prefer = None if self.options.cpu_limit == "auto" else self.options.cpu_limit
            self._limiter = CpuLimiter.detect(str(self.root), prefer=prefer)
        self._cores[job.job_id] = alloc.cpus
        self._cpu_pids.pop(job.job_id, None)
        group = self._limiter.prepare(job.job_id, alloc.cpus)
        affinity = None
        if self._limiter.mode == "affinity":
            from scheduler.backends.cpu_limit import _offset, affinity_cpus

            affinity = affinity_cpus(alloc.cpus, sorted(os.sched_getaffinity(0)), offset=_offset(job.job_id))
        return {"cpu_rate": float(job.cpu_rate), "cpu_processes": processes, "cpu_group": group,
                "cpu_affinity": affinity, "cpu_mode": self._limiter.mode}

    def _enforce_cpu(self, job_id: str, w: _Worker, status: dict | None) -> None:
        """Hold the worker's preprocessing processes to the job's limit: the backend puts them in
        the job's group (or sets their affinity) itself, not trusting the worker to have joined."""
        if self._limiter is None or job_id not in self._cores or status is None:
            return
        pids = tuple(int(p) for p in ((status.get("cpu") or {}).get("pids") or ()) if _child_of(int(p), w.pid))
        if not pids or pids == self._cpu_pids.get(job_id):
            return
        if self._limiter.mode == "affinity":
            self._limiter.set_limit(job_id, self._cores[job_id], list(pids))
        else:
            self._limiter.attach(job_id, list(pids))
        self._cpu_pids[job_id] = pids

    # ------------------------------------------------------------------ autocaching

    def set_autocache(self, dataset: str, expansion: float) -> None:
        """The scheduler's choice for `dataset` (a storage key): expansion > 1 or != 1 caches its
        readers' preprocessed items in the node-local store (its workers read control.json);
        1.0: source bytes through the mount's cache. A change of expansion empties the store."""
        from scheduler.backends.preprocessed import PreprocessedStore, write_control

        if not _safe_id(dataset):
            raise ValueError(f"dataset key {dataset!r} cannot name a directory")
        with self._lock:
            old_e, budget = self._autocache.get(dataset, (1.0, 0.0))
            if old_e == expansion and (self.preprocessed_dir / dataset).exists():
                return
            store = PreprocessedStore(self.preprocessed_dir / dataset)
            write_control(store.dir, expansion, budget if expansion != 1.0 else 0.0)
            if old_e != expansion:
                store.clear()
            self._autocache[dataset] = (float(expansion), budget)

    def preprocessed(self, dataset: str) -> bool:
        with self._lock:
            return self._autocache.get(dataset, (1.0, 0.0))[0] != 1.0

    def set_preprocessed_budget(self, dataset: str, nbytes: float) -> None:
        """The dataset's cache allocation while it caches preprocessed items (random eviction to fit)."""
        from scheduler.backends.preprocessed import PreprocessedStore, write_control

        with self._lock:
            e, _ = self._autocache.get(dataset, (1.0, 0.0))
            self._autocache[dataset] = (e, float(nbytes))
            store = PreprocessedStore(self.preprocessed_dir / dataset)
            write_control(store.dir, e, float(nbytes))
            store.fit(float(nbytes))

    def stop(self, job_id: str) -> None:
        try:
            with self._lock:
                w = self._terminate(job_id)
                jdir = self.jobs_dir / job_id
                if _safe_id(job_id) and jdir.is_dir():
                    force_unmount(jdir / "mnt")
                    # Report what the worker did before it stopped (or while the service was
                    # down): its progress, or its end if it finished on its own.
                    self._report(job_id, jdir, w, final=True, requested=True)
        except Exception:  # stop() must never raise
            log.exception("stopping job %s", job_id)

    def poll(self) -> list[JobEvent]:
        with self._lock:
            for job_id, w in list(self._workers.items()):
                alive = w.alive()
                if alive and job_id in self._cores:
                    self._enforce_cpu(job_id, w, read_json(w.dir / "status.json"))
                self._report(job_id, w.dir, w, final=not alive, requested=False)
            events, self._events = self._events, []
            return events

    def close(self) -> None:
        """Running workers are left running on purpose: a restarted service re-adopts them.
        Use `stop_all()` to end them (the demo does)."""

    def stop_all(self) -> None:
        for job_id in list(self._workers):
            self.stop(job_id)
        if self._limiter is not None:
            self._limiter.close()  # its job groups are gone with their workers

    # ------------------------------------------------------------------ introspection (demo, tests)

    def running_jobs(self) -> set[str]:
        """Jobs whose worker is alive (started here or re-adopted)."""
        with self._lock:
            return {j for j, w in self._workers.items() if w.alive()}

    def job_status(self, job_id: str) -> dict | None:
        """The worker's latest status.json (progress, throughput, hit ratio, mount counters)."""
        return read_json(self.jobs_dir / job_id / "status.json")

    def io_demands(self) -> dict[str, float]:
        """Remote IO each running job could use right now: f* x its recently measured miss ratio."""
        out = {}
        for job_id in self.running_jobs():
            st = self.job_status(job_id)
            if st and st.get("state") in ("starting", "running"):
                out[job_id] = float(st.get("io_demand") or 0.0)
        return out

    def dataset_cached_bytes(self) -> dict[str, float]:
        """Bytes of each dataset in the shared cache, as the running jobs' mounts report them."""
        out: dict[str, float] = {}
        for job_id in self.running_jobs():
            st = self.job_status(job_id)
            cached = ((st or {}).get("mount") or {}).get("cached_bytes")
            if st and cached is not None:
                out[st["dataset"]] = max(out.get(st["dataset"], 0.0), float(cached))
        return out

    def mountpoint(self, job_id: str) -> Path:
        return self.jobs_dir / job_id / "mnt"

    # ------------------------------------------------------------------ internals

    def _storage_flags(self, job: JobSpec, alloc: JobAllocation, jdir: Path) -> tuple[Path, int | None, float | None]:
        cap = self.config.capacity
        gpu_fraction = job.gpus / max(cap.gpus, 1)
        equal_io = cap.remote_io * gpu_fraction
        cache_dir: Path = self.cache_dir
        cache_size: int | None
        if alloc.cache_bytes is not None:
            cache_size = int(alloc.cache_bytes)
        elif self.options.unmanaged_cache == "coordl":
            cache_dir, cache_size = jdir / "private-cache", int(cap.cache * gpu_fraction)
        elif self.options.unmanaged_cache == "none":
            cache_dir, cache_size = jdir / "private-cache", 0
        else:
            cache_size = int(parse_size(self.options.unmanaged_cache))
        io_rate: float | None
        if alloc.remote_io is not None:
            io_rate = float(alloc.remote_io)
            if io_rate <= 0 and self.config.datamanager_url is None:
                io_rate = equal_io  # static mounts cannot be raised later: never pause for ever
            elif io_rate <= 0:
                # `silod mount --io-rate 0` is refused (it would block every miss until a manager
                # raises it); 1 B/s is as good as paused until the data manager's rate arrives.
                io_rate = 1.0
        elif self.options.unmanaged_io == "equal":
            io_rate = equal_io
        elif self.options.unmanaged_io == "none":
            io_rate = None
        else:
            io_rate = parse_rate(self.options.unmanaged_io)
        if io_rate is not None and not math.isfinite(io_rate):
            io_rate = None
        return cache_dir, cache_size, io_rate

    def _terminate(self, job_id: str) -> _Worker | None:
        """SIGTERM the worker (it unmounts and exits), then SIGKILL its group; never leave a mount."""
        w = self._workers.pop(job_id, None)
        if w is None:
            return None
        if w.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(w.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while w.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if w.alive():
                log.warning("job %s: worker %d ignored SIGTERM; killing its process group", job_id, w.pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.pid, signal.SIGKILL)
        if w.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.popen.wait(5)
        # A worker killed hard leaves its mount process behind in its group.
        if _alive(w.pid, w.start_time) is False:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.pid, signal.SIGKILL)
        force_unmount(w.dir / "mnt")
        self._release_cpu(job_id)
        return w

    def _release_cpu(self, job_id: str) -> None:
        self._cores.pop(job_id, None)
        self._cpu_pids.pop(job_id, None)
        if self._limiter is not None:
            self._limiter.remove(job_id)  # refused by the kernel while a process is left in it

    def _report(self, job_id: str, jdir: Path, w: _Worker | None, final: bool, requested: bool) -> None:
        """Queue progress (cumulative) and, when the worker is gone, its terminal event.

        `requested`: the service asked for the stop, so a worker that did not finish on its own
        is not a failure (it was preempted or cancelled)."""
        status = read_json(jdir / "status.json")
        spec = read_json(jdir / "spec.json") or {}
        attempt = w.attempt if w is not None else spec.get("attempt")
        if status is not None and status.get("attempt") != attempt:
            status = None  # left over from an earlier attempt
        last = w.reported_consumed if w is not None else -1.0
        if status is not None:
            consumed = float(status.get("consumed_bytes") or 0.0)
            if consumed > last:
                self._events.append(JobEvent(job_id, "progress", consumed_bytes=consumed, time=status.get("updated_at")))
                if w is not None:
                    w.reported_consumed = consumed
        if not final:
            return
        state = status.get("state") if status else None
        if w is not None:
            self._workers.pop(job_id, None)
            force_unmount(jdir / "mnt")
            self._release_cpu(job_id)
        marker = jdir / "reported"
        if state == "finished":
            self._events.append(JobEvent(job_id, "finished", consumed_bytes=status.get("total_bytes"),
                                         time=status.get("finished_at") or status.get("updated_at")))
        elif state == "failed":
            self._events.append(JobEvent(job_id, "failed", time=status.get("updated_at"),
                                         message=f"worker failed: {status.get('message')} (logs in {jdir})"))
        elif requested or w is None:
            pass  # stopped on request, or nothing known: progress only
        else:
            code = w.popen.returncode if w.popen is not None else None
            self._events.append(JobEvent(job_id, "failed", message=(
                f"worker {w.pid} ended without finishing (state {state!r}, exit code {code}); see {jdir}/worker.log")))
        with contextlib.suppress(OSError):
            marker.write_text(state or "unknown")

    def _adopt(self) -> tuple[str, ...]:
        """Re-adopt live workers left by a previous service process; report dead ones once."""
        adopted = []
        for jdir in sorted(self.jobs_dir.iterdir()):
            pidinfo = read_json(jdir / "worker.pid")
            if not pidinfo:
                continue
            job_id = jdir.name
            status = read_json(jdir / "status.json") or {}
            total = float(status.get("total_bytes") or (read_json(jdir / "spec.json") or {}).get("total_bytes") or 0.0)
            w = _Worker(job_id, jdir, int(pidinfo["pid"]), pidinfo.get("start_time"), int(pidinfo.get("attempt", 0)), total)
            if w.alive():
                self._workers[job_id] = w
                adopted.append(job_id)
                log.info("job %s: re-adopted running worker %d", job_id, w.pid)
                spec = read_json(jdir / "spec.json") or {}
                if spec.get("cpu_rate") and spec.get("cpu_mode") in CPU_MODES:
                    # Its group keeps the limit it had; a later update() must still reach it.
                    with contextlib.suppress(Exception):
                        if self._limiter is None:
                            self._limiter = CpuLimiter.detect(str(self.root), prefer=spec["cpu_mode"])
                        self._cores[job_id] = None
            elif not (jdir / "reported").exists():
                # Ended while no service watched: tell the next poll() what it did.
                self._report(job_id, jdir, None, final=False, requested=False)
                if status.get("state") in TERMINAL:
                    self._report(job_id, jdir, w, final=True, requested=False)
                else:
                    force_unmount(jdir / "mnt")
        return tuple(adopted)


class WorkConservingPusher:
    """Wraps the data manager's client (a StoragePusher): link capacity that the policy's caps
    leave unused goes, max-min fair by measured demand, to running jobs that could use more
    than their cap right now (e.g. during the first epoch, when their cache is not filled yet
    and the policy, which plans on the filled cache, gives them little or no remote IO).

    The service pushes caps through it as usual; a thread re-spreads the spare capacity every
    `interval` seconds from the backend's live demands (`LocalBackend.io_demands`)."""

    def __init__(self, inner: Any, backend: LocalBackend, total_io: float, interval: float = 0.5):
        self.inner = inner
        self.backend = backend
        self.total_io = float(total_io)
        self.interval = interval
        self.caps: dict[str, float] = {}
        self.effective: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silod-work-conserving", daemon=True)
        self._thread.start()

    def allocate_cache_size(self, dataset: str, bytes: float) -> Any:  # noqa: A002 - the protocol's name
        # Autocaching: a dataset caching preprocessed items holds them in the node-local store,
        # so its allocation goes there and the mount's source cache gets none.
        if self.backend.preprocessed(dataset):
            self.backend.set_preprocessed_budget(dataset, bytes)
            return self.inner.allocate_cache_size(dataset, 0.0)
        return self.inner.allocate_cache_size(dataset, bytes)

    def set_cache_mode(self, dataset: str, mode: str) -> Any:
        return self.inner.set_cache_mode(dataset, mode)

    def set_autocache(self, dataset: str, expansion: float) -> None:
        self.backend.set_autocache(dataset, expansion)

    def allocate_remote_io(self, job_id: str, bytes_per_s: float, workers: int = 1) -> Any:
        with self._lock:
            self.caps[job_id] = float(bytes_per_s)
            self.effective[job_id] = float(bytes_per_s)
        return self.inner.allocate_remote_io(job_id, bytes_per_s, workers)

    def status(self) -> Any:
        return self.inner.status()

    def rebalance(self) -> dict[str, float]:
        from scheduler.core.planner import spread_spare_io

        demands = self.backend.io_demands()
        with self._lock:
            caps = {j: self.caps.get(j, 0.0) for j in demands}
            if not caps:
                return {}
            target = spread_spare_io(caps, demands, self.total_io)
            changed = {j: r for j, r in target.items() if abs(self.effective.get(j, -1.0) - r) > max(1024.0, 0.02 * r)}
            self.effective.update(changed)
        for job_id, rate in changed.items():
            try:
                self.inner.allocate_remote_io(job_id, rate)
            except Exception as exc:  # retried next interval
                log.debug("work-conserving push for %s failed: %s", job_id, exc)
                with self._lock:
                    self.effective.pop(job_id, None)
        return target

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self.rebalance()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def create_backend(config: BackendConfig) -> LocalBackend:
    return LocalBackend(config)


__all__ = ["LocalBackend", "LocalOptions", "WorkConservingPusher", "create_backend", "fuse_problems", "silod_cmd"]
