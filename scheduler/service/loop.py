"""The scheduling loop: when rounds run, and who runs them.

Rounds run on a timer (the round length) and soon after an event (submit, cancel, finish,
policy change; coalesced, at most every `min_event_gap_s`). Only the holder of the leader lease
runs rounds (scheduler/service/control.py). The lease is taken and renewed by a thread of its
own (scheduler/service/leadership.py), so a long round cannot let it expire; once this process
holds it, the loop first recovers (`SchedulerService.recover`) and then schedules.

Events come from the backend (`poll()`), from this process (`trigger`), and from API processes
through the database: a changed activity signature (a submission or a cancel elsewhere), a
changed policy setting, a forced-round request.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from sqlalchemy.orm import sessionmaker

from scheduler.backends.base import ClusterBackend, JobEvent
from scheduler.service import control
from scheduler.service import leadership
from scheduler.service.leadership import LEASE_TTL_S, Activity, LeaseKeeper
from scheduler.service.lifeline import pid_namespace
from scheduler.service.types import RoundResult, ServiceConfig

log = logging.getLogger("silod.loop")

__all__ = ["LEASE_TTL_S", "LoopRunner", "event_round_gap", "round_summary"]
#: Event-triggered rounds take at most this share of one core: after a round of d seconds the next
#: event round waits at least d * (1 / share - 1). A burst of submissions over 20k jobs otherwise
#: had the scheduling process take a round (0.4-0.7 s) every 2 s, CPU the API workers serving the
#: burst needed on a 2-core machine. Timer rounds and forced rounds (POST /v1/rounds) do not wait.
EVENT_ROUND_CPU_SHARE = 0.1


def event_round_gap(min_gap_s: float, last_round_s: float) -> float:
    """Seconds from the end of the last event round to the next: the configured gap, or more
    when rounds are long (EVENT_ROUND_CPU_SHARE)."""
    return max(min_gap_s, last_round_s * (1.0 / EVENT_ROUND_CPU_SHARE - 1.0))


class RoundService(Protocol):
    """What the loop drives: the scheduling process's service (scheduler_process.SchedulerService)."""

    sessions: sessionmaker
    config: ServiceConfig
    backend: ClusterBackend
    policy_name: str

    def recover(self) -> None: ...

    def apply_policy(self, name: str) -> None: ...

    def apply_events(self, events: Iterable[JobEvent]) -> bool: ...

    def run_round(self, reason: str = ...) -> RoundResult: ...


class LoopRunner:
    def __init__(self, service: RoundService):
        self.service = service
        # HOST:PID:NONCE:PIDNS: a successor on this host can tell when the holder died (lifeline.py)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}:{pid_namespace()}"
        self.activity = Activity()
        self.keeper = LeaseKeeper(service.sessions, self.holder, self.activity, ttl_s=leadership.LEASE_TTL_S)
        self.is_leader = False
        self._wake = threading.Event()
        self._wake_reasons: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._signature: tuple | None = None

    def trigger(self, reason: str) -> None:
        """Ask for a round as soon as possible (coalesced with other pending requests)."""
        self._wake_reasons.add(reason)
        self._wake.set()

    def start(self) -> None:
        self._stop.clear()
        self.activity.set("waiting for the scheduling lease")
        self.keeper.start()
        self.keeper.contend()
        self._thread = threading.Thread(target=self._run, name="silod-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.keeper.stop()  # releases the lease, if held
        self.is_leader = False

    def _lead(self) -> bool:
        """Whether this process holds the lease (the keeper's thread takes and renews it);
        recover on taking it."""
        leading = self.keeper.leading.is_set()
        if leading and not self.is_leader:
            log.info("this process is the scheduling leader (%s)", self.holder)
            self.activity.set("recovering the backend's jobs")
            self.service.recover()
            self._signature = None
            self.activity.set("scheduling")
            log.info("scheduler ready: this process schedules (policy %s); /readyz answers 200",
                     getattr(self.service, "policy_name", "?"))
        elif not leading and self.is_leader:
            self.activity.set("waiting for the scheduling lease")
        self.is_leader = leading
        return leading

    def _round(self, svc: RoundService, reason: str) -> RoundResult:
        self.activity.round_since = time.time()  # the keeper's next renewal says a round is running
        try:
            return svc.run_round(reason)
        finally:
            self.activity.round_since = None

    def _poll_control(self) -> list[str]:
        """Events from API processes; returns forced-round requests to answer."""
        svc = self.service
        sig = control.activity_signature(svc.sessions)
        if self._signature is not None and sig != self._signature:
            self.trigger("submit")
        self._signature = sig
        stored = control.read_setting(svc.sessions, "policy")
        if stored and stored != svc.policy_name:
            svc.apply_policy(stored)
            self.trigger("policy")
        return control.pending_round_requests(svc.sessions)

    def _run(self) -> None:
        svc, cfg = self.service, self.service.config
        next_round = time.monotonic()  # the first round runs at once
        last_event_round = 0.0
        gap = cfg.min_event_gap_s
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = max(0.0, min(next_round - now, cfg.poll_seconds))
            self._wake.wait(timeout)
            if self._stop.is_set():
                break
            try:
                if not self._lead():
                    self.keeper.leading.wait(cfg.poll_seconds)
                    continue
                requests = self._poll_control()
                if requests:
                    result = self._round(svc, "api")
                    control.answer_round(svc.sessions, requests, round_summary(result))
                    last_event_round = time.monotonic()
                    continue
                if svc.apply_events(svc.backend.poll()):
                    self.trigger("finish")
                observe = getattr(svc, "observe", None)  # the overview's measurements (rate-limited)
                if callable(observe):
                    try:
                        observe()
                    except Exception:  # only the overview is stale; scheduling goes on
                        log.warning("could not refresh the overview's measurements", exc_info=True)
                now = time.monotonic()
                reason = None
                if now >= next_round:
                    reason = "timer"
                elif self._wake.is_set() and now - last_event_round >= gap:
                    reason = ",".join(sorted(self._wake_reasons)) or "event"
                elif self._wake.is_set():
                    # Too soon after the last event round: sleep off the gap (at most a poll
                    # interval at a time, so a forced round or the timer is not kept waiting), then run.
                    time.sleep(min(gap - (now - last_event_round), cfg.poll_seconds))
                    continue
                if reason is None:
                    continue
                self._wake.clear()
                self._wake_reasons.clear()
                result = self._round(svc, reason)
                last_event_round = time.monotonic()
                gap = event_round_gap(cfg.min_event_gap_s, getattr(result, "duration_s", 0.0) or 0.0)
                if reason == "timer":
                    next_round = last_event_round + cfg.round_seconds
            except Exception:  # the loop must survive a bad round (or a database outage); the next one retries
                log.exception("scheduling round failed")
                time.sleep(min(cfg.poll_seconds, 1.0))


def round_summary(r) -> dict:  # type: ignore[no-untyped-def]
    return {"round_id": r.round_id, "reason": r.reason, "active": r.active, "running": list(r.running),
            "started": list(r.started), "stopped": list(r.stopped), "changes": r.changes, "duration_s": r.duration_s}
