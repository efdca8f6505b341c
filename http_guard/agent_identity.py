"""Node agents identified the Kubernetes way: the agent pod presents its projected
service-account token, bound to its pod; silod asks the API server who it is (a TokenReview) and
takes the node from the answer, never from anything the caller says.

- The token must be accepted by the API server (signature, expiry, and for a pod-bound token: the
  pod still exists with the same uid) for silod's audience (`audiences` in the review, so a token
  minted for another service is not replayed here).
- It must belong to one of the agents' service accounts (`system:serviceaccount:NS:NAME`), so a
  tenant's pod token, even for the right audience, is not an agent.
- The node: the review's `user.extra["authentication.kubernetes.io/node-name"]`, which API servers
  with pod-bound node info (Kubernetes >= 1.30, ServiceAccountTokenPodNodeInfo) set; older ones
  (the project's test control plane is a 1.24 snapshot) give only the pod's name and uid, so
  silod reads that pod (same namespace as the service account) and takes its `spec.nodeName`,
  after checking the uid (a pod deleted and re-created under the same name is another pod).
  A token without a bound pod (a legacy Secret token) has no node: refused.

Results are cached per token digest for `cache_ttl_s` (a token's pod deletion is then seen at most
that much later) and never beyond the token's own `exp`; failures (the API server down) are not
cached and answer 503 upstream (`ReviewUnavailable`). Only JWT-shaped tokens are reviewed, so
random bad tokens never reach the API server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"
DEFAULT_AUDIENCE = "silod"
IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
IN_CLUSTER_CA = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
_JWT = re.compile(r"^eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\Z")
_CACHE_MAX = 4096
_SA_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


class ReviewUnavailable(Exception):
    """The API server could not be asked (unreachable, 5xx, no permission): not the caller's fault."""


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    user: str  # system:serviceaccount:NS:NAME
    node: str
    pod: str
    namespace: str


def looks_like_jwt(token: str) -> bool:
    return len(token) < 16384 and bool(_JWT.match(token))


