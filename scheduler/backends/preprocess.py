"""The local worker's CPU stage: real work per item, on processes the backend limits to the
job's allocated cores (scheduler/backends/cpu_limit.py).

Per item (source bytes it read through the mount):
- a JPEG (the file starts with FF D8 FF) is decoded with Pillow to RGB pixels: real work whose
  cost is whatever decoding costs on this machine;
- anything else costs ``size / cpu_rate`` seconds of CPU time, burnt in a loop timed by the
  thread's CPU clock (`time.thread_time`), so a throttled process takes longer in wall time but
  does the same work: the declared per-core rate is exact when the process has a core to itself.

The work runs in `processes` spawned processes (Python threads would share one core through the
GIL); each joins the job's cgroup or takes its CPUs when it starts. `process` blocks the calling
loader thread until its item is done, so the stage's throughput is what the cores allow.
"""

from __future__ import annotations

import io
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing

JPEG_MAGIC = b"\xff\xd8\xff"


def _init(group: str | None, affinity: list[int] | None) -> None:
    from scheduler.backends.cpu_limit import join_group

    join_group(group, affinity)


def burn(seconds: float) -> float:
    """Spend `seconds` of this thread's CPU time; returns the CPU time spent."""
    start = time.thread_time()
    end = start + max(seconds, 0.0)
    x = 0
    while time.thread_time() < end:
        for i in range(2000):
            x ^= i
    return time.thread_time() - start


def work(size: int, data: bytes | None, cpu_rate: float) -> float:
    """One item's preprocessing; returns the CPU seconds it took."""
    start = time.thread_time()
    if data is not None and data[:3] == JPEG_MAGIC:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            img.convert("RGB").load()
    else:
        burn(size / cpu_rate)
    return time.thread_time() - start


class Preprocessor:
    """`processes` worker processes doing each item's CPU work (see the module docstring)."""

    def __init__(self, cpu_rate: float, processes: int, group: str | None = None,
                 affinity: list[int] | None = None) -> None:
        if not cpu_rate > 0:
            raise ValueError(f"cpu_rate {cpu_rate!r} must be > 0")
        self.cpu_rate = float(cpu_rate)
        self.processes = max(1, int(processes))
        self.pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_init, initargs=(group, affinity))
        self._lock = threading.Lock()
        self.items = 0
        self.bytes = 0
        self.cpu_seconds = 0.0

    def warm_up(self) -> None:
        """Start every process now (the pool starts them lazily), so their pids are known."""
        list(self.pool.map(burn, [0.0] * self.processes))

    def pids(self) -> list[int]:
        # ProcessPoolExecutor does not publish its processes' pids; the backend needs them to
        # check that they are in the job's group (or to set their affinity).
        return sorted(int(p) for p in getattr(self.pool, "_processes", {}) or {})

    def process(self, size: int, data: bytes | None) -> None:
        cpu = self.pool.submit(work, size, data, self.cpu_rate).result()
        with self._lock:
            self.items += 1
            self.bytes += size
            self.cpu_seconds += cpu

    def stats(self) -> dict:
        with self._lock:
            return {"items": self.items, "bytes": self.bytes, "cpu_seconds": self.cpu_seconds,
                    "processes": self.processes, "pids": self.pids()}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for pid in self.pids():  # a process still burning an item would otherwise finish it first
            try:
                os.kill(pid, 15)
            except OSError:
                pass


__all__ = ["JPEG_MAGIC", "Preprocessor", "burn", "work"]
