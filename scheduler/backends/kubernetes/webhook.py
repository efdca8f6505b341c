"""The mutating admission webhook: a workload labelled `silod.io/queue` is created suspended.

Kueue's pattern. Without it, a Job created with `suspend: false` (the default) starts pods at
once, and silod can only suspend it on its next poll, after pods may have run. With it, the API
server sends every CREATE of a labelled Job, JobSet or PyTorchJob (the
MutatingWebhookConfiguration's objectSelector) here first, and we answer with a JSONPatch that
sets `spec.suspend: true` (`spec.runPolicy.suspend` for a PyTorchJob), so no pod starts before
silod admits it, and gives every container mount of a silod volume `mountPropagation:
HostToContainer` (the pods keep their data across node agent restarts: workloads.propagation_patch), and gives
every container the step reporter's SILOD_JOB_ID, SILOD_SERVER and SILOD_TOKEN from the job's
report Secret, which silod writes when it admits the workload (workloads.report_env_patch). On UPDATE, unsuspending a queued workload, or removing the queue label from
one that is suspended, is denied to everyone but silod's own identity (`--webhook-admitter`,
the scheduler's service account), so its owner cannot start it past the queue either. The configuration is deploy/base/webhook.yaml (failurePolicy: Fail; see
docs/kubernetes.md for why and for the certificate).

Trust: the webhook decides nothing and stores nothing; its answer goes back only to the caller.
A forged review can therefore gain nothing but its own patch. It is still served over HTTPS only
(the API server requires it and checks our certificate against the caBundle), and with
`--webhook-client-ca` it accepts only callers presenting a certificate from that CA: the API
server does, when its AdmissionConfiguration gives it a client certificate for webhooks. Bodies
are capped (the API server's own request limit is 3 MiB) and a malformed review is a 400 naming
the problem, never a crash.

`review_response` is pure (tested without a server); `WebhookServer` runs it on uvicorn with TLS.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scheduler.backends.kubernetes.nodematch import NodeLabels
from scheduler.backends.kubernetes.workloads import (
    GPU_RESOURCE, KIND_BY_NAME, PYTORCHJOB, QUEUE_LABEL, admission_problems, propagation_patch, report_env_patch,
)

log = logging.getLogger("silod.webhook")

PATH = "/mutate"
DEFAULT_MAX_BODY = 3 * 1024 * 1024
REVIEW_VERSION = "admission.k8s.io/v1"


class BadReview(ValueError):
    """The body is not an AdmissionReview v1 request we can answer (HTTP 400)."""


def _suspend_patch(kind: str, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return [{"op": "add", "path": "/spec", "value": {"runPolicy": {"suspend": True}} if kind == PYTORCHJOB.kind
                 else {"suspend": True}}]
    if kind == PYTORCHJOB.kind:
        run = spec.get("runPolicy")
        if not isinstance(run, Mapping):
            return [{"op": "add", "path": "/spec/runPolicy", "value": {"suspend": True}}]
        return [] if run.get("suspend") is True else [{"op": "add", "path": "/spec/runPolicy/suspend", "value": True}]
    return [] if spec.get("suspend") is True else [{"op": "add", "path": "/spec/suspend", "value": True}]


def _suspended(kind: str, obj: Any) -> bool:
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    if not isinstance(spec, Mapping):
        return False
    if kind == PYTORCHJOB.kind:
        run = spec.get("runPolicy")
        return isinstance(run, Mapping) and run.get("suspend") is True
    return spec.get("suspend") is True


def _labelled(obj: Any) -> bool:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return isinstance(labels, Mapping) and QUEUE_LABEL in labels


def review_response(body: Any, admitters: frozenset[str] = frozenset(),
                    nodes: Callable[[], Sequence[NodeLabels]] | None = None) -> dict[str, Any]:
    """The AdmissionReview answering `body` (the parsed request). BadReview when it is not one.

    CREATE of a labelled workload: patched suspended. UPDATE that unsuspends a workload that is
    (or was) labelled: denied unless the requester (`request.userInfo.username`, the API server's
    authenticated identity) is one of `admitters`, silod's own service account: only silod's
    admission may start a queued workload's pods. CREATE of a labelled workload silod would
    never admit (workloads.admission_problems; `nodes` gives the cluster's nodes for the
    nodeSelector / affinity check): denied with the reasons."""
    if not isinstance(body, Mapping) or body.get("apiVersion") != REVIEW_VERSION or body.get("kind") != "AdmissionReview":
        raise BadReview(f"expected an AdmissionReview of apiVersion {REVIEW_VERSION}")
    req = body.get("request")
    if not isinstance(req, Mapping):
        raise BadReview("the AdmissionReview has no request")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid or len(uid) > 128:
        raise BadReview("request.uid is missing")
    kind = req.get("kind")
    kind_name = kind.get("kind") if isinstance(kind, Mapping) else None
    obj = req.get("object")
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    known = KIND_BY_NAME.get(kind_name) if isinstance(kind_name, str) else None
    ours = known is not None and isinstance(kind, Mapping) and kind.get("group") == known.group
    old = req.get("oldObject")
    user = req.get("userInfo")
    requester = user.get("username") if isinstance(user, Mapping) else None
    if (ours and req.get("operation") == "UPDATE" and isinstance(obj, Mapping) and isinstance(old, Mapping)
            and _labelled(old) and not _labelled(obj) and _suspended(known.kind, old)
            and requester not in admitters):
        # Dropping the label from a queued (suspended) workload would take it out of silod's
        # queue and out of this webhook's objectSelector: its owner could then unsuspend it with
        # no review at all. The API server sends the UPDATE here because the old object matches.
        return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": {
            "uid": uid, "allowed": False, "status": {
                "code": 403, "reason": "Forbidden",
                "message": f"{kind_name} is queued in silod: the label {QUEUE_LABEL} cannot be removed while it is"
                           f" suspended; delete and re-create it without the label to run it outside silod"}}}
    if (ours and req.get("operation") == "UPDATE" and isinstance(obj, Mapping) and isinstance(old, Mapping)
            and (_labelled(old) or _labelled(obj)) and _suspended(known.kind, old)
            and not _suspended(known.kind, obj)):
        name = requester
        if name not in admitters:
            return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": {
                "uid": uid, "allowed": False, "status": {
                    "code": 403, "reason": "Forbidden",
                    "message": f"{kind_name} is queued in silod ({QUEUE_LABEL}): only silod's admission may unsuspend"
                               f" it; wait for it to be admitted (silod jobs), or delete and re-create it without the"
                               f" label"}}}
    if ours and req.get("operation") == "CREATE" and isinstance(obj, Mapping):
        labels = (obj.get("metadata") or {}).get("labels") if isinstance(obj.get("metadata"), Mapping) else None
        if isinstance(labels, Mapping) and QUEUE_LABEL in labels:
            try:
                cluster = nodes() if nodes is not None else None
            except Exception as exc:  # noqa: BLE001 - the node list is a bonus: admission goes on without it
                log.warning("node list unavailable, node selectors not checked: %s", exc)
                cluster = None
            problems = admission_problems(known, obj, cluster)
            if problems:
                # Refused now, with the reason, rather than queued, admitted and then stuck with
                # pods no node will take (or whose volume the node agent will never publish).
                return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": {
                    "uid": uid, "allowed": False, "status": {
                        "code": 422, "reason": "Invalid", "message": "silod: " + "; ".join(problems)[:3000]}}}
            patch = _suspend_patch(known.kind, obj) + propagation_patch(known, obj) + report_env_patch(known, obj)
            if patch:
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
                response["warnings"] = [f"silod: created suspended; silod admits it from queue {labels[QUEUE_LABEL]!r}"]
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": response}


class WebhookApp:
    """ASGI: POST /mutate with an AdmissionReview; /healthz for probes."""

    def __init__(self, max_body: int = DEFAULT_MAX_BODY, admitters: frozenset[str] = frozenset(),
                 nodes: Callable[[], Sequence[NodeLabels]] | None = None):
        self.max_body = max_body
        self.admitters = admitters
        self.nodes = nodes
        self.reviews = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope.get("path", ""), scope.get("method", "")
        if path == "/healthz":
            await _reply(send, 200, {"status": "ok"})
            return
        if path != PATH:
            await _reply(send, 404, {"detail": f"not found; the webhook is POST {PATH}"})
            return
        if method != "POST":
            await _reply(send, 405, {"detail": f"POST {PATH} only"})
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _reply(send, 413, {"detail": f"body larger than {self.max_body} bytes"})
            return
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip()
        if ctype != b"application/json":
            await _reply(send, 415, {"detail": "an AdmissionReview is application/json"})
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            size += len(msg.get("body", b""))
            if size > self.max_body:
                await _reply(send, 413, {"detail": f"body larger than {self.max_body} bytes"})
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        try:
            answer = review_response(json.loads(b"".join(chunks)), self.admitters, self.nodes)
        except (ValueError, RecursionError) as exc:  # JSON errors and BadReview
            await _reply(send, 400, {"detail": f"not an AdmissionReview: {str(exc)[:200]}"})
            return
        self.reviews += 1
        await _reply(send, 200, answer)


async def _reply(send: Any, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class WebhookServer:
    """The webhook on its own HTTPS listener (a thread of `silod serve`), separate from the REST
    API: another port, another certificate (the one the API server trusts through caBundle)."""

    def __init__(self, host: str, port: int, cert: Path, key: Path, client_ca: Path | None = None,
                 max_body: int = DEFAULT_MAX_BODY, admitters: frozenset[str] = frozenset(),
                 nodes: Callable[[], Sequence[NodeLabels]] | None = None):
        import uvicorn

        # Load the pair now: a bad certificate or key is an error at start, not in a thread later.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(cert), str(key))
        if client_ca is not None:
            ssl.create_default_context(cafile=str(client_ca))
        self.app = WebhookApp(max_body, admitters, nodes)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off",
            ssl_certfile=str(cert), ssl_keyfile=str(key),
            ssl_ca_certs=str(client_ca) if client_ca else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
            h11_max_incomplete_event_size=64 * 1024,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="silod-webhook", daemon=True)

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}{PATH}"

    def start(self) -> WebhookServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the admission webhook server did not start (see the log)")
            time.sleep(0.01)
        log.info("admission webhook on %s", self.url)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


class NodeCache:
    """The cluster's nodes for the webhook's nodeSelector / affinity check: listed through the
    API server at most every `ttl_s` seconds (a burst of creates costs one list)."""

    def __init__(self, api_client: Any, ttl_s: float = 10.0):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._at = -1e18
        self._nodes: list[NodeLabels] = []

    def __call__(self) -> list[NodeLabels]:
        with self._lock:
            if time.monotonic() - self._at > self.ttl_s:
                items = self.core.list_node(_request_timeout=10).items
                self._nodes = [NodeLabels(n.metadata.name, dict(n.metadata.labels or {}), _gpus(n)) for n in items]
                self._at = time.monotonic()
            return list(self._nodes)


def _gpus(node: Any) -> int:
    alloc = (node.status.allocatable or {}) if node.status else {}
    try:
        return int(str(alloc.get(GPU_RESOURCE, "0")))
    except ValueError:
        return 0
