"""Which pod a FUSE request comes from: the caller's pid -> its cgroup -> the pod's uid.

The node agent runs one FUSE mount per (tenant, dataset) and node, shared by every pod on the
node that reads the dataset (the paper's §6: one FUSE client per server), so the mount itself
does not say which job read a byte. The kernel does: every FUSE request carries the calling
process's pid (`fuse_get_context`), and kubelet puts each pod's containers in a cgroup named
after the pod's uid (cgroupfs driver: `.../kubepods/[burstable|besteffort/]pod<uid>/<container>`;
systemd driver: `kubepods-<qos>-pod<uid with _>.slice`). A container cannot choose its cgroup
(cgroupfs is read-only inside an unprivileged container), so the uid read from
`/proc/<pid>/cgroup` is the runtime's word, not the workload's. The agent must share the host's
pid namespace (`hostPID: true`) for the pids to resolve.

Requests from a process in no pod cgroup (the agent itself, a host process) are attributed to no
pod and never reported.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

POD_UID_RE = re.compile(
    r"kubepods.*?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_TTL_S = 5.0  # a pid's pod is looked up again after this long (pids are reused eventually)
_MAX_PIDS = 8192


def pod_uid_of_cgroup_text(text: str) -> str | None:
    """The pod uid in the contents of a /proc/<pid>/cgroup file, or None."""
    for line in text.splitlines():
        m = POD_UID_RE.search(line)
        if m:
            return m.group(1).replace("_", "-")
    return None


class PodAttribution:
    """pid -> pod uid ("" for no pod), cached briefly per pid."""

    def __init__(self, proc: Path = Path("/proc"), clock=time.monotonic) -> None:
        self.proc = proc
        self.clock = clock
        self._cache: dict[int, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def pod_of(self, pid: int) -> str:
        if pid <= 0:
            return ""
        now = self.clock()
        with self._lock:
            hit = self._cache.get(pid)
            if hit is not None and now - hit[0] < _TTL_S:
                return hit[1]
        try:
            text = (self.proc / str(pid) / "cgroup").read_text()
        except OSError:
            return ""  # the process exited already, or the pid is not in our pid namespace
        uid = pod_uid_of_cgroup_text(text) or ""
        with self._lock:
            if len(self._cache) >= _MAX_PIDS:
                self._cache.clear()
            self._cache[pid] = (now, uid)
        return uid
