"""FastAPI application: routes translate HTTP to `SchedulerService` calls and back, nothing more.

Every error a client can cause is a 4xx with a JSON body `{"detail": ..., "field": ...}` (or
FastAPI's validation list, which names the field in `loc`); an unexpected exception is a 500
that the tests (including a schemathesis fuzzer) treat as a bug.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict, fields
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select, text
from sqlalchemy.exc import SQLAlchemyError

from estimator.access import EPOCH, AccessPattern
from estimator.errors import UserError
from http_guard.json_limits import BodyShapeError, JsonLimits, limited_json_route
from http_guard.timeouts import BODY_IDLE_TIMEOUT_S, BODY_TOTAL_TIMEOUT_S
from policies.registry import available_policies
from scheduler.service.api.auth import TokenStore, check_tenant
from scheduler.service.api.fair_pool import FairThreadPool
from http_guard.auth_limit import FailedAuthLimiter
from scheduler.service.api.guard import DEFAULT_MAX_BODY, OUTAGE_BODY, RETRY_AFTER_S, RequestGuard, is_database_outage
from scheduler.service.api.metrics import make_registry, metrics_response
from scheduler.service.api.schemas import (
    AllocationsOut,
    ChangeOut,
    ClientReportIn,
    ClusterOut,
    ConsumptionIn,
    ConsumptionOut,
    CredentialIn,
    CredentialOut,
    DatasetIn,
    DatasetOut,
    ErrorOut,
    HealthOut,
    JobIn,
    JobOut,
    MeasuredParamsOut,
    NewTokenOut,
    NodeOut,
    PolicyIn,
    PolicyOut,
    QuotaIn,
    QuotaOut,
    ReadyOut,
    RoundOut,
    TokenIn,
    TokenOut,
    UsageOut,
)
from scheduler.service.catalogue import NewCredential
from scheduler.service.consumption import ConsumptionStore, PodReport
from scheduler.service.catalogue import parse_job_id
from scheduler.service.db.models import Job, JobState, WorkloadPod
from scheduler.service.measured_params import MeasurementStore, params_of
from scheduler.service.overview import Overview
from scheduler.service.scheduler_process import SchedulerService
from scheduler.service.types import (ConflictError, ForbiddenError, JobRecord, NewDataset, NewJob, NotFoundError, Principal,
                                     ServiceError, TenantQuota)

log = logging.getLogger("silod.api")

# Above the largest legal body (a consumption report: 1,000 pods of 6 values; a pod template's
# 256 args and 64 env entries; its affinity, nested as Kubernetes nests it: podAffinity's
# preferred terms reach 11 levels from the body), far below what made validation expensive.
BODY_LIMITS = JsonLimits(max_depth=12, max_keys=64, max_items=1000, max_values=16_384)
MAX_ERRORS = 20
#: characters of an error message answered: messages quote the caller's own input (an id from the
#: path, a name), which the server has no reason to echo back whole
MAX_DETAIL = 1024


def _bounded_detail(message: str) -> str:
    if len(message) <= MAX_DETAIL:
        return message
    return f"{message[:MAX_DETAIL]}... ({len(message) - MAX_DETAIL} more characters)"

_bearer = HTTPBearer(auto_error=False, description="a token from the admin API or --tokens FILE, or the admin token")

_ERRORS = {
    401: {"model": ErrorOut, "description": "missing, invalid, revoked or expired bearer token"},
    403: {"model": ErrorOut, "description": "not allowed for this token (admin only, or beyond your quota)"},
    404: {"model": ErrorOut, "description": "not found (or another tenant's object)"},
    409: {"model": ErrorOut, "description": "conflict with the current state"},
    413: {"model": ErrorOut, "description": "request body larger than the cap"},
    503: {"model": ErrorOut, "description": "database unavailable; see Retry-After"},
}


async def principal(request: Request, _creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    """The caller, as the RequestGuard middleware authenticated it before the body was read.
    (`_creds` only documents the scheme in OpenAPI.) Async: no thread-pool hop for it."""
    who = request.scope.get("state", {}).get("principal")
    if not isinstance(who, Principal):  # the guard lets no request through without one
        raise HTTPException(status_code=401, detail="missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
    return who


Who = Annotated[Principal, Depends(principal)]
OwnerQ = Annotated[str | None, Query(max_length=64, description="the owning tenant, for a dataset shared with you")]
#: A page of a listing: at most 1,000 objects per answer (a tenant may hold 10,000 datasets).
PageLimit = Annotated[int, Query(ge=1, le=1000, description="at most this many (a page)")]
PageOffset = Annotated[int, Query(ge=0, le=1_000_000_000, description="skip this many first")]


_JOB_FIELDS = tuple(f.name for f in fields(JobRecord))
#: JobRecord's fields that hold a dataclass (or None); every other field is a JSON scalar.
_JOB_NESTED = ("bottleneck", "measured_parameters", "loader")


def _record_dict(record: JobRecord) -> dict[str, Any]:
    """A JobRecord as JobOut's JSON object. Field by field, not `asdict`: asdict walks and copies
    every value recursively, a third of the handler's time on GET /v1/jobs/{id}."""
    out = {f: getattr(record, f) for f in _JOB_FIELDS}
    for f in _JOB_NESTED:
        if out[f] is not None:
            out[f] = asdict(out[f])
    access = record.access
    if isinstance(access, AccessPattern):  # JobOut.access: flat {"kind", "starting_percent", ...}
        flat = access.fields()
        out["access"] = {"kind": flat.pop("access"), **flat}
    return out


