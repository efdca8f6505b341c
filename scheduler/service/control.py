"""The database as the channel between API processes and the one scheduling process.

`silod serve` runs the REST API in one or more uvicorn worker processes and the scheduling
loop in a process of its own, so a round (seconds of Python over 10,000 jobs) never competes
with requests for a GIL. They share nothing but the database:

- leadership: a lease row (`leases`); only its holder runs rounds, so two `silod serve` on one
  database, or a restarted one whose predecessor is still exiting, never schedule twice;
- wake-ups: the leader polls a cheap activity signature (active job count, newest job id)
  every poll interval instead of each request writing a hot row;
- policy: the `policy` setting, read by the leader each poll;
- forced rounds (`POST /v1/rounds`): a `round_request:<nonce>` setting; the leader runs the
  round and answers in `round_result:<nonce>`;
- what only the leader knows (backend name and nodes, data-manager push errors): the
  `scheduler_status` setting, rewritten after every round;
- what the scheduling process is doing right now (compiling the policies' kernels, taking the
  lease, recovering, a round, idle) and since when: the `scheduler_activity` setting, written at
  each change and with every lease renewal (scheduler/service/leadership.py), so `/readyz`, the
  queue's wait reasons and `silod top` say what is really happening.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from scheduler.service.db.models import ACTIVE_STATES, Job, Lease, Quota, Setting
from scheduler.service.lifeline import local_process_is_dead

_HOST = socket.gethostname()

LEADER_LEASE = "scheduler"
STATUS_KEY = "scheduler_status"
ACTIVITY_KEY = "scheduler_activity"
#: An activity record older than this is not believed (its writer stopped: killed, or another host).
ACTIVITY_STALE_S = 45.0
REQUEST_PREFIX = "round_request:"
RESULT_PREFIX = "round_result:"


def read_setting(sessions: sessionmaker, key: str) -> str | None:
    with sessions() as s:
        row = s.get(Setting, key)
        return None if row is None else row.value


def write_setting(sessions: sessionmaker, key: str, value: str) -> None:
    with sessions.begin() as s:
        row = s.get(Setting, key)
        if row is None:
            s.add(Setting(key=key, value=value))
        else:
            row.value = value


def try_lead(sessions: sessionmaker, holder: str, ttl_s: float, now: float | None = None) -> bool:
    """Take or renew the leader lease; False while another holder's lease is unexpired."""
    now = time.time() if now is None else now
    try:
        with sessions.begin() as s:
            row = s.get(Lease, LEADER_LEASE, with_for_update=True)
            if row is None:
                s.add(Lease(name=LEADER_LEASE, holder=holder, expires_at=now + ttl_s))
                return True
            if row.holder != holder and row.expires_at > now and not local_process_is_dead(row.holder, _HOST):
                return False  # (a holder killed on this host is replaced at once, not after the TTL)
            row.holder, row.expires_at = holder, now + ttl_s
            return True
    except IntegrityError:  # another process inserted the first lease at the same moment
        return False


def lease_status(sessions: sessionmaker, now: float | None = None) -> str | None:
    """None when a live process holds the scheduling lease; else why not, in words (for /readyz,
    the queue's wait reasons and `silod top`): what the scheduling process is doing when it says
    (e.g. "scheduler starting: compiling policy kernels, 12 s"), else the lease's state."""
    now = time.time() if now is None else now
    with sessions() as s:
        row = s.get(Lease, LEADER_LEASE)
        lease = None if row is None else (row.holder, row.expires_at)
    if lease is not None and lease[1] > now and not local_process_is_dead(lease[0], _HOST):
        return None
    doing = describe_activity(read_activity(sessions), now)
    if doing is not None:
        return doing
    if lease is None:
        return "no process holds the scheduling lease"
    if local_process_is_dead(lease[0], _HOST):
        return "the scheduling lease's holder is dead"
    parts = lease[0].split(":")
    if len(parts) == 4 and parts[0] == _HOST and parts[1].isdigit() and os.path.exists(f"/proc/{parts[1]}"):
        return (f"the scheduling lease expired {now - lease[1]:.0f} s ago; its holder (pid {parts[1]}) is alive "
                "but has not renewed it: the machine may be starving it of CPU")
    return f"the scheduling lease expired {now - lease[1]:.0f} s ago (its holder stopped renewing it)"


