"""Limit a local job's preprocessing processes to the CPU cores the scheduler allocated it.

Three mechanisms, tried in this order when the backend starts (`CpuLimiter.detect`); the one in
use is logged and reported in every job's status (`cpu.mode`):

- ``cgroup2``: a child cgroup per job under the service's own cgroup v2 group, limited by
  ``cpu.max`` ("QUOTA PERIOD"). Needs the unified hierarchy with the ``cpu`` controller
  available and enabled for children (``+cpu`` in the parent's ``cgroup.subtree_control``,
  which the kernel refuses when the parent itself holds processes: then this is skipped).
- ``cgroup1``: the same with the legacy cpu controller (``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``), for hosts that mount cgroup v1 (hybrid layouts keep ``cpu`` there).
- ``affinity``: ``sched_setaffinity`` to ceil(cores) CPUs (whole CPUs only: 0.5 core is one
  CPU). Works for any user; no fractional limits and no isolation from other processes on
  those CPUs.

A quota is fractional (0.5 core = 50 ms of CPU per 100 ms period, over all the job's
processes), so it follows the allocation exactly; a job allocated 0 cores gets the kernel's
smallest quota (1 ms per period), as good as paused. Changing the allocation rewrites the limit of
the running job's group: the kernel applies it at the next period, nothing is restarted.

The FUSE mount is not limited: it is the data plane (on Kubernetes it is the node agent, not the
training container); only the worker's preprocessing processes join the job's group.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("silod.backend.cpu")

PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel's floor for a CFS quota
MODES = ("cgroup2", "cgroup1", "affinity")


def quota_us(cores: float | None) -> int | None:
    """CFS quota per PERIOD_US for `cores` (None or inf: no limit)."""
    if cores is None or not math.isfinite(cores):
        return None
    return max(MIN_QUOTA_US, int(round(max(cores, 0.0) * PERIOD_US)))


def affinity_cpus(cores: float | None, available: list[int], offset: int = 0) -> list[int]:
    """ceil(cores) CPUs (at least 1, at most all) from `available`, starting at `offset` so that
    jobs spread over the machine's CPUs instead of all sharing the first."""
    if cores is None or not math.isfinite(cores):
        return list(available)
    n = min(max(1, math.ceil(cores - 1e-9)), len(available))
    return [available[(offset + i) % len(available)] for i in range(n)]


def _own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path in the v2 hierarchy (controller None) or the v1 `controller`."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hid, ctrls, path = parts
        if controller is None and ctrls == "" and parts[0] == "0":
            return path
        if controller is not None and controller in ctrls.split(","):
            return path
    return None


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, options) of cgroup filesystems."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            f = line.split()
            if len(f) >= 4 and f[2] in ("cgroup", "cgroup2"):
                out.append((f[1], f[2], f[3]))
    return out