def _json(records: Any, status_code: int = 200) -> Response:
    """The hottest routes answer with their records serialised directly: the records are typed
    dataclasses matching the declared response model (OpenAPI), so validating them again per
    request would only cost time."""
    body = [_record_dict(r) for r in records] if isinstance(records, list) else _record_dict(records)
    return Response(json.dumps(body, separators=(",", ":")), status_code=status_code, media_type="application/json")


# The page may only run its own script and talk to this origin: no CDN, nothing inline.
_UI_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
                               " img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


#: /docs has no script, style or image: nothing may load.
_DOCS_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def api_docs_page(spec: dict[str, Any]) -> bytes:
    """The API's routes as a plain HTML table (method, path, summary, description), every value
    escaped, from the OpenAPI document; the document itself is linked (/openapi.json)."""
    from html import escape

    rows = []
    for path, ops in sorted((spec.get("paths") or {}).items()):
        for method, op in ops.items():
            rows.append(f"<tr><td>{escape(method.upper())}</td><td><code>{escape(path)}</code></td>"
                        f"<td>{escape(str(op.get('summary', '')))}</td><td>{escape(str(op.get('description', '')))}</td></tr>")
    info = spec.get("info") or {}
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>"
            f"{escape(str(info.get('title', 'API')))}</title></head><body><h1>{escape(str(info.get('title', 'API')))}</h1>"
            f"<p>{escape(str(info.get('description', '')))}</p><p>The machine-readable description: "
            "<a href=\"/openapi.json\">/openapi.json</a> (OpenAPI 3).</p><table><thead><tr><th>method</th><th>path</th>"
            "<th>summary</th><th>description</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></body></html>").encode()


@functools.cache
def _ui_file(name: str) -> bytes:
    return resources.files("scheduler.service.api").joinpath("ui", name).read_bytes()


#: Threads of an API worker that run the hot routes: 4 for reads (get and list jobs), 4 for
#: submissions. FastAPI runs a sync route on anyio's default pool of 40 threads; under load 40
#: threads contend for the GIL (SQLite releases it at every call), which cost 35% more CPU per
#: submission at 64 clients than 4 threads did: 3.1 against 2.3 ms, 460 against 710-760
#: submissions/s on 2 workers (2026-11-28, a script driving bench_api's silod). Reads and writes
#: have separate threads so submissions waiting on the database's write lock never hold the
#: threads a read needs; each pool is shared fairly between tenants (fair_pool.py). The other
#: routes run on a third fair pool (OTHER_THREADS), so a slow one (a forced round waits for the scheduling process;
#: a pod template goes to the Kubernetes API) never holds these threads.
HOT_THREADS = 4
#: Threads of an API worker for every other sync route (registrations, grants, credentials,
#: cluster views, the overview, metrics, health): one fair pool, so one tenant's burst of them
#: waits behind its own requests, not in front of everyone's (fair_pool.py).
OTHER_THREADS = 8