def scheduling_note(sessions: sessionmaker, now: float | None = None) -> str | None:
    """What keeps a queued job from being placed right now beyond the policy, for wait reasons
    and `silod top`: why nothing schedules (`lease_status`), or a round in progress for more
    than a few seconds ("scheduler busy: running a round, 12 s"); None when rounds run normally."""
    now = time.time() if now is None else now
    why = lease_status(sessions, now)
    if why is not None:
        return why
    started = read_activity(sessions).get("round_since")
    if isinstance(started, (int, float)) and now - started >= BUSY_ROUND_S:
        return f"scheduler busy: running a round, {now - started:.0f} s"
    return None


#: A round shorter than this is not worth mentioning in a wait reason.
BUSY_ROUND_S = 5.0


def write_activity(sessions: sessionmaker, activity: dict[str, Any]) -> None:
    write_setting(sessions, ACTIVITY_KEY, json.dumps(activity))


def read_activity(sessions: sessionmaker) -> dict[str, Any]:
    raw = read_setting(sessions, ACTIVITY_KEY)
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def describe_activity(activity: dict[str, Any], now: float) -> str | None:
    """"scheduler starting: compiling policy kernels, 12 s" for a scheduling process that is
    alive, has not taken the lease and said why; None when there is nothing fresh to say."""
    phase, since, updated = activity.get("phase"), activity.get("since"), activity.get("updated")
    if not isinstance(phase, str) or not isinstance(since, (int, float)) or not isinstance(updated, (int, float)):
        return None
    if phase in ("scheduling", "stopped") or now - updated > ACTIVITY_STALE_S:
        return None
    if local_process_is_dead(str(activity.get("holder", "")), _HOST):
        return None
    return f"scheduler starting: {phase}, {max(now - since, 0.0):.0f} s"


def release_lead(sessions: sessionmaker, holder: str) -> None:
    with sessions.begin() as s:
        s.execute(delete(Lease).where(Lease.name == LEADER_LEASE, Lease.holder == holder))


def activity_signature(sessions: sessionmaker) -> tuple:
    """(active jobs, newest job id, quotas): changes on every submission, cancellation and
    quota change (the quotas table has a row per tenant with limits: small)."""
    with sessions() as s:
        n = s.scalar(select(func.count()).select_from(Job).where(Job.state.in_(ACTIVE_STATES))) or 0
        newest = s.scalar(select(func.max(Job.id))) or 0
        quotas = tuple(s.execute(select(Quota.tenant, Quota.gpus, Quota.cache_bytes, Quota.running_jobs,
                                        Quota.queued_jobs).order_by(Quota.tenant)).all())
    return int(n), int(newest), quotas


def request_round(sessions: sessionmaker, timeout_s: float = 60.0, poll_s: float = 0.05) -> dict[str, Any]:
    """API side of POST /v1/rounds: ask the leader for a round and wait for its summary."""
    nonce = secrets.token_hex(8)
    write_setting(sessions, REQUEST_PREFIX + nonce, str(time.time()))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            answer = read_setting(sessions, RESULT_PREFIX + nonce)
            if answer is not None:
                return json.loads(answer)
            time.sleep(poll_s)
    finally:
        with sessions.begin() as s:
            s.execute(delete(Setting).where(Setting.key.in_([REQUEST_PREFIX + nonce, RESULT_PREFIX + nonce])))
    raise TimeoutError("the scheduling process did not run the round in time")


def pending_round_requests(sessions: sessionmaker) -> list[str]:
    with sessions() as s:
        keys = s.scalars(select(Setting.key).where(Setting.key.like(REQUEST_PREFIX + "%"))).all()
    return [k[len(REQUEST_PREFIX):] for k in keys]


def answer_round(sessions: sessionmaker, nonces: list[str], result: dict[str, Any]) -> None:
    with sessions.begin() as s:
        s.execute(delete(Setting).where(Setting.key.in_([REQUEST_PREFIX + n for n in nonces])))
        for n in nonces:
            s.add(Setting(key=RESULT_PREFIX + n, value=json.dumps(result)))


def publish_status(sessions: sessionmaker, status: dict[str, Any]) -> None:
    write_setting(sessions, STATUS_KEY, json.dumps(status))


def read_status(sessions: sessionmaker) -> dict[str, Any]:
    raw = read_setting(sessions, STATUS_KEY)
    return json.loads(raw) if raw else {}
