"""The API worker processes of `silod serve --workers N`, each listening on its own socket.

uvicorn's own supervisor binds one listening socket and hands it to every worker. All of them
wait on it; when a burst of connections arrives, the worker that wakes first accepts the whole
queue (asyncio accepts up to the backlog per wake-up), and the other sits idle: wrk's 64
connections all landed in one worker (5.26 s of CPU against 0.01 s), which halved throughput and
doubled the tail (issue 20, item 8). Here every worker binds its own socket with SO_REUSEPORT and
the kernel spreads new connections over the sockets by a hash of their addresses.

Linux admits another socket into a SO_REUSEPORT group only from the same effective user, so no
other user's process can take a share of the connections; `silod serve` checks before it starts
that nothing else listens on the port (http_guard/listen.py).

The pool's lifecycle is what uvicorn's supervisor gave `silod serve` (issue 20, item 7): a worker
that dies is started again; one that fails at startup (uvicorn's exit code 3: the app, TLS or the
bind is broken) stops the server, as does a worker that keeps dying at once; SIGINT/SIGTERM stop
every worker (SIGTERM, then SIGKILL after a grace period); each worker dies with this process
under kill -9 (the app factory arms scheduler.service.lifeline).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("silod.serve")

STARTUP_FAILURE = 3  # uvicorn.config.STARTUP_FAILURE: exit code of a worker that could not start
QUICK_DEATH_S = 10.0  # a worker that dies this soon after its start counts as failing to start
MAX_QUICK_DEATHS = 5  # in a row, before the server gives up instead of restarting forever
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker serves: handed to the spawned process, so plain picklable values."""

    app: str  # "module:factory"
    host: str
    port: int
    log_level: str
    http: Any  # the h11 protocol class (a class is pickled by its import path)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    backlog: int = 2048


def reuse_port_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on host:port that other sockets of this user may share (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _run_worker(spec: WorkerSpec) -> None:
    """Body of one worker process: its own socket, one uvicorn server on it."""
    import sys

    import uvicorn

    config = uvicorn.Config(spec.app, factory=True, host=spec.host, port=spec.port, log_level=spec.log_level,
                            access_log=False, http=spec.http, ssl_certfile=spec.ssl_certfile,
                            ssl_keyfile=spec.ssl_keyfile, backlog=spec.backlog)
    try:
        sock = reuse_port_socket(spec.host, spec.port, spec.backlog)
    except OSError as exc:
        logging.getLogger("uvicorn.error").error("cannot listen on %s:%d: %s", spec.host, spec.port, exc)
        sys.exit(STARTUP_FAILURE)
    uvicorn.Server(config).run(sockets=[sock])


@dataclass
class _Worker:
    proc: Any
    started: float = field(default_factory=time.monotonic)


class ApiWorkerPool:
    """N worker processes on one port; `run()` blocks until SIGINT/SIGTERM or a startup failure."""

    def __init__(self, spec: WorkerSpec, count: int, ctx: Any = None):
        self.spec, self.count = spec, count
        self.ctx = ctx or multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.failed: str | None = None  # why the pool gave up, if it did
        self._stop = threading.Event()
        self._quick_deaths = 0

    def _spawn(self) -> _Worker:
        proc = self.ctx.Process(target=_run_worker, args=(self.spec,), name="silod-api")
        proc.start()
        return _Worker(proc)

    def _replace_dead(self) -> None:
        for i, w in enumerate(self.workers):
            if w.proc.is_alive() or self._stop.is_set():
                continue
            w.proc.join()
            code = w.proc.exitcode
            quick = time.monotonic() - w.started < QUICK_DEATH_S
            self._quick_deaths = self._quick_deaths + 1 if quick else 0
            if code == STARTUP_FAILURE or self._quick_deaths >= MAX_QUICK_DEATHS:
                self.failed = (f"API worker {w.proc.pid} could not start (exit code {code}); see the log above"
                               if code == STARTUP_FAILURE else
                               f"API workers died {self._quick_deaths} times in a row within {QUICK_DEATH_S:g} s "
                               f"of starting (last exit code {code}); see the log above")
                log.error("%s; stopping", self.failed)
                self._stop.set()
                return
            log.error("API worker %d exited (code %s); starting it again", w.proc.pid, code)
            self.workers[i] = self._spawn()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        previous = {sig: signal.signal(sig, lambda *_: self._stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.workers = [self._spawn() for _ in range(self.count)]
            while not self._stop.wait(0.5):
                self._replace_dead()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_all(self) -> None:
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.terminate()  # uvicorn's graceful shutdown: requests in flight finish
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
