"""Recovery after a restart: make the backend run exactly what the database says.

The backend is a new object after a restart. A job the database records as running that the
backend still runs (re-adopted, see `ClusterBackend.running_jobs`) stays RUNNING: no stop, no
restart, its progress keeps arriving through poll(). Every other job recorded as running is
stopped (idempotent for the backend) and queued again; the first round restarts it from its
recorded progress. A job of ours that the backend runs although the database does not record it
as running (the service died between committing a preemption or a cancel and carrying it out)
is stopped. Runs when a process becomes the scheduling leader, before its first round.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import insert, select
from sqlalchemy.orm import sessionmaker

from scheduler.backends.base import ClusterBackend
from scheduler.service.catalogue import parse_job_id
from scheduler.service.db.models import AllocationChange, Job, JobAllocationRow, JobState

log = logging.getLogger("silod.recovery")


def recover(sessions: sessionmaker, backend: ClusterBackend) -> None:
    try:
        alive = {str(j) for j in backend.running_jobs()}
    except Exception:  # a backend that cannot tell: restart everything, as without the hook
        log.exception("backend %s could not list its running jobs; requeueing every running job", backend.name)
        alive = set()
    orphans: list[str] = []
    with sessions.begin() as s:
        now = time.time()
        rows = s.scalars(select(JobAllocationRow).where(JobAllocationRow.running)).all()
        kept: set[str] = set()
        for row in rows:
            job = s.get(Job, row.job_id)
            if str(row.job_id) in alive and job is not None and job.state == JobState.RUNNING:
                kept.add(str(row.job_id))
                log.info("job %s: still running in the backend after the restart; kept", row.job_id)
                continue
            backend.stop(str(row.job_id))
            s.execute(insert(AllocationChange), [
                dict(round_id=None, time=now, subject_kind="job", subject=str(row.job_id), resource=res,
                     old_value=old, new_value=new)
                for res, old, new in (("running", 1.0, 0.0), ("gpus", float(row.gpus), 0.0)) if old != new
            ])
            row.running = False
            row.gpus = 0
            if job is not None and job.state == JobState.RUNNING:
                job.state = JobState.QUEUED
                job.message = "requeued after a scheduler restart"
        ours = {pk: jid for jid in alive - kept if (pk := parse_job_id(jid)) is not None}
        if ours:
            known = set(s.scalars(select(Job.id).where(Job.id.in_(list(ours)))).all())
            orphans = sorted(ours[pk] for pk in known)
        unknown = sorted(alive - kept - set(orphans))
        if unknown:
            log.warning("the backend runs jobs this service does not know, left alone: %s", ", ".join(unknown))
    for jid in orphans:
        log.warning("job %s: running in the backend but not recorded as running; stopping it", jid)
        backend.stop(jid)
