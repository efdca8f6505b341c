"""Run-wide checks.

A test that starts `silod serve` must end every process of it (issue 20: the suite leaked
`silod serve` processes, which kept ports and leases). Every process this run starts inherits
SILOD_TEST_RUN_ID; when the session ends, any live `silod serve` process, API worker or
scheduling process carrying it fails the run (after a grace period for ones still exiting), and
is killed so that it does not outlive the run either.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

RUN_ENV = "SILOD_TEST_RUN_ID"
WORKER_ENV = b"SILOD_SERVE_WORKER_CONFIG="  # set by `silod serve` before it starts its children
GRACE_S = float(os.environ.get("SILOD_TEST_LEAK_GRACE_S", "10"))  # for processes still exiting


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    os.environ.setdefault(RUN_ENV, uuid.uuid4().hex)


def _ours(marker: bytes) -> dict[int, str]:
    """Live processes of this run that belong to a `silod serve`: pid -> command line."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker not in env or state in (b"Z", b"X"):
            continue
        is_serve = b"serve" in argv and any(a.endswith(b"silod") or b"scheduler.cli" in a for a in argv)
        if is_serve or any(e.startswith(WORKER_ENV) for e in env):
            found[int(d)] = b" ".join(argv).decode(errors="replace")[:200]
    return found


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    run = os.environ.get(RUN_ENV)
    if not run or not os.path.isdir("/proc"):
        return
    marker = f"{RUN_ENV}={run}".encode()
    deadline = time.monotonic() + GRACE_S
    left = _ours(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _ours(marker)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(left.items()))
    session.config.get_terminal_writer().line(
        f"\nFAILED: tests left {len(left)} `silod serve` process(es) running (killed now):\n{lines}", red=True)
    session.exitstatus = 1


# The real Kubernetes control plane (tests/k8s_testenv.py), defined once here so the whole session
# shares one (etcd, kube-apiserver, jobctl, kube-scheduler on 127.0.0.1).
from k8s_testenv import control_plane  # noqa: E402,F401 - a session fixture
