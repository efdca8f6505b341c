"""The service as an API worker process sees it: the catalogue and the read views, without a
backend and without rounds. The scheduling process (SchedulerService, the lease holder) does
the rounds; this side talks to it only through the database (scheduler/service/control.py).

Several of these run side by side (`silod serve --workers N`), one per uvicorn worker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from estimator.errors import UserError
from policies.registry import resolve_policy_name
from scheduler.service import control
from scheduler.backends.base import ClusterDescription, NodeInfo
from scheduler.service.catalogue import Catalogue
from scheduler.service.types import ForbiddenError, Principal, RoundResult, ServiceConfig, ServiceError
from scheduler.service.views import ClusterStatus, ReadViews

_STATUS_TTL_S = 1.0


class SchedulerUnavailable(ServiceError):
    """The scheduling process did not answer a forced round in time."""

    status = 503  # /v1/cluster and /metrics read the leader's status at most this often


class ApiService(ReadViews):
    def __init__(self, engine: Engine, config: ServiceConfig, workloads: Any = None):
        self.engine = engine
        self.config = config
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        # Serialises this process's writes (SQLite has one writer; waiting here is cheaper than
        # waiting on the database's busy handler).
        self._write_lock = threading.RLock()
        # `workloads`: with --backend kubernetes, a client that creates a REST job's suspended
        # Job from its pod_template; the scheduling process adopts it (no scheduling here).
        self.catalogue = Catalogue(self.sessions, config, self._write_lock, self.trigger, workloads=workloads)
        self.workloads = workloads
        self._cached: tuple[float, dict] | None = None

    def trigger(self, reason: str) -> None:
        """Nothing to do: the leader notices submissions and cancels by polling (control.py)."""

    def start(self) -> None:  # the app's lifespan calls these; there is no loop here
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        close = getattr(self.workloads, "close", None)
        if callable(close):
            close()
        self.engine.dispose()

    def _raw_status(self) -> dict:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > _STATUS_TTL_S:
            self._cached = (now, control.read_status(self.sessions))
        return self._cached[1]

    def _overview_status(self) -> dict:
        return self._raw_status()

    def _status(self) -> ClusterStatus:
        st = self._raw_status()
        nodes = tuple(NodeInfo(n["name"], int(n["gpus"]), float(n["cache"]), dict(n.get("labels") or {}),
                               n.get("cache_source"))
                      for n in st.get("nodes", ()))
        planned = st.get("capacity")
        capacity = None if not isinstance(planned, dict) else dataclasses.replace(
            self.config.capacity, gpus=int(planned["gpus"]), cache=float(planned["cache"]),
            remote_io=float(planned["remote_io"]))
        return ClusterStatus(ClusterDescription(nodes, self.config.capacity.remote_io), st.get("backend", "unknown"),
                             st.get("datamanager"), st.get("last_round_time"), st.get("last_push_error"), capacity)

    @property
    def rounds_total(self) -> int:
        return int(self._raw_status().get("rounds_total", 0))

    @property
    def round_durations(self) -> list[float]:
        return [float(self._raw_status().get("last_round_duration_s", 0.0))]

    @property
    def policy_name(self) -> str:  # type: ignore[override]
        return control.read_setting(self.sessions, "policy") or "fifo"

    def set_policy(self, who: Principal, name: str) -> str:
        if not who.is_admin:
            raise ForbiddenError("only the admin may change the scheduling policy")
        try:
            name = resolve_policy_name(name)
        except UserError as exc:  # the same message (and case rule) as the commands give
            raise ServiceError(str(exc), field="name") from None
        control.write_setting(self.sessions, "policy", name)  # the leader applies it within a poll interval
        return name

    def run_round(self, reason: str = "api") -> RoundResult:
        try:
            r = control.request_round(self.sessions)
        except TimeoutError as exc:
            raise SchedulerUnavailable(f"{exc}; is the scheduling process running?") from None
        return RoundResult(round_id=r["round_id"], reason=r["reason"], active=r["active"], running=tuple(r["running"]),
                           started=tuple(r["started"]), stopped=tuple(r["stopped"]), changes=r["changes"],
                           duration_s=r["duration_s"], plan=None)