@dataclass
class CpuLimiter:
    """One per local backend. `base` is the directory of the backend's own group (cgroup modes)."""

    mode: str
    base: Path | None = None
    reason: str = ""

    # ------------------------------------------------------------------ detection

    @classmethod
    def detect(cls, name: str, prefer: str | None = None) -> CpuLimiter:
        """The first mechanism that works here (or `prefer`, if it works). `name` makes the group
        unique to this backend's state directory, so two services on one host do not share it."""
        tag = "silod-" + hashlib.sha256(name.encode()).hexdigest()[:12]
        if prefer is not None and prefer not in MODES:
            raise ValueError(f"cpu limit mode {prefer!r}: choose one of {', '.join(MODES)}")
        why: list[str] = []
        order = [prefer] if prefer else list(MODES)
        for mode in order:
            if mode == "affinity":
                if hasattr(os, "sched_setaffinity"):
                    limiter = cls("affinity", None, "; ".join(why) or "requested")
                    break
                why.append("sched_setaffinity is not available")
                continue
            try:
                base = cls._make_base(mode, tag)
            except OSError as exc:
                why.append(f"{mode}: {exc}")
                continue
            if base is None:
                why.append(f"{mode}: no writable hierarchy with the cpu controller")
                continue
            limiter = cls(mode, base, "")
            break
        else:
            raise RuntimeError("no way to limit CPU here: " + "; ".join(why))
        log.info("local backend limits CPU with %s%s%s", limiter.mode,
                 f" under {limiter.base}" if limiter.base else "", f" ({limiter.reason})" if limiter.reason else "")
        return limiter

    @staticmethod
    def _make_base(mode: str, tag: str) -> Path | None:
        for mnt, fstype, opts in _mounts():
            if mode == "cgroup2" and fstype == "cgroup2":
                own = _own_cgroup(None)
                if own is None:
                    continue
                parent = Path(mnt) / own.lstrip("/")
                controllers = (parent / "cgroup.controllers").read_text().split()
                if "cpu" not in controllers:
                    continue
                if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
                    # Refused (EBUSY) when `parent` holds processes: the "no internal processes" rule.
                    (parent / "cgroup.subtree_control").write_text("+cpu")
                base = parent / tag
                base.mkdir(exist_ok=True)
                if "cpu" not in (base / "cgroup.controllers").read_text().split():
                    continue
                (base / "cgroup.subtree_control").write_text("+cpu")
                return base
            if mode == "cgroup1" and fstype == "cgroup" and "cpu" in opts.split(","):
                own = _own_cgroup("cpu") or "/"
                base = Path(mnt) / own.lstrip("/") / tag
                base.mkdir(exist_ok=True)
                if not (base / "cpu.cfs_quota_us").exists():
                    continue
                return base
        return None

    # ------------------------------------------------------------------ per job

    def group(self, job_id: str) -> Path | None:
        return None if self.base is None else self.base / f"job-{job_id}"

    def prepare(self, job_id: str, cores: float | None) -> str | None:
        """Create the job's group with its limit (before its processes start); its path for the
        worker's preprocessing processes to join, or None in affinity mode."""
        g = self.group(job_id)
        if g is None:
            return None
        g.mkdir(exist_ok=True)
        self.set_limit(job_id, cores)
        return str(g)

    def set_limit(self, job_id: str, cores: float | None, pids: list[int] | None = None) -> None:
        """Apply `cores` to the job: the group's quota, or the affinity of `pids`."""
        if self.mode == "affinity":
            available = sorted(os.sched_getaffinity(0))
            cpus = set(affinity_cpus(cores, available, offset=_offset(job_id)))
            for pid in pids or ():
                with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                    os.sched_setaffinity(pid, cpus)
            return
        g = self.group(job_id)
        if g is None or not g.is_dir():
            return
        q = quota_us(cores)
        if self.mode == "cgroup2":
            (g / "cpu.max").write_text(f"{'max' if q is None else q} {PERIOD_US}")
        else:
            (g / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (g / "cpu.cfs_quota_us").write_text(str(-1 if q is None else q))

    def attach(self, job_id: str, pids: list[int]) -> None:
        """Put `pids` in the job's group (idempotent): the backend does it too, so a worker cannot
        keep its preprocessing out of the limit by not joining."""
        g = self.group(job_id)
        if g is None or not g.is_dir():
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, OSError):
                (g / "cgroup.procs").write_text(str(int(pid)))

    def remove(self, job_id: str, timeout_s: float = 5.0) -> None:
        """Delete the job's group. The job's worker is gone by now, but its preprocessing
        processes may still be exiting (orphans until init reaps them), and the kernel refuses
        to remove a group with a process left in it: wait for them, then kill what is left
        (every process in the group is the stopped job's), then remove it."""
        g = self.group(job_id)
        if g is None or not g.is_dir():
            return
        deadline = time.monotonic() + timeout_s
        killed = False
        while True:
            try:
                g.rmdir()
                return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                pids = _pids_in(g)
                if killed or not pids:
                    log.warning("cgroup %s of job %s could not be removed (processes left: %s)", g, job_id, pids)
                    return
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + timeout_s
            time.sleep(0.05)

    def close(self) -> None:
        """Remove the backend's own group once no job group is left in it (refused otherwise)."""
        if self.base is not None:
            with contextlib.suppress(OSError):
                self.base.rmdir()

    def describe(self, cores: float | None) -> str:
        if self.mode == "affinity":
            return f"affinity ({len(affinity_cpus(cores, sorted(os.sched_getaffinity(0))))} CPUs)"
        q = quota_us(cores)
        return f"{self.mode} ({'no limit' if q is None else f'{q / PERIOD_US:.2f} cores'})"


def _pids_in(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _offset(job_id: str) -> int:
    return int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16)


def join_group(group: str | None, affinity: list[int] | None = None) -> None:
    """Called in a preprocessing process when it starts: join the job's group (cgroup modes) or
    take the job's CPUs (affinity mode)."""
    if group:
        Path(group, "cgroup.procs").write_text("0")  # "0": the writing process
    if affinity:
        os.sched_setaffinity(0, set(affinity))


__all__ = ["CpuLimiter", "MODES", "PERIOD_US", "affinity_cpus", "join_group", "quota_us"]