def _admin(who: Principal, what: str) -> None:
    if not who.is_admin:
        raise ForbiddenError(f"only an admin token may {what}")


def create_app(service: SchedulerService, tokens: TokenStore, run_loop: bool = True,
               max_body: int = DEFAULT_MAX_BODY,
               body_timeouts: tuple[float, float] = (BODY_IDLE_TIMEOUT_S, BODY_TOTAL_TIMEOUT_S),
               failures: FailedAuthLimiter | None = None) -> FastAPI:
    """The API over `service`. With run_loop, the scheduling loop runs for the app's lifetime.
    `failures`: the failed-token buckets (shared by the API workers of one server; default: this
    app's own)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if run_loop:
            service.start()
        try:
            yield
        finally:
            if run_loop:
                service.stop()

    app = FastAPI(
        title="silod scheduler",
        version="1",
        description="Co-schedules GPUs, dataset cache and remote IO. Authenticate with `Authorization: Bearer TOKEN`.",
        lifespan=lifespan,
        # No 307 from /v1/jobs/ to /v1/jobs: Starlette builds its Location from the Host header
        # (Host: evil.example sent clients there). A path is served as written or is a 404.
        redirect_slashes=False,
        # FastAPI's /docs and /redoc load Swagger UI and ReDoc from a CDN at floating versions, as
        # scripts in this origin, where tokens are typed (issue 47). /docs is instead a page
        # rendered here from the OpenAPI document, with no script at all (api_docs_page);
        # /openapi.json is unchanged, for any tool that renders it.
        docs_url=None,
        redoc_url=None,
    )
    # Bodies are parsed once, with bounds on depth, keys, list items and values, before any
    # model validates them (http_guard/json_limits.py); set before the routes are declared.
    app.router.route_class = limited_json_route(BODY_LIMITS)
    app.state.service = service
    app.state.tokens = tokens
    app.add_middleware(RequestGuard, tokens=tokens, max_body=max_body,
                       agent_node=service.config.agent_node if service is not None else None,
                       body_timeouts=body_timeouts,
                       reviewer=service.config.agent_reviewer if service is not None else None,
                       failures=failures)
    registries = {per_job: make_registry(service, per_job) for per_job in (False, True)} if service is not None else None
    reads, writes = FairThreadPool(HOT_THREADS), FairThreadPool(HOT_THREADS)
    others = FairThreadPool(OTHER_THREADS)

    def fair(fn: Callable[..., Any]) -> Callable[..., Any]:
        """Run a sync route on `others`, shared fairly between tenants (anonymous callers: one
        tenant), not first come, first served on anyio's 40 threads (issue 47)."""

        @functools.wraps(fn)  # FastAPI reads the route's parameters through __wrapped__
        async def run(*args: Any, **kwargs: Any) -> Any:
            who = kwargs.get("who")
            tenant = who.user if isinstance(who, Principal) else ""
            return await others.run(tenant, functools.partial(fn, *args, **kwargs))

        return run
    catalogue = service.catalogue if service is not None else None
    consumption = (ConsumptionStore(service.sessions, getattr(service, "_write_lock", None))
                   if service is not None else None)

    @app.exception_handler(ServiceError)
    async def _service_error(_req: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": _bounded_detail(str(exc)), "field": exc.field})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the offending input, which may be NaN/Infinity (not JSON:
        # the error response itself would fail with a 500) or megabytes long. Keep loc and msg.
        # At most MAX_ERRORS errors are answered: a client needs the first few to fix its body.
        all_errors = exc.errors()
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in all_errors[:MAX_ERRORS]]
        if len(all_errors) > MAX_ERRORS:
            errors.append({"loc": [], "msg": f"and {len(all_errors) - MAX_ERRORS} more errors", "type": "truncated"})
        field = next((e["loc"][-1] for e in errors if len(e["loc"]) > 1), None)
        return JSONResponse(status_code=422, content={"detail": errors, "field": field})

    @app.exception_handler(BodyShapeError)
    async def _body_shape_error(_req: Request, exc: BodyShapeError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail, "field": None})

    @app.exception_handler(UserError)
    async def _user_error(_req: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": _bounded_detail(str(exc)), "field": None})

    @app.exception_handler(Exception)
    async def _internal_error(_req: Request, exc: Exception) -> JSONResponse:
        # A bug: logged with its traceback here, answered without one (no internals leak).
        log.error("unhandled error", exc_info=exc)
        return JSONResponse(status_code=500, content={"detail": "internal error", "field": None})

    def _database_answers() -> bool:
        with service.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True

    @app.exception_handler(SQLAlchemyError)
    async def _database_error(_req: Request, exc: SQLAlchemyError) -> JSONResponse:
        # An unreachable database is the one documented 5xx: JSON, with Retry-After. The pool
        # pings connections before use, so the service recovers by itself when it is back.
        if await anyio.to_thread.run_sync(is_database_outage, exc, _database_answers):
            log.warning("database unavailable: %s", type(exc).__name__)
            return JSONResponse(status_code=503, content=OUTAGE_BODY, headers={"Retry-After": str(RETRY_AFTER_S)})
        log.error("database error", exc_info=exc)
        return JSONResponse(status_code=500, content={"detail": "internal error", "field": None})

    # ---- health and metrics (no token: probes and Prometheus scrape without one)

    @app.get("/healthz", response_model=HealthOut, tags=["ops"])
    @fair
    def healthz() -> HealthOut | JSONResponse:
        try:
            with service.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # a health check reports, it does not raise; nor does it echo internals
            log.warning("health check: database unavailable: %s", type(exc).__name__)
            return JSONResponse(status_code=503, content={"status": "unhealthy", "database": "unavailable"},
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return HealthOut(status="ok", database="ok")

    @app.get("/readyz", response_model=ReadyOut, tags=["ops"],
             responses={503: {"model": ReadyOut, "description": "serving, but nothing schedules"}})
    @fair
    def readyz() -> ReadyOut | JSONResponse:
        """Ready: this API answers and a live process holds the scheduling lease (`/healthz` only
        says the API and its database answer). 503 while no process schedules, e.g. for the
        seconds after the scheduling process died until its replacement takes over."""
        from scheduler.service.control import lease_status

        try:
            why = lease_status(service.sessions)
        except Exception as exc:
            log.warning("readiness check: database unavailable: %s", type(exc).__name__)
            why = "the database is unavailable"
        if why is not None:
            return JSONResponse(status_code=503, content={"status": "not ready", "scheduling": why},
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return ReadyOut(status="ready", scheduling="ok")

    @app.get("/metrics", tags=["ops"], response_class=Response)
    @fair
    def metrics(request: Request) -> Response:
        """Cluster totals; with the metrics token or an admin's (RequestGuard lets no other token
        through here), every per-job and per-dataset series too: they name tenants and jobs."""
        per_job = request.scope.get("state", {}).get("principal") is not None
        body, content_type = metrics_response(registries[per_job])
        return Response(content=body, media_type=content_type)

    @app.get("/docs", include_in_schema=False)
    @fair
    def docs() -> Response:
        return Response(api_docs_page(app.openapi()), media_type="text/html; charset=utf-8", headers=_DOCS_HEADERS)

    # ---- the web view (static files from the package; the data comes from /v1/overview)

    @app.get("/ui", include_in_schema=False)
    @app.get("/ui/", include_in_schema=False)
    @fair
    def ui_page() -> Response:
        return Response(_ui_file("index.html"), media_type="text/html; charset=utf-8", headers=_UI_HEADERS)

    @app.get("/ui/ui.js", include_in_schema=False)
    @fair
    def ui_script() -> Response:
        return Response(_ui_file("ui.js"), media_type="text/javascript; charset=utf-8", headers=_UI_HEADERS)

    @app.get("/ui/ui.css", include_in_schema=False)
    @fair
    def ui_style() -> Response:
        return Response(_ui_file("ui.css"), media_type="text/css; charset=utf-8", headers=_UI_HEADERS)

    @app.get("/v1/overview", response_model=Overview, responses=_ERRORS, tags=["cluster"])
    @fair
    def overview(who: Who) -> Overview:
        """The queue (each waiting job's position among every tenant's waiting jobs and why it
        waits), the running jobs (allocation, measured hit ratio and throughput, what bounds
        them), the datasets (allocated vs cached) and recent utilisation. Yours only, unless admin."""
        return service.overview(who)

    # ---- tokens (admin)

    @app.post("/v1/tokens", response_model=NewTokenOut, status_code=201, responses=_ERRORS, tags=["tokens"])
    @fair
    def create_token(body: TokenIn, who: Who) -> NewTokenOut:
        """Admin: a new token for a tenant; the plain token is in this answer only."""
        _admin(who, "create tokens")
        if body.owner.lower() == "admin" and not body.admin:
            # As in the tokens file: 'admin' is the admin's name; a non-admin token owned by it
            # would act for objects the admin created without being the admin (and 'ADMIN' would
            # pass for it in every listing).
            raise ServiceError(f"owner {body.owner[:64]!r} is reserved for admin tokens (in any case); give the tenant's name",
                               field="owner")
        now = time.time()
        expires = None if body.expires_in_s is None else now + body.expires_in_s
        record, token = tokens.create(body.owner, is_admin=body.admin, expires_at=expires, label=body.label, now=now)
        return NewTokenOut(**TokenOut.model_validate(record).model_dump(), token=token)

    @app.get("/v1/tokens", response_model=list[TokenOut], responses=_ERRORS, tags=["tokens"])
    @fair
    def list_tokens(who: Who) -> list[TokenOut]:
        _admin(who, "list tokens")
        return [TokenOut.model_validate(t) for t in tokens.list()]

    @app.delete("/v1/tokens/{token_id}", response_model=TokenOut, responses=_ERRORS, tags=["tokens"])
    @fair
    def revoke_token(token_id: Annotated[int, Path(ge=1, le=2**62)], who: Who) -> TokenOut:
        """Admin: revoke a token; it stops working within the token cache's TTL (2 s) everywhere."""
        _admin(who, "revoke tokens")
        return TokenOut.model_validate(tokens.revoke(token_id))

    # ---- quotas

    @app.get("/v1/quotas/{tenant}", response_model=QuotaOut, responses=_ERRORS, tags=["quotas"])
    @fair
    def get_quota(tenant: Annotated[str, Path(max_length=64)], who: Who) -> QuotaOut:
        if tenant != who.user and not who.is_admin:
            raise NotFoundError(f"no quota visible for {tenant!r}", field="tenant")
        q = catalogue.quota(tenant)
        return QuotaOut(tenant=tenant, **{k: getattr(q, k) for k in TenantQuota.FIELDS})

    @app.put("/v1/quotas/{tenant}", response_model=QuotaOut, responses=_ERRORS, tags=["quotas"])
    @fair
    def set_quota(tenant: Annotated[str, Path(max_length=64)], body: QuotaIn, who: Who) -> QuotaOut:
        """Admin: a tenant's limits (omitted or null: no limit)."""
        check_tenant(tenant, "tenant")
        q = catalogue.set_quota(who, tenant, TenantQuota(**{k: getattr(body, k) for k in TenantQuota.FIELDS}))
        return QuotaOut(tenant=tenant, **{k: getattr(q, k) for k in TenantQuota.FIELDS})

    # ---- credentials (per tenant; the secret is never returned)

    @app.post("/v1/credentials", response_model=CredentialOut, status_code=201, responses=_ERRORS, tags=["credentials"])
    @fair
    def add_credential(body: CredentialIn, who: Who) -> CredentialOut:
        req = NewCredential(body.name, body.access_key_id, body.secret_access_key, body.endpoint_url, body.region, body.kind)
        return CredentialOut.model_validate(catalogue.add_credential(who, req))

    @app.get("/v1/credentials", response_model=list[CredentialOut], responses=_ERRORS, tags=["credentials"])
    @fair
    def list_credentials(who: Who, limit: PageLimit = 1000, offset: PageOffset = 0) -> list[CredentialOut]:
        return [CredentialOut.model_validate(c) for c in catalogue.list_credentials(who, limit, offset)]

    @app.delete("/v1/credentials/{name}", status_code=204, responses=_ERRORS, tags=["credentials"])
    @fair
    def delete_credential(name: str, who: Who) -> Response:
        catalogue.delete_credential(who, name)
        return Response(status_code=204)

    # ---- datasets

    @app.post("/v1/datasets", response_model=DatasetOut, status_code=201, responses=_ERRORS, tags=["datasets"])
    @fair
    def register_dataset(body: DatasetIn, who: Who, response: Response) -> DatasetOut:
        record, created = catalogue.register_dataset(
            who, NewDataset(body.name, body.uri, body.size, body.item_count, body.credential))
        if not created:
            response.status_code = 200
        return DatasetOut.model_validate(record)

    @app.get("/v1/datasets", response_model=list[DatasetOut], responses=_ERRORS, tags=["datasets"])
    @fair
    def list_datasets(who: Who, limit: PageLimit = 1000, offset: PageOffset = 0) -> list[DatasetOut]:
        """Yours and those shared with you (the admin: all), a page at a time in (owner, name) order."""
        return [DatasetOut.model_validate(d) for d in catalogue.list_datasets(who, limit, offset)]

    @app.get("/v1/datasets/{name}", response_model=DatasetOut, responses=_ERRORS, tags=["datasets"])
    @fair
    def get_dataset(name: str, who: Who, owner: OwnerQ = None) -> DatasetOut:
        return DatasetOut.model_validate(catalogue.get_dataset(who, name, owner))

    @app.get("/v1/datasets/{name}/source-credential", responses=_ERRORS, tags=["datasets"])
    @fair
    def dataset_source_credential(name: str, who: Who,
                                  owner: Annotated[str, Query(max_length=64, description="the tenant whose pods mount it")]
                                  ) -> dict[str, Any]:
        """Node agents only (`--node-agent USER`): the credential a node's `silod mount` of this
        dataset reads with, `{"credential": null}` when it is read anonymously."""
        cred = catalogue.dataset_source_credential(who, name, owner)
        if cred is None:
            return {"credential": None}
        return {"credential": {"access_key_id": cred.access_key_id, "secret_access_key": cred.secret_access_key,
                               "endpoint_url": cred.endpoint_url, "region": cred.region}}

    @app.put("/v1/datasets/{name}/grants/{tenant}", response_model=DatasetOut, responses=_ERRORS, tags=["datasets"])
    @fair
    def grant_dataset(name: str, tenant: Annotated[str, Path(max_length=64)], who: Who, owner: OwnerQ = None) -> DatasetOut:
        """Share your dataset with another tenant: its jobs may read it (with your credential, into the same cache)."""
        return DatasetOut.model_validate(catalogue.grant(who, name, tenant, owner))

    @app.delete("/v1/datasets/{name}/grants/{tenant}", response_model=DatasetOut, responses=_ERRORS, tags=["datasets"])
    @fair
    def revoke_dataset_grant(name: str, tenant: Annotated[str, Path(max_length=64)], who: Who, owner: OwnerQ = None) -> DatasetOut:
        return DatasetOut.model_validate(catalogue.revoke_grant(who, name, tenant, owner))

    # ---- jobs

    @app.post("/v1/jobs", response_model=JobOut, status_code=201, responses=_ERRORS, tags=["jobs"])
    async def submit_job(
        body: JobIn, who: Who, response: Response,
        idempotency_key: Annotated[str | None, Header(max_length=128, pattern=r"^[\x21-\x7e]+$",
                                                      description="retry-safe: the same key and body return the same job")] = None,
    ) -> Any:
        if body.priority > 0 and not who.is_admin:
            # Priority orders admission (scheduler/core/planner.py): raising it is the operator's call.
            raise ForbiddenError("only the admin may give a job a priority above 0; users may lower theirs")
        req = NewJob(
            name=body.name, gpus=body.gpus, dataset=body.dataset, epochs=body.epochs, steps=body.steps,
            step_bytes=body.step_bytes, ideal_throughput=body.ideal_throughput, model=body.model,
            priority=body.priority, dataset_owner=body.dataset_owner,
            access=body.access.pattern() if body.access is not None else EPOCH,
            pipeline=body.pipeline(),
            pod_template=body.pod_template.to_template() if body.pod_template else None,
            program=body.program.to_program() if body.program else None,
            loader=body.loader.to_loader() if body.loader else None,
        )
        if req.pod_template is not None:  # creates the job's workload on the Kubernetes API: the default pool
            record, created = await anyio.to_thread.run_sync(catalogue.submit_job, who, req, idempotency_key)
        else:
            record, created = await writes.run(who.user, catalogue.submit_job, who, req, idempotency_key)
        return _json(record, 201 if created else 200)

    @app.get("/v1/jobs", response_model=list[JobOut], responses=_ERRORS, tags=["jobs"])
    async def list_jobs(
        who: Who,
        state: Annotated[str | None, Query(max_length=32, description="a state, 'active' (queued and running) or 'ended' (finished, failed and cancelled, newest first)")] = None,
        owner: Annotated[str | None, Query(max_length=128, description="admin only: one tenant's jobs")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
        offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    ) -> Any:
        # The records go straight to FastAPI's response validation (from_attributes): validating
        # them here as well would do the work twice on the hottest endpoint.
        return await reads.run(who.user, lambda: _json(catalogue.list_jobs(who, state, owner, limit, offset)))

    def read_job(job_id: str, who: Principal) -> Response:
        # One pooled connection (and one read transaction) for the job and its consumption.
        with service.engine.connect() as c:
            record = catalogue.get_job(who, job_id, c)
            m = consumption.measured([record.id], c).get(record.id)
        body = _record_dict(record)
        body["measured"] = asdict(m) if m is not None else None
        return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")

    @app.get("/v1/jobs/{job_id}", response_model=JobOut, responses=_ERRORS, tags=["jobs"])
    async def get_job(job_id: str, who: Who) -> Any:
        return await reads.run(who.user, read_job, job_id, who)

    @app.get("/v1/jobs/{job_id}/allocations", response_model=list[ChangeOut], responses=_ERRORS, tags=["jobs"])
    @fair
    def job_allocation_history(
        job_id: str, who: Who, limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> list[ChangeOut]:
        """The job's allocation over time, newest first: each change of its GPUs, GPU share, remote
        IO cap and cores, with the round that made it. Your own jobs only (the admin: any)."""
        return [ChangeOut.model_validate(c) for c in service.job_allocation_history(who, job_id, limit)]

    @app.post("/v1/jobs/{job_id}/report", response_model=MeasuredParamsOut, status_code=202, responses=_ERRORS,
              tags=["jobs"])
    @fair
    def report_job(job_id: str, body: ClientReportIn, who: Who) -> Any:
        """A running job's own figures: GPU compute time per step and source bytes per step. From the
        job's owner, the admin, or the node agent bound to a node one of its pods runs on. Only the
        latest report is kept; it can lower the f* planning uses but never raise it above what
        the data plane measured (docs/input-pipeline.md, "Measured, self-correcting parameters")."""
        pk = parse_job_id(job_id)
        if pk is None:
            raise NotFoundError(f"no job with id {job_id!r}", field="job_id")
        with service.sessions() as s:
            job = s.get(Job, pk)
            node = service.config.agent_node(who.user)
            on_node = node is not None and s.scalar(
                select(WorkloadPod.pod_uid).where(WorkloadPod.job_id == pk, WorkloadPod.node == node).limit(1)) is not None
            if job is None or not (who.is_admin or job.owner == who.user or on_node):
                raise NotFoundError(f"no job with id {job_id!r}", field="job_id")
            state, declared, declared_cpu = JobState(job.state), job.ideal_throughput, job.cpu_rate
        if state != JobState.RUNNING:
            raise ConflictError(f"job {job_id} is {state.value}; only a running job reports its step time",
                                field="job_id")
        now = time.time()
        store = MeasurementStore(service.sessions, getattr(service, "_write_lock", None))
        store.record_client_report(pk, body.step_seconds, body.batch_bytes, who.user, now)
        params = params_of(store.rows([pk]).get(pk), declared, declared_cpu, now)
        return MeasuredParamsOut.model_validate(asdict(params))

    # ---- node agents

    @app.post("/v1/agents/{node}/consumption", response_model=ConsumptionOut, responses=_ERRORS, tags=["agents"])
    @fair
    def report_consumption(node: Annotated[str, Path(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")],
                           body: ConsumptionIn, who: Who) -> ConsumptionOut:
        """A node agent's cumulative per-pod read counters, and the bytes its cache directory can
        hold. Only the agent whose token is bound to `node` (`silod serve --node-agent USER=NODE`,
        or an agent pod's own token on that node) may call it; counters only ever rise."""
        bound = (who.node or service.config.agent_node(who.user)) if not who.is_admin else None
        if bound is None:
            raise ForbiddenError("only a node agent's token bound to a node (silod serve --node-agent USER=NODE) may"
                                 " report consumption")
        if bound != node:
            raise ForbiddenError(f"this agent token is bound to node {bound}, not {node}")
        result = consumption.record_report(node, who.user, [PodReport(**p.model_dump()) for p in body.pods])
        if body.cache_disk_bytes is not None:
            consumption.record_cache_disk(node, who.user, body.cache_disk_bytes)
        return ConsumptionOut(accepted=result.accepted,
                              ignored=[{"pod_uid": i.pod_uid, "reason": i.reason} for i in result.ignored])

    @app.delete("/v1/jobs/{job_id}", response_model=JobOut, responses=_ERRORS, tags=["jobs"])
    @fair
    def cancel_job(job_id: str, who: Who) -> Any:
        return catalogue.cancel_job(who, job_id)

    # ---- cluster, allocations, policy, rounds

    @app.get("/v1/cluster", response_model=ClusterOut, responses=_ERRORS, tags=["cluster"])
    @fair
    def cluster(who: Who) -> ClusterOut:
        c = service.cluster()
        return ClusterOut(
            backend=c.backend,
            nodes=[NodeOut(name=n.name, gpus=n.gpus, cache=n.cache, labels=dict(n.labels), cache_source=n.cache_source)
                   for n in c.description.nodes],
            gpus=UsageOut(total=c.capacity.gpus, used=c.gpus_used),
            cache=UsageOut(total=c.capacity.cache, used=c.cache_used),
            remote_io=UsageOut(total=c.capacity.remote_io, used=c.remote_io_used),
            jobs=dict(c.jobs_by_state),
            # The data manager's address and the push errors (which name other tenants' datasets)
            # are the operator's: a tenant learns only whether the last push failed.
            datamanager=c.datamanager if who.is_admin else None,
            last_round_time=c.last_round_time,
            last_push_error=(c.last_push_error if who.is_admin or c.last_push_error is None
                             else "the last push to the data manager failed (details for the admin)"),
        )

    @app.get("/v1/allocations", response_model=AllocationsOut, responses=_ERRORS, tags=["cluster"])
    @fair
    def allocations(who: Who) -> AllocationsOut:
        return AllocationsOut.model_validate(service.allocations(who))

    @app.get("/v1/allocations/history", response_model=list[ChangeOut], responses=_ERRORS, tags=["cluster"])
    @fair
    def allocation_history(
        who: Who,
        subject: Annotated[str | None, Query(max_length=128, description="a job id or dataset name")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> list[ChangeOut]:
        return [ChangeOut.model_validate(c) for c in service.allocation_history(who, subject, limit)]

    @app.get("/v1/policy", response_model=PolicyOut, responses=_ERRORS, tags=["policy"])
    @fair
    def get_policy(who: Who) -> PolicyOut:
        return PolicyOut(name=service.policy_name, available=available_policies())

    @app.put("/v1/policy", response_model=PolicyOut, responses=_ERRORS, tags=["policy"])
    @fair
    def set_policy(body: PolicyIn, who: Who) -> PolicyOut:
        return PolicyOut(name=service.set_policy(who, body.name), available=available_policies())

    @app.post("/v1/rounds", response_model=RoundOut, responses=_ERRORS, tags=["policy"])
    @fair
    def run_round(who: Who) -> RoundOut:
        """Admin: run a scheduling round now (otherwise rounds run on the timer and on events)."""
        if not who.is_admin:
            raise ForbiddenError("only the admin may force a round")
        r = service.run_round("api")
        return RoundOut(
            round_id=r.round_id, reason=r.reason, active=r.active, running=list(r.running),
            started=list(r.started), stopped=list(r.stopped), changes=r.changes, duration_s=r.duration_s,
        )

    return app


def openapi_document() -> dict:
    """The OpenAPI document without a running service (docs generation, schema-driven tests):
    the routes only touch the service when a request arrives, so none is needed here."""
    return create_app(None, TokenStore(None, b"openapi-document-key"), run_loop=False).openapi()  # type: ignore[arg-type]