def _jwt_exp(token: str) -> float | None:
    """The `exp` claim, read without checking the signature (the API server checks it): only
    to bound how long a positive review is cached."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        exp = claims.get("exp")
        return float(exp) if isinstance(exp, (int, float)) else None
    except (ValueError, IndexError, TypeError):
        return None


def parse_service_account(value: str, what: str = "--agent-service-account") -> str:
    """`NAMESPACE:NAME` -> the user name `system:serviceaccount:NAMESPACE:NAME`."""
    if not _SA_RE.match(value or ""):
        raise ValueError(f"{what} {value!r}: give NAMESPACE:NAME of the agents' service account (e.g. silod-system:silod-agent)")
    return SA_PREFIX + value


@dataclass(frozen=True)
class KubeAPI:
    """Where the API server is and how silod authenticates to it: in a pod, the mounted
    service-account token (re-read at each call: kubelet rotates it) and CA."""

    url: str
    token_file: Path
    ca_file: Path | None

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> KubeAPI:
        url = environ.get("SILOD_KUBE_API")
        if not url:
            host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError("no Kubernetes API server: not in a pod (KUBERNETES_SERVICE_HOST unset) and SILOD_KUBE_API"
                                 " not set")
            url = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        token = Path(environ.get("SILOD_KUBE_TOKEN_FILE") or IN_CLUSTER_TOKEN)
        ca = environ.get("SILOD_KUBE_CA_FILE")
        ca_path = Path(ca) if ca else (IN_CLUSTER_CA if IN_CLUSTER_CA.exists() else None)
        if not token.is_file():
            raise ValueError(f"no token to ask the API server with: {token} does not exist (set SILOD_KUBE_TOKEN_FILE)")
        return cls(url.rstrip("/"), token, ca_path)


class AgentReviewer:
    def __init__(self, api: KubeAPI, service_accounts: frozenset[str], audience: str = DEFAULT_AUDIENCE,
                 cache_ttl_s: float = 5.0, timeout_s: float = 5.0, transport: Any = None):
        if not service_accounts:
            raise ValueError("no agent service account to accept")
        self.api = api
        self.service_accounts = service_accounts
        self.audience = audience
        self.cache_ttl_s = cache_ttl_s
        self.timeout_s = timeout_s
        self._transport = transport
        self._cache: dict[bytes, tuple[AgentIdentity | None, float]] = {}
        self._lock = threading.Lock()

    def _client(self) -> Any:
        import httpx

        verify: Any = True
        if self.api.ca_file is not None:
            import ssl

            verify = ssl.create_default_context(cafile=str(self.api.ca_file))
        token = self.api.token_file.read_text().strip()
        return httpx.Client(base_url=self.api.url, verify=verify, timeout=self.timeout_s, transport=self._transport,
                            headers={"Authorization": f"Bearer {token}"})

    def review(self, token: str, now: float | None = None) -> AgentIdentity | None:
        """The agent this token identifies, or None (not a token of an agent's pod: 401).
        Raises ReviewUnavailable when the API server cannot answer."""
        if not looks_like_jwt(token):
            return None
        now = time.time() if now is None else now
        digest = hashlib.sha256(token.encode()).digest()
        hit = self._cache.get(digest)
        if hit is not None and now < hit[1]:
            return hit[0]
        who = self._review(token)
        until = now + (self.cache_ttl_s if who is not None else min(self.cache_ttl_s, 1.0))
        exp = _jwt_exp(token)
        if exp is not None:
            until = min(until, exp)
        if until > now:
            with self._lock:
                if len(self._cache) >= _CACHE_MAX:
                    self._cache.clear()  # bounded: random JWT-shaped junk cannot grow memory
                self._cache[digest] = (who, until)
        return who

    def _review(self, token: str) -> AgentIdentity | None:
        import httpx

        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}}
        try:
            with self._client() as c:
                r = c.post("/apis/authentication.k8s.io/v1/tokenreviews", json=body)
                if r.status_code >= 300:
                    raise ReviewUnavailable(f"TokenReview answered HTTP {r.status_code}: {r.text[:200]}")
                status = r.json().get("status") or {}
                if not status.get("authenticated"):
                    return None
                if self.audience not in (status.get("audiences") or []):
                    return None  # a token for another audience (the API server's default one)
                user = status.get("user") or {}
                name = str(user.get("username") or "")
                if name not in self.service_accounts:
                    return None
                namespace = name[len(SA_PREFIX):].split(":", 1)[0]
                extra = user.get("extra") or {}
                pod = _one(extra.get(POD_NAME_EXTRA))
                uid = _one(extra.get(POD_UID_EXTRA))
                node = _one(extra.get(NODE_NAME_EXTRA))
                if not pod or not uid:
                    return None  # not bound to a pod: no node to bind it to
                if node:
                    return AgentIdentity(name, node, pod, namespace)
                # An API server without the node claim: the bound pod says where it runs.
                p = c.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
                if p.status_code == 404:
                    return None
                if p.status_code >= 300:
                    raise ReviewUnavailable(f"reading pod {namespace}/{pod} answered HTTP {p.status_code}: {p.text[:200]}")
                obj = p.json()
                meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
                # A terminating pod still counts (the API server accepts its token too): its agent
                # sends its last reports while it shuts down.
                if meta.get("uid") != uid or not spec.get("nodeName"):
                    return None
                return AgentIdentity(name, str(spec["nodeName"]), pod, namespace)
        except httpx.HTTPError as exc:
            raise ReviewUnavailable(f"the Kubernetes API server at {self.api.url} did not answer: {exc}") from None
        except OSError as exc:  # our own token file
            raise ReviewUnavailable(f"cannot read {self.api.token_file}: {exc.strerror}") from None


def _one(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    return ""


CSI_DRIVER = "silod.io"  # fuse_client/agent/csi.py DRIVER_NAME (http_guard imports neither plane)
_ENDED = ("Succeeded", "Failed")


MIRROR_ANNOTATION = "kubernetes.io/config.mirror"  # set on every pod a kubelet creates (static pods)


def pod_on_node_mounts(reviewer: AgentReviewer, namespace: str, node: str, dataset: str) -> bool:
    """Whether a pod in `namespace` bound to `node` (not finished) has a silod volume of `dataset`:
    an inline CSI volume (`csi.driver: silod.io`, `volumeAttributes.dataset`) or a PVC whose bound
    PV is silod's for that dataset and namespace (fuse_client/agent/controller.py). Mirror pods
    (what a node's kubelet creates) never count. Read from the API server as silod's own service
    account; labels and annotations a tenant writes play no part. Raises
    ReviewUnavailable when the API server cannot answer."""
    import httpx

    def get(c: Any, path: str, params: dict[str, str] | None = None) -> dict | None:
        r = c.get(path, params=params)
        if r.status_code == 404:
            return None
        if r.status_code >= 300:
            raise ReviewUnavailable(f"GET {path} answered HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    try:
        with reviewer._client() as c:
            pods = get(c, f"/api/v1/namespaces/{namespace}/pods", {"fieldSelector": f"spec.nodeName={node}"}) or {}
            for pod in pods.get("items") or ():
                if (pod.get("status") or {}).get("phase") in _ENDED:
                    continue
                if MIRROR_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {}):
                    # A mirror pod: a kubelet (the node's own credentials) wrote it, in any
                    # namespace it likes. Only pods the API server created for a user or a
                    # controller give the node a reason to hold a tenant's credential.
                    continue
                for vol in (pod.get("spec") or {}).get("volumes") or ():
                    csi = vol.get("csi") or {}
                    if csi.get("driver") == CSI_DRIVER and (csi.get("volumeAttributes") or {}).get("dataset") == dataset:
                        return True
                    claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
                    if not claim:
                        continue
                    pvc = get(c, f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}") or {}
                    pv_name = (pvc.get("spec") or {}).get("volumeName")
                    pv = get(c, f"/api/v1/persistentvolumes/{pv_name}") if pv_name else None
                    pv_csi = ((pv or {}).get("spec") or {}).get("csi") or {}
                    attrs = pv_csi.get("volumeAttributes") or {}
                    if (pv_csi.get("driver") == CSI_DRIVER and attrs.get("dataset") == dataset
                            and attrs.get("silod.io/namespace", namespace) == namespace):
                        return True
        return False
    except httpx.HTTPError as exc:
        raise ReviewUnavailable(f"the Kubernetes API server at {reviewer.api.url} did not answer: {exc}") from None
    except OSError as exc:
        raise ReviewUnavailable(f"cannot read {reviewer.api.token_file}: {exc.strerror}") from None
