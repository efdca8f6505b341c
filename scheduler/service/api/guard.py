"""The API's front door, as raw ASGI middleware: who is calling, then how much they may send,
before any route, body parsing or validation runs.

Order matters (Kubernetes' API server does the same): authentication first, from the
`Authorization` header alone, so an anonymous client cannot make the server read, buffer or
parse a single byte of its body (401); then a job's report token may call its job's report route
alone (403); then, for the node agents' paths, whether the token is bound to that node (403); then the
body cap, from `Content-Length` when given (413
at once) and by counting while the body streams in otherwise (413 as soon as the cap is
passed; nothing beyond it is held); a body that stalls is a 408 (http_guard/timeouts.py).
Database trouble while looking a token up is the same JSON
503 + Retry-After as everywhere else.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import anyio

from http_guard import BAD_PATH_DETAIL, BodyTooLarge, capped_receive, has_control_character, send_json
from http_guard.agent_identity import ReviewUnavailable, looks_like_jwt
from http_guard.auth_limit import FailedAuthLimiter, retry_after_header
from http_guard.body import Receive, Send
from http_guard.timeouts import BODY_IDLE_TIMEOUT_S, BODY_TOTAL_TIMEOUT_S, BodyTimeout, timed_receive

from scheduler.service.api.auth import TokenStore
from scheduler.service.types import Principal

log = logging.getLogger("silod.api")

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: a job or dataset is a few hundred bytes
RETRY_AFTER_S = 5
LOOKUP_THREADS = 2  # threads of a worker that look tokens up (a cache miss: one indexed read)

# Paths anyone may call: probes, the API description. /metrics is here unless a metrics token
# is configured.
# /ui and its script are the web view's static page: it holds no data and asks for a token, then
# calls the authenticated JSON API (GET /v1/overview) with it.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json",
                          "/ui", "/ui/", "/ui/ui.js", "/ui/ui.css"})

AGENT_PATH = "/v1/agents/"  # node agents' reports: authorised by node before the body is read
# What an agent pod's own token (a reviewed service-account token) may call: its dataset look-ups
# and its node's reports. It is no tenant: it registers, submits and lists nothing.
_REVIEWED_AGENT_ROUTES = re.compile(r"^(GET /v1/datasets/[^/]+(/source-credential)?|POST /v1/agents/[^/]+/consumption)\Z")
# The admin's routes: any other token is refused here, before its body is read or parsed (the
# routes check again; this only spares the server a tenant's body it would throw away).
_ADMIN_ROUTES = re.compile(r"^(POST /v1/tokens|GET /v1/tokens|DELETE /v1/tokens/[^/]+|PUT /v1/quotas/[^/]+"
                           r"|PUT /v1/policy|POST /v1/rounds)$")

Scope = dict[str, Any]


# SQLite's primary result codes that mean "the database cannot serve now" (another writer holds
# it, the disk or file is gone or full), as opposed to SQLITE_ERROR & co., which concern the
# statement (e.g. "integer overflow" from a SUM): https://sqlite.org/rescode.html
_SQLITE_TRANSIENT = frozenset({5, 6, 7, 10, 13, 14, 15})  # BUSY LOCKED NOMEM IOERR FULL CANTOPEN PROTOCOL


def is_database_outage(exc: BaseException, probe: Callable[[], bool] | None = None) -> bool:
    """A database that cannot be reached (connection refused, dropped, pool exhausted, busy), as
    opposed to an error in one query, which answers that request alone: calling that an outage
    told clients to retry forever (a permanent 503 while /healthz said ok).

    `probe()` says whether the database answers now (SELECT 1); it decides the cases the
    driver's error does not (an OperationalError without a connection-level sign)."""
    from sqlalchemy.exc import DBAPIError, OperationalError, TimeoutError as PoolTimeout

    if isinstance(exc, PoolTimeout):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in _SQLITE_TRANSIENT
    if probe is None:
        return True
    try:
        return not probe()
    except Exception:
        return True


