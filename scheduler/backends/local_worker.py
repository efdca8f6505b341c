"""One training job of the local backend: mount the dataset, then train the "accelerated GPU" way.

    python -m scheduler.backends.local_worker JOBDIR/spec.json

The SiloD paper (§7, "GPU Acceleration") evaluates fast GPUs by running the real data pipeline
and replacing the forward/backward pass by ``sleep()`` for the profiled step time. This worker
does the same with a real FUSE mount (`silod mount`, a child process in the worker's process
group):

- each epoch reads every item (file) once, in a fresh random order (seeded by job and epoch,
  so a restarted job resumes the same order), in batches of about ``batch_bytes``;
- a small pool of loader threads reads items ahead of the "GPU" (``prefetch_threads`` reads in
  flight, ``prefetch_batches`` batches queued), so IO and compute overlap as Eq. 4 assumes;
- with a CPU stage (``cpu_rate``: the job's declared per-core preprocessing rate) every item
  read is preprocessed for real before the "GPU" gets it: JPEGs decoded with Pillow, other
  items ``size / cpu_rate`` seconds of CPU (scheduler/backends/preprocess.py), in processes the
  backend limits to the job's allocated cores (scheduler/backends/cpu_limit.py);
- the "GPU" sleeps ``batch_bytes / f*`` per batch; the job's throughput is thus
  min(f*, what the cores preprocess, what the mount delivers).

Progress goes to ``status.json`` in the job directory (atomically rewritten about twice a
second): cumulative consumed bytes since submission, epoch, measured throughput, the mount's
hit/miss counters, per-epoch records, and the job's current remote-IO demand (f* times the
recently measured miss fraction), which the backend uses for work conservation.

SIGTERM (preemption, cancellation) stops training, unmounts (SIGTERM to the mount, then
``fusermount3 -u`` as a fallback) and exits 0 with state ``stopped``. The worker never needs its
parent: the scheduler service may die and restart while it runs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from contract.stats_file import REPORTED_FIELDS
from scheduler.backends.preprocess import JPEG_MAGIC, Preprocessor

MOUNT_TIMEOUT_S = 60.0
STATUS_INTERVAL_S = 0.5
THROUGHPUT_WINDOW_S = 3.0
DEMAND_WINDOW_BYTES = 4 * 1024 * 1024  # miss fraction measured over at least this much reading


@dataclass(frozen=True)
class WorkerSpec:
    """What the backend writes to JOBDIR/spec.json (one file per attempt)."""

    job_id: str
    attempt: int
    dataset: str
    source: str
    ideal_throughput: float  # f*, bytes/s
    total_bytes: float
    consumed_bytes: float  # at the start of this attempt
    mountpoint: str
    cache_dir: str
    stats_file: str
    status_file: str
    mount_log: str
    silod_cmd: list[str]
    cache_size: int | None = None
    io_rate: float | None = None
    manager: str | None = None
    batch_bytes: int = 1 << 20
    prefetch_threads: int = 4
    prefetch_batches: int = 2
    seed: int = 0
    #: autocaching: the dataset's node-local store of preprocessed items (backends/preprocessed.py)
    preprocessed_dir: str | None = None
    # The CPU stage (None: not CPU-bound, no preprocessing): the per-core rate, the processes
    # doing it, and how they are limited (the job's cgroup to join, or the CPUs to take).
    cpu_rate: float | None = None
    cpu_processes: int = 1
    cpu_group: str | None = None
    cpu_affinity: list[int] | None = None
    cpu_mode: str | None = None
    # The job's own training program (JobIn.program) instead of the stand-in loop: its command,
    # extra environment, and the API it reports to (SILOD_SERVER). Its token (SILOD_TOKEN)
    # comes through the worker's environment, never this file.
    program: list[str] | None = None
    program_env: dict[str, str] | None = None
    api_url: str | None = None
    program_log: str | None = None

    @classmethod
    def load(cls, path: Path) -> WorkerSpec:
        return cls(**json.loads(path.read_text()))


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return None


def force_unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-u", str(path)], ["fusermount3", "-u", "-z", str(path)], ["umount", "-l", str(path)]):
        if not os.path.ismount(path):
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(cmd, capture_output=True, timeout=10)


@dataclass
class EpochRecord:
    epoch: int
    start: float
    end: float | None = None
    bytes: float = 0.0
    full: bool = True  # False when the attempt started or stopped in the middle of the epoch
    hit_bytes: int | None = None
    miss_bytes: int | None = None
    remote_bytes: int | None = None


@dataclass
class Progress:
    consumed: float
    epoch: int = 0
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    epochs: list[EpochRecord] = field(default_factory=list)

    def throughput(self, now: float) -> float:
        while len(self.samples) > 2 and now - self.samples[1][0] > THROUGHPUT_WINDOW_S:
            self.samples.popleft()
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        # Up to now, not to the last batch: a stalled job's throughput decays to 0.
        return (c1 - c0) / max(now - t0, 1e-9) if now - t1 < THROUGHPUT_WINDOW_S else 0.0


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.stop_event = threading.Event()
        self.state = "starting"
        self.message = ""
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.progress = Progress(consumed=spec.consumed_bytes)
        self.mount_proc: subprocess.Popen | None = None
        self.mount_stats: dict = {}
        self._demand_ref: tuple[int, int] | None = None  # (read_bytes, miss_bytes) at the window start
        self.io_demand = spec.ideal_throughput  # cold: every read misses
        self.dataset_bytes = 0
        self._lock = threading.Lock()
        self.pre = None  # the CPU stage's Preprocessor while training

    # ---------------------------------------------------------------- status

    def status(self) -> dict:
        now = time.time()
        st = self.mount_stats
        read = st.get("read_bytes") or 0
        with self._lock:
            epochs = [vars(e).copy() for e in self.progress.epochs]
            consumed = self.progress.consumed
            epoch = self.progress.epoch
            tput = self.progress.throughput(time.monotonic())
        return {
            "job_id": self.spec.job_id,
            "dataset": self.spec.dataset,
            "attempt": self.spec.attempt,
            "pid": os.getpid(),
            "state": self.state,
            "message": self.message,
            "consumed_bytes": consumed,
            "start_consumed_bytes": self.spec.consumed_bytes,
            "total_bytes": self.spec.total_bytes,
            "dataset_bytes": self.dataset_bytes,
            "epoch": epoch,
            "ideal_throughput": self.spec.ideal_throughput,
            "throughput": tput,
            "io_demand": self.io_demand,
            "hit_ratio": (st.get("hit_bytes", 0) / read) if read else None,
            # autocaching: items read from / stored to the dataset's preprocessed store
            "preprocessed": {"hits": getattr(self, "preprocessed_hits", 0), "misses": getattr(self, "preprocessed_misses", 0)},
            "mount": {k: st.get(k) for k in REPORTED_FIELDS},
            "epochs": epochs,
            "cpu": self._cpu_status(),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "updated_at": now,
        }

    def _cpu_status(self) -> dict | None:
        if self.spec.cpu_rate is None:
            return None
        stats = self.pre.stats() if self.pre is not None else {"items": 0, "bytes": 0, "cpu_seconds": 0.0, "pids": []}
        return {"mode": self.spec.cpu_mode, "cpu_rate": self.spec.cpu_rate, **stats}

    def write_status(self) -> None:
        self._refresh_mount_stats()
        write_json_atomic(Path(self.spec.status_file), self.status())

    def _refresh_mount_stats(self) -> None:
        st = read_json(Path(self.spec.stats_file))
        if not st:
            return
        self.mount_stats = st
        read, miss = int(st.get("read_bytes") or 0), int(st.get("miss_bytes") or 0)
        if self._demand_ref is None:
            self._demand_ref = (read, miss)
        elif read - self._demand_ref[0] >= DEMAND_WINDOW_BYTES:
            miss_fraction = min(max((miss - self._demand_ref[1]) / (read - self._demand_ref[0]), 0.0), 1.0)
            self.io_demand = self.spec.ideal_throughput * miss_fraction
            self._demand_ref = (read, miss)

    def _status_loop(self) -> None:
        while not self.stop_event.wait(STATUS_INTERVAL_S):
            with contextlib.suppress(Exception):
                self.write_status()

    # ---------------------------------------------------------------- mount

    def mount(self) -> None:
        spec = self.spec
        mnt = Path(spec.mountpoint)
        force_unmount(mnt)  # a previous attempt killed with -9 may have left one behind
        mnt.mkdir(parents=True, exist_ok=True)
        Path(spec.stats_file).unlink(missing_ok=True)
        args = [*spec.silod_cmd, "mount", str(mnt), "--source", spec.source, "--dataset", spec.dataset,
                "--job", spec.job_id, "--cache-dir", spec.cache_dir, "--stats-file", spec.stats_file]
        if spec.cache_size is not None:
            args += ["--cache-size", str(int(spec.cache_size))]
        if spec.io_rate is not None and math.isfinite(spec.io_rate):
            args += ["--io-rate", repr(float(spec.io_rate))]
        if spec.manager:
            args += ["--manager", spec.manager]
        log = open(spec.mount_log, "ab")
        self.mount_proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.stop_event.is_set():
                return
            code = self.mount_proc.poll()
            if code is not None:
                tail = Path(spec.mount_log).read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"silod mount exited with code {code}: {' | '.join(tail)}")
            if os.path.ismount(mnt) and Path(spec.stats_file).exists():
                return
            time.sleep(0.05)
        raise RuntimeError(f"silod mount of {spec.dataset} not ready after {MOUNT_TIMEOUT_S:.0f}s (see {spec.mount_log})")

    def unmount(self) -> None:
        mnt = Path(self.spec.mountpoint)
        proc = self.mount_proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        force_unmount(mnt)

    # ---------------------------------------------------------------- training

    def items(self) -> list[tuple[str, int]]:
        root = Path(self.spec.mountpoint)
        out = []
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                full = os.path.join(dirpath, name)
                out.append((os.path.relpath(full, root), os.stat(full).st_size))
        out.sort()
        return out

    def _schedule(self, items: list[tuple[str, int]]):
        """(epoch, batch) in reading order, from the recorded progress to the job's total."""
        d = sum(s for _, s in items)
        spec = self.spec
        epoch = int(spec.consumed_bytes // d)
        offset = spec.consumed_bytes - epoch * d
        planned = spec.consumed_bytes
        while planned < spec.total_bytes - 1e-6:
            order = list(items)
            random.Random(f"{spec.seed}:{spec.job_id}:{epoch}").shuffle(order)
            if offset > 0:  # resume inside an epoch: skip what the previous attempt consumed
                skipped = 0.0
                while order and skipped + order[0][1] <= offset + 1e-6:
                    skipped += order.pop(0)[1]
                offset = 0.0
            batch: list[tuple[str, int]] = []
            size = 0
            for item in order:
                batch.append(item)
                size += item[1]
                planned += item[1]
                if size >= spec.batch_bytes or planned >= spec.total_bytes - 1e-6:
                    yield epoch, batch
                    batch, size = [], 0
                if planned >= spec.total_bytes - 1e-6:
                    return
            if batch:
                yield epoch, batch
            epoch += 1

    def _read(self, rel: str) -> int:
        store = self._preprocessed_store()
        control = store.control() if store is not None else None
        if control is not None and control.expansion != 1.0:
            return self._read_preprocessed(rel, store, control)
        buf = bytearray(1 << 20)
        n = 0
        keep: bytearray | None = None  # a JPEG's bytes, for the CPU stage to decode
        with open(os.path.join(self.spec.mountpoint, rel), "rb", buffering=0) as f:
            while not self.stop_event.is_set():
                got = f.readinto(buf)
                if not got:
                    break
                if n == 0 and self.pre is not None and buf[:3] == JPEG_MAGIC:
                    keep = bytearray()
                if keep is not None:
                    keep += buf[:got]
                n += got
        if self.pre is not None and not self.stop_event.is_set():
            self.pre.process(n, None if keep is None else bytes(keep))
        return n

    def _preprocessed_store(self):  # -> PreprocessedStore | None
        if self.spec.preprocessed_dir is None:
            return None
        store = getattr(self, "_store", None)
        if store is None:
            from scheduler.backends.preprocessed import PreprocessedStore

            store = self._store = PreprocessedStore(Path(self.spec.preprocessed_dir))
        return store

    def _read_preprocessed(self, rel: str, store, control) -> int:
        """Autocaching chosen: a stored preprocessed item skips the source and the deterministic
        stage; a miss reads the source, runs the stage and stores the output while there is room."""
        from scheduler.backends.preprocessed import deterministic_stage

        data = store.get(rel)
        if data is not None:
            with self._lock:
                self.preprocessed_hits = getattr(self, "preprocessed_hits", 0) + 1
            return len(data)
        with open(os.path.join(self.spec.mountpoint, rel), "rb") as f:
            raw = f.read()
        store.put(rel, deterministic_stage(raw, control.expansion), control.budget)
        with self._lock:
            self.preprocessed_misses = getattr(self, "preprocessed_misses", 0) + 1
        return len(raw)

    def train(self) -> None:
        spec = self.spec
        items = self.items()
        if not items:
            raise RuntimeError(f"dataset {spec.dataset} at {spec.source} has no files")
        self.dataset_bytes = sum(s for _, s in items)
        if spec.cpu_rate is not None:
            self.pre = Preprocessor(spec.cpu_rate, spec.cpu_processes, spec.cpu_group, spec.cpu_affinity)
            self.pre.warm_up()  # its processes exist (and are in the job's group) before any item
            with contextlib.suppress(Exception):
                self.write_status()  # publish their pids for the backend's check
        pool = ThreadPoolExecutor(max_workers=max(1, spec.prefetch_threads), thread_name_prefix="loader")
        batches = self._schedule(items)
        queue: collections.deque[tuple[int, list[tuple[str, int]], list[Future]]] = collections.deque()
        exhausted = False

        def fill() -> None:
            nonlocal exhausted
            while not exhausted and len(queue) < max(1, spec.prefetch_batches) + 1:
                nxt = next(batches, None)
                if nxt is None:
                    exhausted = True
                    return
                epoch, batch = nxt
                queue.append((epoch, batch, [pool.submit(self._read, rel) for rel, _ in batch]))

        self.state = "running"
        now = time.time()
        with self._lock:
            self.progress.samples.append((time.monotonic(), self.progress.consumed))
        current: EpochRecord | None = None
        last_batch_end = time.time()  # epochs are contiguous: one starts where the previous ended
        gpu_free_at = time.monotonic()
        try:
            fill()
            while queue and not self.stop_event.is_set():
                epoch, batch, futures = queue.popleft()
                fill()  # keep the loaders busy while this batch waits and computes
                for fut in futures:
                    fut.result()  # an EIO from the mount fails the job
                if self.stop_event.is_set():
                    break
                nbytes = float(sum(s for _, s in batch))
                start = max(time.monotonic(), gpu_free_at)
                gpu_free_at = start + nbytes / spec.ideal_throughput
                if self.stop_event.wait(max(0.0, gpu_free_at - time.monotonic())):
                    break
                now = time.time()
                with self._lock:
                    if current is None or current.epoch != epoch:
                        if current is not None:
                            self._close_epoch(current, last_batch_end)
                        current = EpochRecord(epoch=epoch, start=last_batch_end,
                                              full=not (epoch == int(spec.consumed_bytes // self.dataset_bytes)
                                                        and spec.consumed_bytes % self.dataset_bytes > 1e-6))
                        self._stamp_epoch_start(current)
                        self.progress.epochs.append(current)
                    current.bytes += nbytes
                    self.progress.consumed = min(self.progress.consumed + nbytes, spec.total_bytes)
                    self.progress.epoch = epoch
                    self.progress.samples.append((time.monotonic(), self.progress.consumed))
                last_batch_end = now
            with self._lock:
                if current is not None:
                    if current.bytes < self.dataset_bytes - 1e-6:
                        current.full = False
                    self._close_epoch(current, last_batch_end)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            if self.pre is not None:
                self.pre.close()

    def _stamp_epoch_start(self, rec: EpochRecord) -> None:
        self._refresh_mount_stats()
        st = self.mount_stats
        rec.hit_bytes, rec.miss_bytes, rec.remote_bytes = st.get("hit_bytes"), st.get("miss_bytes"), st.get("remote_bytes")

    def _close_epoch(self, rec: EpochRecord, now: float) -> None:
        rec.end = now
        st = read_json(Path(self.spec.stats_file)) or {}
        for key in ("hit_bytes", "miss_bytes", "remote_bytes"):
            start = getattr(rec, key)
            setattr(rec, key, None if start is None or st.get(key) is None else st[key] - start)

    # ---------------------------------------------------------------- the job's own program

    def program_env(self) -> dict[str, str]:
        spec = self.spec
        env = {**os.environ, **(spec.program_env or {}), "SILOD_DATA": spec.mountpoint, "SILOD_JOB_ID": spec.job_id,
               "PYTHONUNBUFFERED": "1"}
        if spec.api_url:
            env["SILOD_SERVER"] = spec.api_url
        return env

    def run_program(self) -> None:
        """Run the job's program on the mounted dataset until it exits (0: the job finished).
        Progress is what the mount served it (the data plane's count, not the program's word):
        consumed = this attempt's start + the mount's read bytes, at most the job's total."""
        spec = self.spec
        self.dataset_bytes = sum(size for _, size in self.items())
        log_path = spec.program_log or os.path.join(os.path.dirname(spec.status_file), "program.log")
        with open(log_path, "ab") as logf:
            # Same process group as the worker: the backend's SIGKILL of the group reaches it too.
            proc = subprocess.Popen(spec.program, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.program_env(), cwd=os.path.dirname(spec.status_file))
        self.state = "running"
        with self._lock:
            self.progress.samples.append((time.monotonic(), self.progress.consumed))
        try:
            while proc.poll() is None:
                if self.stop_event.wait(STATUS_INTERVAL_S / 2):
                    break
                self._program_progress()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self._program_progress()
        if self.stop_event.is_set():
            return
        if proc.returncode != 0:
            tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"the job's program exited with code {proc.returncode}: {' | '.join(tail)}")
        with self._lock:
            self.progress.consumed = spec.total_bytes

    def _program_progress(self) -> None:
        self._refresh_mount_stats()
        read = float(self.mount_stats.get("read_bytes") or 0)
        with self._lock:
            self.progress.consumed = min(self.spec.consumed_bytes + read, self.spec.total_bytes)
            if self.dataset_bytes:
                self.progress.epoch = int(self.progress.consumed // self.dataset_bytes)
            self.progress.samples.append((time.monotonic(), self.progress.consumed))

    # ---------------------------------------------------------------- main

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        status_thread = threading.Thread(target=self._status_loop, name="status", daemon=True)
        self.write_status()
        status_thread.start()
        code = 0
        final = "failed"
        try:
            self.mount()
            if not self.stop_event.is_set():
                if self.spec.program:
                    self.run_program()
                else:
                    self.train()
            if self.stop_event.is_set():
                final = "stopped"
            else:
                final = "finished"
                self.finished_at = time.time()
        except Exception as exc:  # the backend turns this into a "failed" event with the message
            self.message = f"{type(exc).__name__}: {exc}"[:1000]
            code = 1
        finally:
            self.stop_event.set()
            self.unmount()
            # A terminal state is published only once the mount is gone: whoever reads it may
            # rely on no mount being left behind.
            self.state = final
            # The mount's final stats are written at unmount; take them before the last status.
            with contextlib.suppress(Exception):
                self.write_status()
        return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m scheduler.backends.local_worker JOBDIR/spec.json", file=sys.stderr)
        return 2
    worker = Worker(WorkerSpec.load(Path(argv[0])))
    code = worker.run()
    sys.stdout.flush()
    os._exit(code)  # loader threads blocked in a dead mount must not keep the process alive


if __name__ == "__main__":
    sys.exit(main())
