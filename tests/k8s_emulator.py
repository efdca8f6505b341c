"""An EMULATED Kubernetes API server on 127.0.0.1 for the Kubernetes backend's tests.

No real cluster can run on the test machines, so the tests drive the real `kubernetes` Python
client (HTTP, JSON, models, watch streams) against kmock's `KubernetesEmulator` (pip package
kmock): an in-memory, stateful server that implements create/list/get/patch/delete/watch for any
resource. kmock has no `pods/{name}/binding` subresource, so `SilodEmulator` adds it the way the
real API server behaves:

- POST .../pods/{name}/binding sets `spec.nodeName` (and a PodScheduled condition), answers 201
  with a `Status` object (not a `Binding`: the reason the generated client cannot deserialise
  the reply), 409 Conflict if the pod is already bound, 404 if the pod does not exist; watchers
  see a MODIFIED event.

What it does NOT emulate (documented in docs/kubernetes.md): field/label selectors (the backend
filters again client-side), resourceVersions, admission (quota, RBAC), kubelets (pods stay in
whatever phase the test sets), strategic-merge semantics beyond recursive dict merge.

The server runs on its own asyncio loop in a background thread, because the official client is
synchronous.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import enums

PODS = kmock.resource(group="", version="v1", plural="pods")
NODES = kmock.resource(group="", version="v1", plural="nodes")
EVENTS = kmock.resource(group="", version="v1", plural="events")


def _status(code: int, reason: str, message: str, status: str = "Failure") -> aiohttp.web.Response:
    return aiohttp.web.json_response(
        {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": status, "code": code,
         "reason": reason, "message": message}, status=code)


class SilodEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator plus the pods/binding subresource.

    `binding_log` records every binding request as (namespace, pod, target node, HTTP status)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.binding_log: list[tuple[str, str, str, int]] = []
        # Declare the served resources, so that listing them works before any object exists.
        for res, kind, namespaced in ((PODS, "Pod", True), (NODES, "Node", False), (EVENTS, "Event", True)):
            self.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=namespaced,
                                                     verbs={"list", "watch", "get", "create", "patch", "delete"})

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if (request.resource is not None and request.resource.plural == "pods"
                and request.subresource == "binding" and request.method == enums.method.POST):
            return await self._bind(request)
        return await super()._handle(request)

    async def _bind(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        response = await self._bind_inner(request)
        target = ((request.data or {}).get("target") or {}).get("name") or ""
        self.binding_log.append((request.namespace or "", request.name or "", target, response.status))
        return response

    async def _bind_inner(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (PODS, request.namespace, request.name)
        target = ((request.data or {}).get("target") or {}).get("name")
        if not target:
            return _status(400, "BadRequest", "binding target.name is required")
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return _status(404, "NotFound", f'pods "{request.name}" not found')
            obj = self._objects[key]
            current = (obj.get("spec") or {}).get("nodeName")
            if current:
                return _status(409, "Conflict",
                               f'Operation cannot be fulfilled on pods/binding "{request.name}": '
                               f"pod {request.name} is already assigned to node \"{current}\"")
            obj.patch({"spec": {"nodeName": target},
                       "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}})
            await self._buses[PODS].put({"type": "MODIFIED", "object": obj.raw})
        return _status(201, "", "", status="Success")


class EmulatedCluster:
    """Starts SilodEmulator on 127.0.0.1 in a thread; gives CoreV1Api clients pointed at it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="k8s-emulator", daemon=True)
        self.emulator: SilodEmulator | None = None
        self._server: kmock.Server | None = None
        self.url = ""
        self._clients: list[Any] = []

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()

        async def up() -> str:
            self.emulator = SilodEmulator()
            await self.emulator.__aenter__()
            self._server = kmock.Server(self.emulator, host="127.0.0.1")
            await self._server.__aenter__()
            return str(self._server.url).rstrip("/")

        self.url = asyncio.run_coroutine_threadsafe(up(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        for c in self._clients:
            c.api_client.close()

        async def down() -> None:
            assert self._server is not None and self.emulator is not None
            await self._server.__aexit__(None, None, None)
            await self.emulator.__aexit__(None, None, None)

        try:
            asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def api(self) -> Any:
        """A fresh CoreV1Api (as a restarted scheduler process would create)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        api = client.CoreV1Api(client.ApiClient(cfg))
        self._clients.append(api)
        return api

    # --- inspection (the test's view of the server's state, not through the client) ----------

    def _call(self, fn: Any) -> Any:
        async def run() -> Any:
            assert self.emulator is not None
            async with self.emulator._lock:
                return fn(self.emulator)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def bindings(self) -> list[tuple[str, str, str, int]]:
        """Every binding request so far: (namespace, pod, node, HTTP status)."""
        return self._call(lambda em: list(em.binding_log))

    def requests(self, method: str, plural: str | None = None) -> list[kmock.Request]:
        """Requests kmock recorded (everything except bindings, see `bindings()`)."""
        def pick(em: SilodEmulator) -> list[kmock.Request]:
            return [r for r in list(em._requests) if str(r.method).upper() == method.upper()
                    and (plural is None or (r.resource is not None and r.resource.plural == plural))]
        return self._call(pick)

    def objects(self, resource: Any) -> list[dict[str, Any]]:
        def pick(em: SilodEmulator) -> list[dict[str, Any]]:
            return [obj.raw for (res, _, _), obj in em.objects.items() if res == resource and not obj.deleted]
        return self._call(pick)


@contextmanager
def emulated_cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as cluster:
        yield cluster
