"""Who may talk to the data manager: bearer tokens with two roles, checked (like the scheduler's
API) before a body is read, with the same 1 MiB body cap.

- the **scheduler** token (SILOD_DM_SCHEDULER_TOKEN): allocations, declarations, job deletion,
  status; everything;
- the **agent** token (SILOD_DM_AGENT_TOKEN), held by the node agents / FUSE clients: only
  register a client, heartbeat it, unregister it (and read its own allocation in the answer).
  An agent cannot set anyone's cache or remote IO. This one token is shared by every node: any
  holder may act on any node's clients (issue 20), so prefer
- **node-bound agent tokens** (SILOD_DM_AGENT_TOKENS_FILE: `node:token` lines, one token per
  node): the same routes, but only for clients registered with that node; another node's client
  is a 403. A node's agent sends its own token as SILOD_DM_TOKEN;
- **the agent pod's service-account token** (SILOD_DM_AGENT_SERVICE_ACCOUNTS=NS:NAME[,...]):
  the projected token kubelet gives the agent pod, bound to that pod, checked with a TokenReview
  against the API server for the audience SILOD_DM_AGENT_AUDIENCE (default `silod`); its node is
  the node the API server says the pod runs on (http_guard/agent_identity.py), with the same
  routes and node binding as a node's own token. The mounts read it from SILOD_DM_TOKEN_FILE.

`/healthz` is open; `/metrics` is open unless SILOD_DM_METRICS_TOKEN is set. Clients send
their token from SILOD_DM_TOKEN (datamanager.client, fuse_client.manager_link).

Without any token configured the data manager runs unauthenticated, and `silod datamanager`
then refuses to listen on anything but a loopback address (see datamanager/cli.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from http_guard import BAD_PATH_DETAIL, capped_receive, has_control_character, send_json
from http_guard.agent_identity import AgentReviewer, KubeAPI, ReviewUnavailable, looks_like_jwt, parse_service_account
from http_guard.timeouts import BodyTimeout, timed_receive

log = logging.getLogger("silod.datamanager")

DEFAULT_MAX_BODY = 1 << 20  # allocations and heartbeats are a few hundred bytes

SCHEDULER_TOKEN_ENV = "SILOD_DM_SCHEDULER_TOKEN"
AGENT_TOKEN_ENV = "SILOD_DM_AGENT_TOKEN"
METRICS_TOKEN_ENV = "SILOD_DM_METRICS_TOKEN"
CLIENT_TOKEN_ENV = "SILOD_DM_TOKEN"  # what clients send
AGENT_TOKENS_FILE_ENV = "SILOD_DM_AGENT_TOKENS_FILE"  # node:token lines (node-bound agents)
AGENT_SA_ENV = "SILOD_DM_AGENT_SERVICE_ACCOUNTS"  # NS:NAME,... whose pod-bound tokens are agents
AGENT_AUDIENCE_ENV = "SILOD_DM_AGENT_AUDIENCE"
NODE_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # a Kubernetes node name (RFC 1123)

# (method, path) an agent token may call.
_AGENT_ROUTES = (
    ("POST", re.compile(r"^/v1/clients$")),
    ("PUT", re.compile(r"^/v1/clients/[^/]+/heartbeat$")),
    ("DELETE", re.compile(r"^/v1/clients/[^/]+$")),
)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def parse_node_tokens(text: str, where: str = "agent tokens") -> dict[str, str]:
    """`node:token` lines (`#` comments) -> {node: token}; errors name the line."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        node, sep, token = (x.strip() for x in line.partition(":"))
        if not sep or not NODE_RE.match(node) or len(node) > 253:
            raise ValueError(f"{where}:{lineno}: expected 'node:token' with a node name (lower-case letters, digits, '-', '.')")
        if len(token) < 16:
            raise ValueError(f"{where}:{lineno}: the token of node {node!r} is shorter than 16 characters")
        if node in out or token in seen:
            raise ValueError(f"{where}:{lineno}: node {node!r} or its token appears twice; one token per node")
        out[node] = token
        seen.add(token)
    return out


@dataclass(frozen=True, slots=True)
class Identity:
    role: str  # scheduler | agent | metrics
    node: str | None = None  # a node-bound agent's node; None: any node (the shared agent token)