OUTAGE_BODY = {"detail": "the database is unavailable; retry later", "field": None}
OUTAGE_HEADERS = [(b"retry-after", str(RETRY_AFTER_S).encode())]
# What a token lookup answers besides a principal or None: the client's failure budget ran out
# while it waited for a lookup thread (429, the token unchecked); or None, already counted.
LIMITED, COUNTED_FAILURE = object(), object()


class RequestGuard:
    def __init__(self, app: Any, tokens: TokenStore, max_body: int = DEFAULT_MAX_BODY,
                 agent_node: Callable[[str], str | None] | None = None,
                 body_timeouts: tuple[float, float] = (BODY_IDLE_TIMEOUT_S, BODY_TOTAL_TIMEOUT_S),
                 reviewer: Any = None, failures: FailedAuthLimiter | None = None):
        self.app = app
        self.body_timeouts = body_timeouts  # (idle, total) seconds: a stalled body is a 408
        self.tokens = tokens
        self.max_body = max_body
        # user -> the node its token is bound to (node agents): /v1/agents/{node}/... is theirs
        # alone, refused (403) before a byte of the body is read.
        self.agent_node = agent_node or (lambda _user: None)
        # Agent pods' service-account tokens (http_guard/agent_identity.py): asked of the API
        # server only for a JWT no static token matched, so other callers' path is unchanged.
        self.reviewer = reviewer
        # Token look-ups on threads of their own: every request waits for its look-up, so one
        # stuck behind slow routes on the shared default pool would stall the whole API.
        self._lookups: list[anyio.CapacityLimiter] = []  # made in the worker's event loop, at first use
        # Failed token checks per client network (http_guard/auth_limit.py): guessing is slowed
        # to a couple a second, and a guess made past the limit is not even checked. `silod serve`
        # hands every API worker the same table, so the bound is the server's, not a worker's.
        self.failures = failures if failures is not None else FailedAuthLimiter()

    @staticmethod
    async def _too_many(send: Send, wait: float) -> None:
        await send_json(send, 429, {"detail": "too many requests with an invalid token from your address;"
                                    " retry later with a valid one", "field": None}, retry_after_header(wait))

    def _public(self, path: str, headers: dict[bytes, bytes]) -> bool:
        # /metrics without SILOD_METRICS_TOKEN: the cluster totals need no token; a token asks for
        # the per-job series and is checked like any other (the admin's or the metrics token).
        return path in PUBLIC_PATHS or (path == "/metrics" and not self.tokens.protects_metrics
                                        and b"authorization" not in headers)

    async def _principal(self, token: str, client: str | None) -> Principal | None | object:
        """The token's principal, None, or LIMITED (the client's failures ran out while it waited)."""
        hit, who = self.tokens.cached(token)
        if hit:
            return who
        # A cache miss reads the database: off the event loop, one thread hop per token per TTL.
        if not self._lookups:
            self._lookups.append(anyio.CapacityLimiter(LOOKUP_THREADS))
        return await anyio.to_thread.run_sync(self._lookup, token, client, limiter=self._lookups[0])

    def _lookup(self, token: str, client: str | None) -> Principal | None | object:
        # The failure budget is checked again right before the token is, and a failure counted
        # before the thread is free: 64 guesses arriving at once all passed the check made on
        # arrival, so at most LOOKUP_THREADS per worker are in flight past an empty bucket.
        if self.failures.retry_after(client) > 0:
            return LIMITED
        who = self.tokens.authenticate(token)
        if who is None and not (self.reviewer is not None and looks_like_jwt(token)):
            self.failures.failed(client)
            return COUNTED_FAILURE
        return who

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if has_control_character(path):
            await send_json(send, 400, {"detail": BAD_PATH_DETAIL, "field": None})
            return
        raw_headers = scope.get("headers", ())
        headers = {k.lower(): v for k, v in raw_headers}
        if sum(1 for k, _ in raw_headers if k.lower() == b"authorization") > 1:
            # Which one would count differs between proxies and servers (here the last won): refuse.
            await send_json(send, 400, {"detail": "more than one Authorization header; send exactly one", "field": None})
            return
        if not self._public(path, headers):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            token = token.strip()
            who: Principal | None = None
            metrics_token = False
            client = (scope.get("client") or (None,))[0]
            counted = False
            if scheme.lower() == "bearer" and token:
                wait = self.failures.retry_after(client)
                if wait > 0:
                    await self._too_many(send, wait)
                    return
                if path == "/metrics" and self.tokens.is_metrics_token(token):
                    who, metrics_token = Principal("metrics"), True
                else:
                    try:
                        found = await self._principal(token, client)
                    except Exception as exc:
                        if not is_database_outage(exc):
                            raise
                        log.warning("token lookup failed, database unavailable: %s", type(exc).__name__)
                        await send_json(send, 503, OUTAGE_BODY, OUTAGE_HEADERS)
                        return
                    if found is LIMITED:
                        await self._too_many(send, max(self.failures.retry_after(client), 1.0))
                        return
                    counted = found is COUNTED_FAILURE
                    who = None if counted else found  # type: ignore[assignment]
                    if who is None and self.reviewer is not None and looks_like_jwt(token):
                        try:
                            agent = await anyio.to_thread.run_sync(self.reviewer.review, token)
                        except ReviewUnavailable as exc:
                            log.warning("agent token not checked: %s", exc)
                            await send_json(send, 503, {"detail": "cannot check the agent's token with the Kubernetes"
                                                        " API server now; retry later", "field": None}, OUTAGE_HEADERS)
                            return
                        if agent is not None:
                            who = Principal(agent.user, node=agent.node)
                            if not _REVIEWED_AGENT_ROUTES.match(f"{scope.get('method', 'GET')} {path}"):
                                await send_json(send, 403, {"detail": "a node agent's pod token may only look datasets"
                                                            " up and report its node's consumption", "field": None})
                                return
            # /metrics: the metrics token or an admin's (not any tenant who happens to be named "metrics")
            if who is not None and path == "/metrics" and not (who.is_admin or metrics_token):
                await send_json(send, 403, {"detail": "the per-job and per-dataset series of /metrics name every tenant's jobs"
                                            " and datasets: they need the metrics token (SILOD_METRICS_TOKEN) or an admin's"
                                            + ("" if self.tokens.protects_metrics else "; without a token /metrics gives the"
                                               " cluster totals"), "field": None})
                return
            if who is None:
                if scheme.lower() == "bearer" and token and not counted:
                    self.failures.failed(client)
                await send_json(
                    send, 401, {"detail": "missing or invalid bearer token (Authorization: Bearer TOKEN)", "field": None},
                    [(b"www-authenticate", b"Bearer")],
                )
                return
            scope.setdefault("state", {})["principal"] = who
            if who.job_id is not None and (scope.get("method") != "POST"
                                           or path != f"/v1/jobs/{who.job_id}/report"):
                # A job's report token (a pod's or program's SILOD_TOKEN) acts for nothing but
                # its own job's step reports: no reads, no submissions, no other job.
                await send_json(send, 403, {"detail": f"a job's report token may only post job {who.job_id}'s step"
                                            f" reports (POST /v1/jobs/{who.job_id}/report)", "field": None})
                return
            if not who.is_admin and _ADMIN_ROUTES.match(f"{scope.get('method', 'GET')} {path}"):
                await send_json(send, 403, {"detail": "only an admin token may call this route", "field": None})
                return
            if path.startswith(AGENT_PATH):
                node = path[len(AGENT_PATH):].split("/", 1)[0]
                bound = who.node or self.agent_node(who.user)
                if bound is None or bound != node:
                    await send_json(send, 403, {"detail": (
                        "only the node agent whose token is bound to this node (silod serve --node-agent USER=NODE,"
                        " or an agent pod's own token on that node) may call it"), "field": None})
                    return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await send_json(send, 400, {"detail": "invalid Content-Length", "field": None})
                return
            if int(length) > self.max_body:
                await send_json(send, 413, {"detail": f"request body larger than {self.max_body} bytes", "field": None})
                return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, capped_receive(timed_receive(receive, *self.body_timeouts), self.max_body),
                           tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await send_json(send, 413, {"detail": exc.detail, "field": None})
        except BodyTimeout as exc:
            if started:
                raise
            await send_json(send, 408, {"detail": exc.detail, "field": None}, [(b"connection", b"close")])
