"""Leader election on a coordination.k8s.io/v1 Lease (client-go's algorithm, in Python).

The scheduler Deployment runs two replicas; only the Lease holder runs the scheduling loop and
admits workloads, the other waits for the Lease (both serve the REST API over one database). The
holder renews the Lease every `retry_s`; a candidate takes the Lease over only when it has not
been renewed for `lease_s`. Every write carries the resourceVersion it read, so two candidates
racing for an expired Lease cannot both win (one gets 409 Conflict). A leader that cannot renew
within `renew_deadline_s` stops leading (the process exits and is restarted), so two leaders
never act at once for longer than the clock skew.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

FIELD_MANAGER = "silod"  # the writer named in managedFields (as backend.py)

log = logging.getLogger("silod.leader")


class LeaderElector:
    def __init__(self, api_client: Any, *, namespace: str, name: str, identity: str, lease_s: float = 15.0,
                 renew_deadline_s: float = 10.0, retry_s: float = 2.0, clock: Callable[[], float] = time.time):
        from kubernetes import client

        self.api = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_s, self.renew_deadline_s, self.retry_s = lease_s, renew_deadline_s, retry_s
        self.clock = clock
        self.leading = threading.Event()

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    def try_acquire_or_renew(self) -> bool:
        """One attempt. True when this process holds the Lease afterwards."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        now = self._now()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=10)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=int(self.lease_s),
                                        acquire_time=now, renew_time=now, lease_transitions=0))
            try:
                self.api.create_namespaced_lease(self.namespace, body, field_manager=FIELD_MANAGER, _request_timeout=10)
                return True
            except ApiException as exc2:
                if exc2.status == 409:
                    return False
                raise
        spec = lease.spec or client.V1LeaseSpec()
        holder = spec.holder_identity
        renewed = spec.renew_time.timestamp() if spec.renew_time else 0.0
        duration = float(spec.lease_duration_seconds or self.lease_s)
        if holder == self.identity:
            spec.renew_time = now
        elif not holder or self.clock() > renewed + duration:
            spec.holder_identity = self.identity
            spec.acquire_time = now
            spec.renew_time = now
            spec.lease_duration_seconds = int(self.lease_s)
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        else:
            return False
        lease.spec = spec  # lease.metadata keeps the resourceVersion we read: a race is a 409
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, field_manager=FIELD_MANAGER,
                                              _request_timeout=10)
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def run(self, on_started: Callable[[], None], on_stopped: Callable[[], None], stop: threading.Event) -> None:
        """Block until leading, call on_started, keep renewing; call on_stopped when the Lease is
        lost (or `stop` is set) and return."""
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    break
            except Exception as exc:  # noqa: BLE001 - API outages: keep trying
                log.warning("leader election: %s", exc)
            stop.wait(self.retry_s)
        if stop.is_set():
            return
        log.info("%s leads (Lease %s/%s)", self.identity, self.namespace, self.name)
        self.leading.set()
        on_started()
        last = time.monotonic()
        while not stop.wait(self.retry_s):
            try:
                ok = self.try_acquire_or_renew()
            except Exception as exc:  # noqa: BLE001
                log.warning("leader election: renew failed: %s", exc)
                ok = False
            if ok:
                last = time.monotonic()
            elif time.monotonic() - last > self.renew_deadline_s:
                log.error("%s lost the Lease %s/%s", self.identity, self.namespace, self.name)
                break
        self.leading.clear()
        on_stopped()


def run_when_leading(elector: LeaderElector, service: Any) -> threading.Thread:
    """`silod serve` with several replicas: the scheduling loop starts when this replica takes
    the Lease; when it loses the Lease the process exits (the kubelet restarts it as a
    candidate), so a deposed leader never keeps admitting. Every replica serves the API."""
    import os

    stop = threading.Event()

    def stopped() -> None:
        if not stop.is_set():
            log.error("leadership lost; exiting so that a restarted process rejoins as a candidate")
            os._exit(1)

    thread = threading.Thread(target=elector.run, args=(service.start, stopped, stop), name="silod-leader",
                              daemon=True)
    thread.start()
    return thread
