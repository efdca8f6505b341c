"""FastAPI application: routes translate HTTP to `SchedulerService` calls and back, nothing more.

Every error a client can cause is a 4xx with a JSON body `{"detail": ..., "field": ...}` (or
FastAPI's validation list, which names the field in `loc`); an unexpected exception is a 500
that the tests (including a schemathesis fuzzer) treat as a bug.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import text

from estimator.errors import UserError
from policies.registry import available_policies
from scheduler.api.auth import TokenStore
from scheduler.api.metrics import make_registry, metrics_response
from scheduler.api.schemas import (
    AllocationsOut,
    ChangeOut,
    ClusterOut,
    DatasetIn,
    DatasetOut,
    ErrorOut,
    HealthOut,
    JobIn,
    JobOut,
    NodeOut,
    PolicyIn,
    PolicyOut,
    RoundOut,
    UsageOut,
)
from scheduler.service import ForbiddenError, NewDataset, NewJob, Principal, SchedulerService, ServiceError

log = logging.getLogger("silod.api")

_bearer = HTTPBearer(auto_error=False, description="user token (from --tokens FILE) or the admin token")

_ERRORS = {
    401: {"model": ErrorOut, "description": "missing or invalid bearer token"},
    403: {"model": ErrorOut, "description": "admin only"},
    404: {"model": ErrorOut, "description": "not found (or another user's job)"},
    409: {"model": ErrorOut, "description": "conflict with the current state"},
}


def principal(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    """The caller, from the bearer token; 401 without a valid one."""
    tokens: TokenStore = request.app.state.tokens
    who = tokens.authenticate(creds.credentials) if creds is not None else None
    if who is None:
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid bearer token (Authorization: Bearer TOKEN)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return who


Who = Annotated[Principal, Depends(principal)]


def create_app(service: SchedulerService, tokens: TokenStore, run_loop: bool = True) -> FastAPI:
    """The API over `service`. With run_loop, the scheduling loop runs for the app's lifetime."""

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
    )
    app.state.service = service
    app.state.tokens = tokens
    registry = make_registry(service)


    @app.exception_handler(ServiceError)
    async def _service_error(_req: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": str(exc), "field": exc.field})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the offending input, which may be NaN/Infinity (not JSON:
        # the error response itself would fail with a 500) or megabytes long. Keep loc and msg.
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        field = next((e["loc"][-1] for e in errors if len(e["loc"]) > 1), None)
        return JSONResponse(status_code=422, content={"detail": errors, "field": field})

    @app.exception_handler(UserError)
    async def _user_error(_req: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(exc), "field": None})

    # ---- health and metrics (no token: probes and Prometheus scrape without one)

    @app.get("/healthz", response_model=HealthOut, tags=["ops"])
    def healthz() -> HealthOut | JSONResponse:
        try:
            with service.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # a health check reports, it does not raise
            return JSONResponse(status_code=503, content={"status": "unhealthy", "database": str(exc)[:200]})
        return HealthOut(status="ok", database="ok")

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def metrics() -> Response:
        body, content_type = metrics_response(registry)
        return Response(content=body, media_type=content_type)

    # ---- datasets

    @app.post("/v1/datasets", response_model=DatasetOut, status_code=201, responses=_ERRORS, tags=["datasets"])
    def register_dataset(body: DatasetIn, who: Who, response: Response) -> DatasetOut:
        record, created = service.register_dataset(who, NewDataset(body.name, body.uri, body.size, body.item_count))
        if not created:
            response.status_code = 200
        return DatasetOut.model_validate(record)

    @app.get("/v1/datasets", response_model=list[DatasetOut], responses=_ERRORS, tags=["datasets"])
    def list_datasets(who: Who) -> list[DatasetOut]:
        return [DatasetOut.model_validate(d) for d in service.list_datasets()]

    @app.get("/v1/datasets/{name}", response_model=DatasetOut, responses=_ERRORS, tags=["datasets"])
    def get_dataset(name: str, who: Who) -> DatasetOut:
        return DatasetOut.model_validate(service.get_dataset(name))

    # ---- jobs

    @app.post("/v1/jobs", response_model=JobOut, status_code=201, responses=_ERRORS, tags=["jobs"])
    def submit_job(body: JobIn, who: Who) -> JobOut:
        if body.priority > 0 and not who.is_admin:
            # Priority orders admission (scheduler/core.py): raising it is the operator's call.
            raise ForbiddenError("only the admin may give a job a priority above 0; users may lower theirs")
        req = NewJob(
            name=body.name, gpus=body.gpus, dataset=body.dataset, epochs=body.epochs, steps=body.steps,
            step_bytes=body.step_bytes, ideal_throughput=body.ideal_throughput, model=body.model,
            priority=body.priority, pod_template=body.pod_template.to_template() if body.pod_template else None,
        )
        return JobOut.model_validate(service.submit_job(who, req))

    @app.get("/v1/jobs", response_model=list[JobOut], responses=_ERRORS, tags=["jobs"])
    def list_jobs(
        who: Who,
        state: Annotated[str | None, Query(max_length=32, description="a state, or 'active'")] = None,
        owner: Annotated[str | None, Query(max_length=128, description="admin only: one user's jobs")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
        offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    ) -> Any:
        # The records go straight to FastAPI's response validation (from_attributes): validating
        # them here as well would do the work twice on the hottest endpoint.
        return service.list_jobs(who, state, owner, limit, offset)

    @app.get("/v1/jobs/{job_id}", response_model=JobOut, responses=_ERRORS, tags=["jobs"])
    def get_job(job_id: str, who: Who) -> JobOut:
        return JobOut.model_validate(service.get_job(who, job_id))

    @app.delete("/v1/jobs/{job_id}", response_model=JobOut, responses=_ERRORS, tags=["jobs"])
    def cancel_job(job_id: str, who: Who) -> JobOut:
        return JobOut.model_validate(service.cancel_job(who, job_id))

    # ---- cluster, allocations, policy, rounds

    @app.get("/v1/cluster", response_model=ClusterOut, responses=_ERRORS, tags=["cluster"])
    def cluster(who: Who) -> ClusterOut:
        c = service.cluster()
        return ClusterOut(
            backend=c.backend,
            nodes=[NodeOut(name=n.name, gpus=n.gpus, cache=n.cache, labels=dict(n.labels)) for n in c.description.nodes],
            gpus=UsageOut(total=c.capacity.gpus, used=c.gpus_used),
            cache=UsageOut(total=c.capacity.cache, used=c.cache_used),
            remote_io=UsageOut(total=c.capacity.remote_io, used=c.remote_io_used),
            jobs=dict(c.jobs_by_state),
            datamanager=c.datamanager,
            last_round_time=c.last_round_time,
            last_push_error=c.last_push_error,
        )

    @app.get("/v1/allocations", response_model=AllocationsOut, responses=_ERRORS, tags=["cluster"])
    def allocations(who: Who) -> AllocationsOut:
        return AllocationsOut.model_validate(service.allocations(who))

    @app.get("/v1/allocations/history", response_model=list[ChangeOut], responses=_ERRORS, tags=["cluster"])
    def allocation_history(
        who: Who,
        subject: Annotated[str | None, Query(max_length=128, description="a job id or dataset name")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> list[ChangeOut]:
        return [ChangeOut.model_validate(c) for c in service.allocation_history(who, subject, limit)]

    @app.get("/v1/policy", response_model=PolicyOut, responses=_ERRORS, tags=["policy"])
    def get_policy(who: Who) -> PolicyOut:
        return PolicyOut(name=service.policy_name, available=available_policies())

    @app.put("/v1/policy", response_model=PolicyOut, responses=_ERRORS, tags=["policy"])
    def set_policy(body: PolicyIn, who: Who) -> PolicyOut:
        return PolicyOut(name=service.set_policy(who, body.name), available=available_policies())

    @app.post("/v1/rounds", response_model=RoundOut, responses=_ERRORS, tags=["policy"])
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
    return create_app(None, TokenStore(), run_loop=False).openapi()  # type: ignore[arg-type]
