"""The FUSE client's side of the data manager protocol: register, heartbeat, pull the allocation.

Every HEARTBEAT_INTERVAL_S the client sends its stats and receives the allocation that applies
to it: the cache bytes of its dataset and the remote-IO rate of its job (already divided among
the job's workers by the manager). If the manager is unreachable the client keeps enforcing the
last allocation it received; if the manager answers 404 (it lost our registration, e.g. its
state directory was wiped) the client registers again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
REQUEST_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PulledAllocation:
    """What the manager says applies to this mount; None = the scheduler has not set it."""

    cache_bytes: int | None
    remote_io_bytes_per_s: float | None
    cache_mode: str | None = None  # uniform | lru; None: the scheduler has not set it


@dataclass(frozen=True)
class ClientRegistration:
    client_id: str
    node: str
    dataset: str
    job: str
    source: str
    mountpoint: str
    pid: int


class _FileBearer(httpx.Auth):
    """httpx auth: `Authorization: Bearer` from a file read at each request (or a fixed token).
    httpx takes only `httpx.Auth` subclasses (0.28 refuses anything else with a TypeError)."""

    def __init__(self, path: str | None, token: str | None = None) -> None:
        self.path, self.token = path, token

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        token = self.token
        if self.path is not None:
            try:
                with open(self.path, encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError as exc:
                log.warning("data manager token file %s: %s", self.path, exc.strerror)
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


class ManagerLink:
    def __init__(
        self,
        base_url: str,
        registration: ClientRegistration,
        get_stats: Callable[[], dict],
        on_allocation: Callable[[PulledAllocation], None],
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.registration = registration
        self._get_stats = get_stats
        self._on_allocation = on_allocation
        # The agent token, when the data manager requires one: SILOD_DM_TOKEN_FILE (re-read at
        # every request: kubelet rotates an agent pod's projected service-account token in place)
        # or SILOD_DM_TOKEN.
        token_file = os.environ.get("SILOD_DM_TOKEN_FILE")
        token = os.environ.get("SILOD_DM_TOKEN")
        auth: _FileBearer | None = None
        if token_file:
            auth = _FileBearer(token_file)
        elif token:
            auth = _FileBearer(None, token)
        self._http = httpx.Client(base_url=self.base_url, timeout=REQUEST_TIMEOUT_S, auth=auth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered = False
        self.connected = False

    def _apply(self, body: dict) -> None:
        alloc = body.get("allocation") or {}
        mode = alloc.get("cache_mode")
        self._on_allocation(PulledAllocation(alloc.get("cache_bytes"), alloc.get("remote_io_bytes_per_s"),
                                             mode if mode in ("uniform", "lru") else None))

    def register(self) -> bool:
        try:
            r = self._http.post("/v1/clients", json=self.registration.__dict__)
            r.raise_for_status()
        except Exception as exc:
            log.warning("data manager %s: registration failed (%s); keeping the current allocation", self.base_url, exc)
            self.connected = False
            return False
        self._registered = True
        self.connected = True
        self._apply(r.json())
        return True

    def heartbeat(self) -> bool:
        if not self._registered:
            return self.register()
        try:
            r = self._http.put(f"/v1/clients/{self.registration.client_id}/heartbeat", json={"stats": self._get_stats()})
            if r.status_code == 404:
                self._registered = False
                return self.register()
            r.raise_for_status()
        except Exception as exc:
            if self.connected:
                log.warning("data manager %s unreachable (%s); keeping the last allocation", self.base_url, exc)
            self.connected = False
            return False
        self.connected = True
        self._apply(r.json())
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="silod-manager-link", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            self.heartbeat()

    def stop(self, unregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if unregister and self._registered:
            try:
                self._http.delete(f"/v1/clients/{self.registration.client_id}", timeout=1.0)
            except Exception:
                pass
        self._http.close()
