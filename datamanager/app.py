"""The data manager's HTTP API (FastAPI): SiloD Table 3 plus FUSE-client registration.

    PUT    /v1/datasets/{name}              declare a dataset {"uri": ...}            (optional)
    GET    /v1/datasets/{name}
    PUT    /v1/datasets/{name}/cache        allocateCacheSize  {"bytes": N | "20GB"}
    PUT    /v1/datasets/{name}/cache-mode   {"mode": "uniform" | "lru"}  (irregular jobs: LRU)
    PUT    /v1/jobs/{id}                    declare a job {"dataset": ..., "workers": N}; the dataset must be declared
    GET    /v1/jobs/{id}
    DELETE /v1/jobs/{id}
    PUT    /v1/jobs/{id}/remote-io          allocateRemoteIO   {"bytes_per_s": R | "200MB/s", "workers": N}
    POST   /v1/clients                      a FUSE client registers (declares its dataset and job)
    PUT    /v1/clients/{id}/heartbeat       stats in, the client's allocation out
    DELETE /v1/clients/{id}
    PUT    /v1/placements                   {"nodes": {node: [dataset, ...]}}: what each node may mount
    GET    /v1/placements
    GET    /v1/status                       per node / dataset / job / client
    GET    /metrics                         Prometheus
    GET    /healthz

Allocating to a dataset or job the manager has never heard of is a 404, not an implicit create:
a typo in a scheduler must not silently allocate to nothing. Datasets and jobs become known by
a declaration or when a FUSE client mounts them. Bad input is a 400/422 whose `detail` names the
field and the fix; state is only changed after the whole request validated.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from datamanager.auth import NODE_RE, DataManagerAuth, DataManagerGuard
from http_guard.json_limits import BodyShapeError, JsonLimits, limited_json_route
from datamanager.metrics import render_metrics
from datamanager.state import ClientRegistration, ClientState, StateNotSaved, StateStore, TooManyClients, UnknownEntity
from estimator.errors import UserError
from estimator.units import MAX_GPUS, parse_rate, parse_size
from contract.names import node_mount_job, validate_name

log = logging.getLogger("silod.datamanager")

# A number or text with a unit ("20GB", "200MB/s"). Deliberately untyped here: pydantic would
# coerce `true` to 1; estimator.units rejects bools, negatives and junk with one clear message.
Number = Any


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetDecl(_Strict):
    uri: str | None = None


class JobDecl(_Strict):
    dataset: str | None = None
    workers: int | None = None


class CacheAllocation(_Strict):
    bytes: Number


class CacheModeBody(_Strict):
    mode: Literal["uniform", "lru"]


class RemoteIOAllocation(_Strict):
    bytes_per_s: Number
    workers: int | None = None


class PlacementsBody(_Strict):
    """node -> the storage keys that node has a reason to mount (the whole map, replaced)."""

    nodes: dict[str, list[str]] = Field(max_length=100_000)


class ClientRegistrationBody(ClientRegistration):
    model_config = ConfigDict(extra="forbid")


class HeartbeatBody(_Strict):
    stats: dict[str, Any] = {}


class NotYourNode(Exception):
    """A node-bound agent token used on another node's client."""


class PlacementsUnknown(Exception):
    """A node-bound agent registers a mount before the scheduler said where jobs run: 503, retried
    at the mount's next heartbeat (the scheduler pushes placements every minute)."""


def _workers(value: int | None) -> int | None:
    if value is not None and not 1 <= value <= MAX_GPUS:
        raise UserError(f"workers {value!r} must be an integer between 1 and {MAX_GPUS:,} (one per mount of the job)")
    return value


# A mount's client id is "<node>-<job>-<pid>-<hex>" (fuse_client/mount.py) and its node a host
# name: one path segment each, no '..', nothing a JSON or Prometheus encoder could refuse.
_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,511}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
MAX_PID = 2**31


def _text(value: str, field: str, max_len: int = 4096) -> None:
    """Free text kept in the state file (a source URI, a mountpoint): printable and UTF-8, or a
    400 naming the field. A lone surrogate ('\\ud800') passed JSON parsing, then failed every later
    save of the state, which made every write a 500 until a restart."""
    if len(value) > max_len:
        raise UserError(f"{field} is {len(value):,} characters; at most {max_len:,}")
    if _CONTROL_RE.search(value):
        raise UserError(f"{field} {value[:80]!r} contains a control character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{field} {value[:80]!r} is not valid UTF-8 text (a lone surrogate)") from None


def _check_registration(body: ClientRegistration) -> None:
    if not _CLIENT_ID_RE.match(body.client_id):
        raise UserError(f"client_id {body.client_id[:80]!r} must be 1-512 letters, digits, '.', '_' or '-', starting with a "
                        f"letter or digit (a mount's is <node>-<job>-<pid>-<hex>)")
    if not _HOST_RE.match(body.node):
        raise UserError(f"node {body.node[:80]!r} is not a host name: letters, digits, '.', '_' and '-', at most 253")
    validate_name(body.dataset, "dataset")
    validate_name(body.job, "job")
    _text(body.source, "source")
    _text(body.mountpoint, "mountpoint")
    if not 0 <= body.pid <= MAX_PID:
        raise UserError(f"pid {body.pid} is not a process id (0 to {MAX_PID:,})")


