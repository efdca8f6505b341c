"""Report a training loop's step time and batch size to silod, from inside the loop.

Standard library only (a training image needs nothing more), and it never fails the loop: when
the service is down, slow or answering errors, reports are dropped, and the loop never waits
for the network (a background thread sends; a send still in flight is replaced by the newer
figures, never queued behind).

    from silod_client.reporter import StepReporter

    reporter = StepReporter()                      # job id, server, token from the environment
    for batch in reporter.wrap(loader, batch_bytes=lambda b: int(b[2].sum())):
        train_step(batch)                          # the time spent here is the step time
    reporter.close()

or `reporter.step(step_seconds, batch_bytes)` once per step with your own timing. What is sent:
`POST {SILOD_SERVER}/v1/jobs/{SILOD_JOB_ID}/report {"step_seconds", "batch_bytes"}` with the
means of the steps since the last report, at most once per `interval` seconds (the service
keeps only the latest; it speaks for the job for 10 minutes). `step_seconds` is the time the
loop spends on a batch, not waiting for the next one: with `wrap`, the time between handing a
batch over and being asked for the next.

Environment (set by the backends for a job's program; docs/sdk.md): ``SILOD_JOB_ID``,
``SILOD_SERVER`` (base URL), ``SILOD_TOKEN`` or ``SILOD_TOKEN_FILE``. Without them the
reporter does nothing (training outside silod runs unchanged).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

log = logging.getLogger("silod.reporter")

T = TypeVar("T")

JOB_ID_ENV, SERVER_ENV, TOKEN_ENV, TOKEN_FILE_ENV = "SILOD_JOB_ID", "SILOD_SERVER", "SILOD_TOKEN", "SILOD_TOKEN_FILE"
#: The API's bounds on a report (scheduler/service/measured_params.py): outside them a report is
#: refused, so it is not sent.
MIN_STEP_S, MAX_STEP_S, MAX_BATCH_BYTES = 1e-4, 86_400.0, 2.0**50
#: After failures the next attempt waits longer, up to this.
MAX_BACKOFF_S = 300.0


def _env_token() -> str | None:
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    if path:
        try:
            with open(path, encoding="ascii") as f:
                return f.read().strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("silod reporter: %s=%s cannot be read (%s); not reporting", TOKEN_FILE_ENV, path, exc)
    return None


class StepReporter:
    """See the module docstring. `interval`: seconds between two reports at most once;
    `timeout`: seconds one send may take. All arguments default to the environment."""

    def __init__(self, job_id: str | None = None, server: str | None = None, token: str | None = None, *,
                 interval: float = 10.0, timeout: float = 5.0):
        self.job_id = job_id if job_id is not None else os.environ.get(JOB_ID_ENV, "").strip() or None
        self.server = (server if server is not None else os.environ.get(SERVER_ENV, "").strip() or None)
        self.token = token if token is not None else _env_token()
        self.interval = max(0.05, float(interval))
        self.timeout = max(0.05, float(timeout))
        missing = [n for n, v in ((JOB_ID_ENV, self.job_id), (SERVER_ENV, self.server), (TOKEN_ENV, self.token)) if not v]
        self.enabled = not missing
        if missing:
            log.info("silod reporter: %s not set; step times are not reported", ", ".join(missing))
        self.sent = 0  # reports the service accepted
        self.failed = 0  # reports that failed (service away, slow, or an error answer)
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._steps, self._step_s, self._bytes = 0, 0.0, 0.0
        self._pending: tuple[float, float] | None = None
        self._next_send = time.monotonic() + self.interval
        self._backoff = self.interval
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._url = f"{self.server.rstrip('/')}/v1/jobs/{urllib.parse.quote(str(self.job_id), safe='')}/report"
            self._thread = threading.Thread(target=self._run, name="silod-reporter", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the loop's side (never raises)

    def step(self, step_seconds: float, batch_bytes: float) -> None:
        """One training step: seconds of compute (not waiting for input) and source bytes it consumed."""
        try:
            s, b = float(step_seconds), float(batch_bytes)
            if not (s > 0 and b > 0) or s != s or b != b:
                return
            with self._lock:
                self._steps += 1
                self._step_s += s
                self._bytes += b
                due = time.monotonic() >= self._next_send
                if due and self.enabled and self._steps:
                    self._pending = (self._step_s / self._steps, self._bytes / self._steps)
                    self._steps, self._step_s, self._bytes = 0, 0.0, 0.0
                    self._next_send = time.monotonic() + self._backoff
            if due:
                self._wake.set()
        except Exception:  # noqa: BLE001 - the training loop must never fail because of reporting
            log.debug("silod reporter: step() failed", exc_info=True)

    def wrap(self, iterable: Iterable[T], batch_bytes: int | float | Callable[[T], float]) -> Iterator[T]:
        """Yield `iterable`'s items; the time the loop spends on each (until it asks for the next)
        is its step time. `batch_bytes`: the source bytes of a batch, or a function of the batch."""
        size = batch_bytes if callable(batch_bytes) else (lambda _b: batch_bytes)
        for item in iterable:
            handed = time.perf_counter()
            yield item
            spent = time.perf_counter() - handed
            try:
                nbytes = float(size(item))
            except Exception:  # noqa: BLE001 - a bad size function costs the report, not the loop
                log.debug("silod reporter: batch_bytes failed", exc_info=True)
                continue
            self.step(spent, nbytes)

    def close(self, timeout: float | None = None) -> None:
        """Send what is left (waiting at most `timeout`, default the send timeout) and stop."""
        try:
            with self._lock:
                if self._steps and self.enabled:
                    self._pending = (self._step_s / self._steps, self._bytes / self._steps)
                    self._steps, self._step_s, self._bytes = 0, 0.0, 0.0
                self._closed = True
            self._wake.set()
            if self._thread is not None:
                self._thread.join(self.timeout if timeout is None else timeout)
        except Exception:  # noqa: BLE001
            log.debug("silod reporter: close() failed", exc_info=True)

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the sending thread

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, None
                closed = self._closed
            if pending is not None:
                ok = self._send(*pending)
                with self._lock:
                    self._backoff = self.interval if ok else min(MAX_BACKOFF_S, self._backoff * 2)
                    self._next_send = time.monotonic() + self._backoff
            if closed:
                return

    def _send(self, step_s: float, batch_bytes: float) -> bool:
        step_s = min(max(step_s, MIN_STEP_S), MAX_STEP_S)
        batch_bytes = min(batch_bytes, MAX_BATCH_BYTES)
        body = json.dumps({"step_seconds": step_s, "batch_bytes": batch_bytes}).encode()
        req = urllib.request.Request(self._url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.token}",
            "User-Agent": "silod-reporter"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                resp.read(65536)
            self.sent += 1
            return True
        except urllib.error.HTTPError as exc:
            self._failed(f"HTTP {exc.code}")
            if exc.code in (401, 403, 404):
                # Wrong token or job id: every later report would be refused the same way.
                log.warning("silod reporter: the service refused the report (HTTP %d); not reporting any more", exc.code)
                self.enabled = False
            return exc.code == 409  # 409: the job is not running (yet or any more); not a failure of ours
        except Exception as exc:  # noqa: BLE001 - down, slow, reset, bad URL: the loop carries on
            self._failed(f"{type(exc).__name__}: {exc}")
            return False

    def _failed(self, why: str) -> None:
        if self.failed == 0:
            log.warning("silod reporter: a report failed (%s); training continues, later reports retry", why)
        self.failed += 1
        self.last_error = why


__all__ = ["StepReporter"]
