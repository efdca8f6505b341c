"""`NullBackend`: runs nothing and records what it was asked to do.

It exists so that the API and the scheduling loop can be exercised without a cluster (tests,
API benchmarks). Jobs it "starts" never make progress and never finish on their own: it never
invents results. A test may inject events explicitly with `emit()` to play the part of a real
backend reporting progress.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from scheduler.backends.base import (
    BackendConfig,
    ClusterBackend,
    ClusterDescription,
    JobAllocation,
    JobEvent,
    JobSpec,
    capacity_description,
)


@dataclass
class NullBackend(ClusterBackend):
    description: ClusterDescription
    name: str = "null"
    started: list[tuple[JobSpec, JobAllocation]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    fail_start: set[str] = field(default_factory=set)  # job ids whose start() raises (tests)
    _events: list[JobEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def describe(self) -> ClusterDescription:
        return self.description

    def start(self, job: JobSpec, allocation: JobAllocation) -> None:
        with self._lock:
            if job.job_id in self.fail_start:
                raise RuntimeError(f"cannot start job {job.job_id}: injected failure")
            self.started.append((job, allocation))
            self.running.add(job.job_id)

    def stop(self, job_id: str) -> None:
        with self._lock:
            self.stopped.append(job_id)
            self.running.discard(job_id)

    def poll(self) -> list[JobEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def emit(self, event: JobEvent) -> None:
        """Queue an event as if the cluster had reported it (for tests)."""
        with self._lock:
            self._events.append(event)


def create_backend(config: BackendConfig) -> NullBackend:
    return NullBackend(description=capacity_description(config.capacity))