_MAX_STAT = 2**63 - 1  # counters of bytes, items and errors fit a signed 64-bit integer


def _check_stats(value: Any, field: str = "stats") -> None:
    """A heartbeat's stats are shown by /v1/status and /metrics as they came: a NaN or an
    unencodable string among them made both answer 500 for as long as the client kept them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{field} is {value!r}; numbers in stats must be finite")
    if isinstance(value, int) and abs(value) > _MAX_STAT:
        # A 400-digit count passed float() nowhere: /v1/status and /metrics answered 500.
        raise UserError(f"{field} is an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits;"
                        f" numbers in stats must be within +-2^63")
    if isinstance(value, str):
        _text(value, field)
    elif isinstance(value, dict):
        for k, v in value.items():
            _text(k, f"{field} key")
            _check_stats(v, f"{field}.{k[:80]}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_stats(v, f"{field}[{i}]")


def _check_uri(uri: str) -> None:
    """The operator's allow-list (contract.uri_policy), when SILOD_ALLOWED_URIS is set: the
    data manager records sources, it does not read them, so without the variable it accepts any."""
    import os

    from contract.uri_policy import ENV, UriPolicy

    if os.environ.get(ENV):
        UriPolicy.from_env().check(uri)


def create_app(state_dir: Path, auth: DataManagerAuth | None = None) -> FastAPI:
    """The API over the state in `state_dir`. `auth` (default: from the environment, see
    datamanager/auth.py) decides who may call what; errors never echo internal paths."""
    store = StateStore(state_dir)
    app = FastAPI(title="silod data manager", version="1", redirect_slashes=False)  # no Host-built redirects
    # JSON bodies checked for their shape before validation (http_guard/json_limits.py): a
    # heartbeat's stats carry per-pod figures, so its bounds are wider than the scheduler API's.
    app.router.route_class = limited_json_route(JsonLimits(max_depth=8, max_keys=4096, max_items=10_000,
                                                           max_values=200_000))
    app.state.store = store
    app.add_middleware(DataManagerGuard, auth=auth if auth is not None else DataManagerAuth.from_env())

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("data manager request failed", exc_info=exc)
        return JSONResponse(status_code=500, content={"detail": "internal error"})

    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    @app.exception_handler(BodyShapeError)
    async def _shape(request: Request, exc: BodyShapeError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail})

    @app.exception_handler(NotYourNode)
    async def _not_your_node(request: Request, exc: NotYourNode) -> JSONResponse:
        return JSONResponse(status_code=403, content={"detail": exc.args[0]})

    @app.exception_handler(PlacementsUnknown)
    async def _placements_unknown(_req: Request, exc: PlacementsUnknown) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": exc.args[0]}, headers={"Retry-After": "5"})

    @app.exception_handler(TooManyClients)
    async def _too_many(request: Request, exc: TooManyClients) -> JSONResponse:
        return JSONResponse(status_code=429, content={"detail": exc.args[0]}, headers={"Retry-After": "5"})

    @app.exception_handler(StateNotSaved)
    async def _not_saved(request: Request, exc: StateNotSaved) -> JSONResponse:
        log.error("data manager state not saved: %s", exc)
        return JSONResponse(status_code=503, content={"detail": str(exc)}, headers={"Retry-After": "5"})

    @app.exception_handler(UnknownEntity)
    async def _unknown(request: Request, exc: UnknownEntity) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": exc.args[0]})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            parts.append(f"{loc}: {err.get('msg')}")
        return JSONResponse(status_code=422, content={"detail": "invalid request: " + "; ".join(parts)})

    # -- datasets ----------------------------------------------------------------------------

    @app.put("/v1/datasets/{name}")
    def declare_dataset(name: str, body: DatasetDecl | None = None) -> dict:
        validate_name(name, "dataset")
        if body is not None and body.uri is not None:
            _text(body.uri, "uri")
            _check_uri(body.uri)
        return store.declare_dataset(name, None if body is None else body.uri).model_dump()

    @app.get("/v1/datasets/{name}")
    def get_dataset(name: str) -> dict:
        validate_name(name, "dataset")
        return store.dataset(name).model_dump()

    @app.put("/v1/datasets/{name}/cache")
    def allocate_cache_size(name: str, body: CacheAllocation) -> dict:
        validate_name(name, "dataset")
        nbytes = int(parse_size(body.bytes, what="cache allocation 'bytes'"))
        return store.allocate_cache_size(name, nbytes).model_dump()

    @app.put("/v1/datasets/{name}/cache-mode")
    def set_cache_mode(name: str, body: CacheModeBody) -> dict:
        validate_name(name, "dataset")
        return store.set_cache_mode(name, body.mode).model_dump()

    # -- jobs --------------------------------------------------------------------------------

    @app.put("/v1/jobs/{job_id}")
    def declare_job(job_id: str, body: JobDecl | None = None) -> dict:
        validate_name(job_id, "job")
        body = body or JobDecl()
        if body.dataset is not None:
            validate_name(body.dataset, "dataset")
        return store.declare_job(job_id, body.dataset, _workers(body.workers)).model_dump()

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str) -> dict:
        validate_name(job_id, "job")
        return store.job(job_id).model_dump()

    @app.delete("/v1/jobs/{job_id}")
    def delete_job(job_id: str) -> dict:
        validate_name(job_id, "job")
        store.delete_job(job_id)
        return {"deleted": job_id}

    @app.put("/v1/jobs/{job_id}/remote-io")
    def allocate_remote_io(job_id: str, body: RemoteIOAllocation) -> dict:
        validate_name(job_id, "job")
        rate = parse_rate(body.bytes_per_s, what="remote IO allocation 'bytes_per_s'")
        return store.allocate_remote_io(job_id, rate, _workers(body.workers)).model_dump()

    # -- FUSE clients ------------------------------------------------------------------------

    def _own_node(request: Request, node: str) -> None:
        """A node-bound agent acts only on its node's clients (403 otherwise)."""
        who = request.scope.get("state", {}).get("dm_identity")
        bound = getattr(who, "node", None)
        if bound is not None and bound != node:
            raise NotYourNode(f"this agent token is bound to node {bound!r}; it may not act on a client of node {node!r}")

    def _own_mount(request: Request, body: ClientRegistrationBody) -> None:
        """A node-bound agent registers only its node's mounts: the job is the node mount's
        (`node-<node>_<dataset key>`, contract.names.node_mount_job), so it cannot join another
        job (a tenant's REST job, another node's mount) and dilute that job's remote-IO share."""
        who = request.scope.get("state", {}).get("dm_identity")
        if getattr(who, "node", None) is not None and body.job != node_mount_job(body.node, body.dataset):
            raise NotYourNode(f"a node's agent registers only its node's mounts: job must be "
                              f"{node_mount_job(body.node, body.dataset)!r} for dataset {body.dataset!r}, not {body.job!r}")

    def _placed(request: Request, body: ClientRegistrationBody) -> None:
        """A node-bound agent registers a mount only of a dataset its node has a reason to mount:
        an active job reading it has a pod bound to that node, in the scheduler's record (pushed
        as PUT /v1/placements). Until the scheduler has pushed placements once, a node-bound agent
        registers nothing (503, retried at the next heartbeat): node-bound tokens are issued where a
        scheduler pushes them. Other callers (the local backend's mounts, the scheduler) are not
        asked, so a data manager without a scheduler keeps working."""
        who = request.scope.get("state", {}).get("dm_identity")
        if getattr(who, "node", None) is None:
            return
        placed = store.placed_on(body.node, body.dataset)
        if placed is None:
            raise PlacementsUnknown("the scheduler has not yet told this data manager where jobs run (PUT /v1/placements,"
                                    " pushed every minute); a node's agent registers mounts after that: retry")
        if placed is False:
            raise NotYourNode(f"node {body.node!r} has no reason to mount dataset {body.dataset!r}: no active silod job"
                              f" reading it has a pod on that node (the scheduler's record; a pod just bound is"
                              f" pushed within seconds, and the mount registers again at its next heartbeat)")

    @app.put("/v1/placements")
    def put_placements(body: PlacementsBody) -> dict:
        for node, keys in body.nodes.items():
            if len(node) > 253 or not NODE_RE.match(node):
                raise UserError(f"node {node[:80]!r} is not a Kubernetes node name (RFC 1123)")
            for k in keys:
                validate_name(k, "dataset")
        return {"nodes": store.set_placements(body.nodes)}

    @app.get("/v1/placements")
    def get_placements() -> dict:
        return {"nodes": store.state.placements}

    @app.post("/v1/clients")
    def register_client(body: ClientRegistrationBody, request: Request) -> dict:
        _check_registration(body)
        _own_node(request, body.node)
        _own_mount(request, body)
        _placed(request, body)
        try:  # re-registering another node's client id would take that client over
            _own_node(request, store.client_node(body.client_id))
        except UnknownEntity:
            pass
        if body.source:
            _check_uri(body.source)
        alloc = store.register_client(ClientState(**body.model_dump()))
        return {"client_id": body.client_id, "allocation": alloc.as_dict()}

    @app.put("/v1/clients/{client_id}/heartbeat")
    def heartbeat(client_id: str, body: HeartbeatBody, request: Request) -> dict:
        _own_node(request, store.client_node(client_id))
        _check_stats(body.stats)
        return {"allocation": store.heartbeat(client_id, body.stats).as_dict()}

    @app.delete("/v1/clients/{client_id}")
    def unregister_client(client_id: str, request: Request) -> dict:
        _own_node(request, store.client_node(client_id))
        store.unregister_client(client_id)
        return {"deleted": client_id}

    # -- observability -----------------------------------------------------------------------

    @app.get("/v1/status")
    def status() -> dict:
        return store.status()

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        body, content_type = render_metrics(store)
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    return app
