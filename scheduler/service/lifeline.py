"""The processes of one `silod serve` live and die together.

`silod serve --workers N` is a parent (uvicorn's supervisor and the scheduling process's
supervisor) with N API worker processes and one scheduling process. Killed with -9, the parent
cannot stop its children: before this, the API workers kept serving (and kept the port, so a
restart failed with "Address already in use") while nothing scheduled (issue 20).

Each child therefore asks the kernel for a signal when its parent dies (Linux
PR_SET_PDEATHSIG, through ctypes: no extra package) and also watches its parent pid every half
second (the portable fallback, and a guard for the race where the parent dies before the prctl).
The API workers take SIGKILL (they hold nothing a transaction does not), the scheduling process
SIGTERM (it releases the leader lease on the way out).

A dead scheduling process is restarted by the parent within 2 s (cli._SchedulerSupervisor), and
the restarted one takes the lease at once when its holder is a dead process of this host
(control.try_lead); until then `/readyz` answers 503.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("silod.serve")

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except OSError:
        return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL, grace_s: float = 10.0) -> None:
    """Make this process receive `sig` when `parent_pid` (its parent now) dies. Exits at once if
    it is already gone. A daemon thread re-checks the parent every WATCH_INTERVAL_S; after `sig`
    it gives the process `grace_s` to exit, then ends it with os._exit."""
    _prctl_pdeathsig(sig)
    if os.getppid() != parent_pid:  # died before the prctl: nobody would signal us
        log.error("the parent process %d is gone; exiting", parent_pid)
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S)
        log.error("the parent process %d is gone; exiting", parent_pid)
        try:
            os.kill(os.getpid(), sig)
        finally:
            time.sleep(grace_s)
            os._exit(1)

    threading.Thread(target=watch, name="silod-lifeline", daemon=True).start()


def pid_namespace() -> str:
    """This process's PID namespace (`pid:[4026531836]`), so that a pid is only compared with
    pids of the same namespace (containers on one host may share a hostname)."""
    try:
        return os.readlink("/proc/self/ns/pid").replace(":", "")
    except OSError:
        return "nons"


def local_process_is_dead(holder: str, hostname: str) -> bool:
    """Whether a lease holder `HOST:PID:NONCE:PIDNS` is a process of this host and PID namespace
    that no longer exists. Anything else (another host, an old holder format, a live or reused
    pid) is not known dead: the lease then simply expires."""
    parts = holder.split(":")
    if len(parts) != 4 or parts[0] != hostname or parts[3] != pid_namespace() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")  # a zombie (killed, not reaped yet) is dead too