@dataclass(frozen=True, slots=True)
class DataManagerAuth:
    scheduler_digest: bytes | None = None
    agent_digest: bytes | None = None
    metrics_digest: bytes | None = None
    node_digests: tuple[tuple[bytes, str], ...] = ()  # (digest of a node's agent token, node)
    reviewer: AgentReviewer | None = None  # agent pods' service-account tokens (TokenReview)

    @classmethod
    def from_tokens(cls, scheduler: str | None, agent: str | None, metrics: str | None = None,
                    node_agents: dict[str, str] | None = None) -> DataManagerAuth:
        for name, tok in (("scheduler", scheduler), ("agent", agent), ("metrics", metrics)):
            if tok is not None and len(tok) < 16:
                raise ValueError(f"the data manager's {name} token is shorter than 16 characters")
        if scheduler and agent and scheduler == agent:
            raise ValueError("the scheduler and agent tokens of the data manager must differ")
        node_agents = node_agents or {}
        if set(node_agents.values()) & {scheduler, agent, metrics}:
            raise ValueError("a node's agent token must differ from the scheduler, shared agent and metrics tokens")
        return cls(*(None if t is None else _digest(t) for t in (scheduler, agent, metrics)),
                   node_digests=tuple((_digest(t), n) for n, t in sorted(node_agents.items())))

    @classmethod
    def from_env(cls) -> DataManagerAuth:
        nodes: dict[str, str] = {}
        path = os.environ.get(AGENT_TOKENS_FILE_ENV)
        if path:
            try:
                text = open(path, encoding="utf-8").read()
            except OSError as exc:
                raise ValueError(f"{AGENT_TOKENS_FILE_ENV}={path}: cannot be read ({exc.strerror})") from None
            nodes = parse_node_tokens(text, path)
        auth = cls.from_tokens(os.environ.get(SCHEDULER_TOKEN_ENV) or None, os.environ.get(AGENT_TOKEN_ENV) or None,
                               os.environ.get(METRICS_TOKEN_ENV) or None, nodes)
        accounts = [a.strip() for a in os.environ.get(AGENT_SA_ENV, "").split(",") if a.strip()]
        if accounts:
            users = frozenset(parse_service_account(a, AGENT_SA_ENV) for a in accounts)
            reviewer = AgentReviewer(KubeAPI.from_env(dict(os.environ)), users,
                                     os.environ.get(AGENT_AUDIENCE_ENV) or "silod")
            auth = cls(auth.scheduler_digest, auth.agent_digest, auth.metrics_digest, auth.node_digests, reviewer)
        return auth

    @property
    def enabled(self) -> bool:
        return (self.scheduler_digest is not None or self.agent_digest is not None or bool(self.node_digests)
                or self.reviewer is not None)

    def identify(self, token: str) -> Identity | None:
        d = _digest(token)
        if self.scheduler_digest is not None and hmac.compare_digest(d, self.scheduler_digest):
            return Identity("scheduler")
        if self.agent_digest is not None and hmac.compare_digest(d, self.agent_digest):
            return Identity("agent")
        for digest, node in self.node_digests:
            if hmac.compare_digest(d, digest):
                return Identity("agent", node)
        if self.metrics_digest is not None and hmac.compare_digest(d, self.metrics_digest):
            return Identity("metrics")
        return None

    def review(self, token: str) -> Identity | None:
        """An agent pod's service-account token (blocking: an HTTP call to the API server, so
        the guard runs it in a worker thread). Raises ReviewUnavailable."""
        if self.reviewer is None or not looks_like_jwt(token):
            return None
        who = self.reviewer.review(token)
        return None if who is None else Identity("agent", who.node)

    def role(self, token: str) -> str | None:
        who = self.identify(token)
        return None if who is None else who.role


def allowed(role: str, method: str, path: str) -> bool:
    if role == "scheduler":
        return True
    if role == "agent":
        return any(method == m and rx.match(path) for m, rx in _AGENT_ROUTES)
    if role == "metrics":
        return path == "/metrics"
    return False


class DataManagerGuard:
    def __init__(self, app: Any, auth: DataManagerAuth, max_body: int = DEFAULT_MAX_BODY):
        self.app = app
        self.auth = auth
        self.max_body = max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if has_control_character(path):
            await send_json(send, 400, {"detail": BAD_PATH_DETAIL})
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        public = path == "/healthz" or (path == "/metrics" and self.auth.metrics_digest is None)
        if self.auth.enabled and not public:
            if sum(1 for k, _ in scope.get("headers", ()) if k.lower() == b"authorization") > 1:
                await send_json(send, 400, {"detail": "more than one Authorization header; send exactly one"})
                return
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else ""
            who = self.auth.identify(token) if token else None
            if who is None and token and self.auth.reviewer is not None and looks_like_jwt(token):
                import anyio

                try:
                    who = await anyio.to_thread.run_sync(self.auth.review, token)
                except ReviewUnavailable as exc:
                    # The API server's address stays in the log: not for an unauthenticated caller.
                    log.warning("agent token not checked: %s", exc)
                    await send_json(send, 503, {"detail": "cannot check the agent's token now; retry later"},
                                    [(b"retry-after", b"5")])
                    return
            if who is None:
                await send_json(send, 401, {"detail": "missing or invalid bearer token"}, [(b"www-authenticate", b"Bearer")])
                return
            if not allowed(who.role, method, path):
                await send_json(send, 403, {"detail": f"the {who.role} token may not call {method} {path}"})
                return
            # The routes check a node-bound agent's node against the client it acts on.
            scope.setdefault("state", {})["dm_identity"] = who
        length = headers.get(b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
            await send_json(send, 413, {"detail": f"request body larger than {self.max_body} bytes"})
            return
        try:
            await self.app(scope, capped_receive(timed_receive(receive), self.max_body), send)
        except BodyTimeout as exc:  # a stalled body (http_guard/timeouts.py); before any answer
            await send_json(send, 408, {"detail": exc.detail}, [(b"connection", b"close")])
