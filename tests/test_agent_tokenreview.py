"""Node agents identified by their pods' own service-account tokens (issue 20, finding 1), against
the REAL control plane (tests/k8s_testenv.py: kube-apiserver v1.24.0-alpha snapshot with
service-account signing keys, RBAC from deploy/base).

An agent pod bound to a node gets a token by TokenRequest, bound to that pod and minted for the
audience `silod`, as kubelet's projected volume (deploy/base/agent.yaml) gets it. A real `silod
serve` and a real `silod datamanager` on 127.0.0.1 check it with a TokenReview, as their own
service accounts (deploy/base RBAC: tokenreviews create; pods get in silod-system), and take the
node from the pod the API server says the token is bound to (this API server predates the
`authentication.kubernetes.io/node-name` claim, so the pod look-up path is what runs here).

Accepted for its own node; 403 for another node's consumption and clients; 401 for a token of
another service account, another audience, an expired token and a deleted pod's token.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dataplane_helpers import free_port, silod_cmd
from k8s_testenv import SILOD_SA, ControlPlane, wait

NS = "silod-system"
AGENT_SA = "silod-agent"
ADMIN = "admin-token-0123456789"
DM_SCHEDULER = "dm-scheduler-token-0123456789"


def _pod(cp: ControlPlane, name: str, node: str, sa: str = AGENT_SA) -> dict:
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"serviceAccountName": sa, "automountServiceAccountToken": False, "nodeName": node,
                     "containers": [{"name": "agent", "image": "silod"}]}}
    return cp.core.create_namespaced_pod(NS, body).to_dict()


def _token(cp: ControlPlane, pod: dict | None, sa: str = AGENT_SA, audience: str | None = "silod") -> str:
    """A TokenRequest as kubelet makes it for a projected serviceAccountToken volume."""
    spec: dict = {"expirationSeconds": 3600}
    if audience is not None:
        spec["audiences"] = [audience]
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}
    r = httpx.post(f"{cp.url}/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token",
                   json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
                   headers={"Authorization": f"Bearer {cp.tokens['admin']}"}, verify=str(cp.ca), timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["status"]["token"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _signed(cp: ControlPlane, pod: dict, exp: float) -> str:
    """A pod-bound token signed with the API server's own service-account key, with the claims the
    API server writes, but an expiry of our choosing (TokenRequest refuses < 10 minutes)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding

    key = serialization.load_pem_private_key((cp.dir / "pki" / "sa.key").read_bytes(), None)
    sa = cp.core.read_namespaced_service_account(AGENT_SA, NS)
    now = int(time.time())
    claims = {"iss": "https://kubernetes.default.svc", "aud": ["silod"], "sub": f"system:serviceaccount:{NS}:{AGENT_SA}",
              "iat": now - 7200, "nbf": now - 7200, "exp": int(exp),
              "kubernetes.io": {"namespace": NS, "serviceaccount": {"name": AGENT_SA, "uid": sa.metadata.uid},
                                "pod": {"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}}}
    head = _b64(json.dumps({"alg": "RS256", "typ": "JWT"}).encode()) + "." + _b64(json.dumps(claims).encode())
    sig = key.sign(head.encode(), padding.PKCS1v15(), hashes.SHA256())  # type: ignore[union-attr]
    return head + "." + _b64(sig)


def _wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up: {log.read_text()[-2000:]}"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)


@pytest.fixture
def silod(control_plane: ControlPlane, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(scheduler URL, data manager URL), each checking agent tokens as its own service account."""
    cp = control_plane
    kube = {"SILOD_KUBE_API": cp.url, "SILOD_KUBE_CA_FILE": str(cp.ca)}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    # The data manager's service account token (deploy/base/datamanager.yaml's account).
    dm_token = tmp_path / "dm-sa-token"
    dm_token.write_text(_token(cp, None, sa="silod-datamanager", audience=None))
    procs = []
    try:
        sport, dport = free_port(), free_port()
        slog, dlog = tmp_path / "serve.log", tmp_path / "dm.log"
        serve = subprocess.Popen(
            [*silod_cmd(), "serve", "--backend", "null", "--listen", f"127.0.0.1:{sport}", "--state-dir",
             str(tmp_path / "state"), "--gpus", "8", "--gpus-per-node", "8", "--cache", "1TB", "--remote-io", "1GB/s",
             "--round", "1h", "--agent-service-account", f"{NS}:{AGENT_SA}"],
            env={**base_env, **kube, "SILOD_KUBE_TOKEN_FILE": str(cp.token_file(SILOD_SA)), "SILOD_ADMIN_TOKEN": ADMIN,
                 "XDG_STATE_HOME": str(tmp_path / "xdg")},
            stdout=slog.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(serve)
        dm = subprocess.Popen(
            [*silod_cmd(), "datamanager", "--listen", f"127.0.0.1:{dport}", "--state", str(tmp_path / "dm")],
            env={**base_env, **kube, "SILOD_KUBE_TOKEN_FILE": str(dm_token), "SILOD_DM_SCHEDULER_TOKEN": DM_SCHEDULER,
                 "SILOD_DM_AGENT_SERVICE_ACCOUNTS": f"{NS}:{AGENT_SA}"},
            stdout=dlog.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(dm)
        (tmp_path / "dm").mkdir(exist_ok=True)
        _wait_http(f"http://127.0.0.1:{sport}", serve, slog)
        _wait_http(f"http://127.0.0.1:{dport}", dm, dlog)
        yield f"http://127.0.0.1:{sport}", f"http://127.0.0.1:{dport}"
    finally:
        for p in procs:
            _stop(p)


def _report(url: str, node: str, token: str) -> int:
    return httpx.post(f"{url}/v1/agents/{node}/consumption", json={"pods": []},
                      headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code


def _register(url: str, node: str, token: str, client_id: str) -> int:
    body = {"client_id": client_id, "node": node, "dataset": "d1-files", "job": f"node-{node}_d1-files"}
    return httpx.post(f"{url}/v1/clients", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code


@pytest.mark.slow
def test_agent_pod_tokens_are_bound_to_their_node_at_the_scheduler_and_the_data_manager(control_plane, silod):
    cp = control_plane
    sched, dm = silod
    tag = uuid.uuid4().hex[:6]
    n1, n2 = f"gpu-a-{tag}", f"gpu-b-{tag}"
    cp.core.create_namespaced_service_account(NS, {"metadata": {"name": f"intruder-{tag}"}})
    pods = {"a": _pod(cp, f"agent-a-{tag}", n1), "b": _pod(cp, f"agent-b-{tag}", n2),
            "gone": _pod(cp, f"agent-gone-{tag}", n1), "x": _pod(cp, f"intruder-{tag}", n1, sa=f"intruder-{tag}")}
    try:
        ta, tb = _token(cp, pods["a"]), _token(cp, pods["b"])
        # What the scheduler pushes: a job reading d1-files has a pod on each node. Until this
        # first push a node-bound agent registers nothing (503).
        assert _register(dm, n1, ta, f"c0-{tag}") == 503
        r = httpx.put(f"{dm}/v1/placements", json={"nodes": {n1: ["d1-files"], n2: ["d1-files"]}},
                      headers={"Authorization": f"Bearer {DM_SCHEDULER}"}, timeout=30)
        assert r.status_code == 200, r.text

        # Its own node: accepted by both.
        assert _report(sched, n1, ta) == 200
        assert _report(sched, n2, tb) == 200
        assert _register(dm, n1, ta, f"c1-{tag}") == 200
        assert _register(dm, n2, tb, f"c2-{tag}") == 200
        hb = httpx.put(f"{dm}/v1/clients/c1-{tag}/heartbeat", json={"stats": {}},
                       headers={"Authorization": f"Bearer {ta}"}, timeout=30)
        assert hb.status_code == 200, hb.text
        # The agent identity may look a tenant's dataset up (404 here: none registered), not 401/403.
        look = httpx.get(f"{sched}/v1/datasets/files", params={"owner": "alice"},
                         headers={"Authorization": f"Bearer {ta}"}, timeout=30)
        assert look.status_code == 404, look.text
        # ... and is no tenant: it registers and submits nothing, lists nothing.
        for method, path, body in (("POST", "/v1/datasets", {"name": "x", "uri": "s3://b/x", "size": 1}),
                                   ("POST", "/v1/jobs", {"name": "x", "gpus": 1, "dataset": "x", "epochs": 1}),
                                   ("GET", "/v1/jobs", None)):
            r = httpx.request(method, f"{sched}{path}", json=body, headers={"Authorization": f"Bearer {ta}"}, timeout=30)
            assert r.status_code == 403, (path, r.text)

        # Another node's: 403 (the node is the pod's, whatever the path or the body says).
        assert _report(sched, n2, ta) == 403
        assert _register(dm, n2, ta, f"c3-{tag}") == 403
        assert _register(dm, n1, ta, f"c2-{tag}") == 403  # taking over n2's client by its id
        for method, path in (("PUT", f"/v1/clients/c2-{tag}/heartbeat"), ("DELETE", f"/v1/clients/c2-{tag}")):
            r = httpx.request(method, f"{dm}{path}", json={"stats": {}} if method == "PUT" else None,
                              headers={"Authorization": f"Bearer {ta}"}, timeout=30)
            assert r.status_code == 403, (method, r.text)
        # An agent may not allocate, whatever its node.
        r = httpx.put(f"{dm}/v1/datasets/d1-files/cache", json={"bytes": 1}, headers={"Authorization": f"Bearer {ta}"},
                      timeout=30)
        assert r.status_code == 403

        # 401: another service account's pod token (right audience, right node).
        tx = _token(cp, pods["x"], sa=f"intruder-{tag}")
        assert _report(sched, n1, tx) == 401 and _register(dm, n1, tx, f"c4-{tag}") == 401
        # 401: the agent's own pod token for another audience (the API server's default).
        tdef = _token(cp, pods["a"], audience=None)
        assert _report(sched, n1, tdef) == 401 and _register(dm, n1, tdef, f"c5-{tag}") == 401
        # 401: expired. The same minting with a future expiry is accepted, so the refusal is the expiry's.
        fresh = _signed(cp, pods["a"], time.time() + 600)
        assert _report(sched, n1, fresh) == 200
        expired = _signed(cp, pods["a"], time.time() - 60)
        assert _report(sched, n1, expired) == 401 and _register(dm, n1, expired, f"c6-{tag}") == 401
        # 401: the pod the token is bound to was deleted (seen within the review cache's TTL).
        tg = _token(cp, pods["gone"])
        assert _report(sched, n1, tg) == 200 and _register(dm, n1, tg, f"c7-{tag}") == 200
        cp.core.delete_namespaced_pod(pods["gone"]["metadata"]["name"], NS, grace_period_seconds=0)
        wait(lambda: _report(sched, n1, tg) == 401 and _register(dm, n1, tg, f"c8-{tag}") == 401, timeout=30,
             what="the deleted pod's token refused")
        # Static tokens keep working beside it: the data manager's scheduler token.
        assert httpx.get(f"{dm}/v1/status", headers={"Authorization": f"Bearer {DM_SCHEDULER}"}, timeout=30).status_code == 200
    finally:
        for p in pods.values():
            try:
                cp.core.delete_namespaced_pod(p["metadata"]["name"], NS, grace_period_seconds=0)
            except Exception:  # noqa: BLE001 - already gone
                pass
        cp.core.delete_namespaced_service_account(f"intruder-{tag}", NS)


def test_an_agent_pods_token_reads_only_credentials_its_node_needs(control_plane, silod, tmp_path):
    """The credential rule for a reviewed agent identity: the node is the one the API server says
    its pod runs on; alice's dataset is read by a job whose pod the scheduler recorded on node A,
    so A's agent gets the credential and B's agent a 403, as does A's for bob's dataset."""
    from scheduler.service.consumption import AdmittedPod, ConsumptionStore
    from scheduler.service.db import open_database
    from sqlalchemy.orm import sessionmaker

    cp = control_plane
    sched, _ = silod
    tag = uuid.uuid4().hex[:6]
    na, nb = f"cred-a-{tag}", f"cred-b-{tag}"
    pods = {"a": _pod(cp, f"agent-ca-{tag}", na), "b": _pod(cp, f"agent-cb-{tag}", nb)}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        ta, tb = _token(cp, pods["a"]), _token(cp, pods["b"])
        h, job = {}, None
        for tenant in ("alice", "bob"):
            r = httpx.post(f"{sched}/v1/tokens", json={"owner": tenant}, headers=admin, timeout=30)
            assert r.status_code == 201, r.text
            h[tenant] = {"Authorization": f"Bearer {r.json()['token']}"}
            cred = {"name": "prod", "access_key_id": f"AKIA{tenant.upper()}", "secret_access_key": f"{tenant}-secret"}
            assert httpx.post(f"{sched}/v1/credentials", json=cred, headers=h[tenant], timeout=30).status_code == 201
            r = httpx.post(f"{sched}/v1/datasets", json={"name": "files", "uri": f"s3://b/{tenant}", "size": "1GB",
                                                       "credential": "prod"}, headers=h[tenant], timeout=30)
            assert r.status_code == 201, r.text
        r = httpx.post(f"{sched}/v1/jobs", json={"name": "j", "gpus": 1, "dataset": "files", "epochs": 1,
                                                "ideal_throughput": "100MB/s"}, headers=h["alice"], timeout=30)
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        # The scheduling leader's record (here written as the Kubernetes backend writes it).
        sessions = sessionmaker(open_database(f"sqlite:///{tmp_path / 'state' / 'silod.db'}"), expire_on_commit=False)
        ConsumptionStore(sessions).record_pods([AdmittedPod(str(uuid.uuid4()), job, na, "alice", "j-0")])

        def cred(token: str, owner: str) -> httpx.Response:
            return httpx.get(f"{sched}/v1/datasets/files/source-credential", params={"owner": owner},
                             headers={"Authorization": f"Bearer {token}"}, timeout=30)

        r = cred(ta, "alice")
        assert r.status_code == 200 and r.json()["credential"]["secret_access_key"] == "alice-secret", r.text
        r = cred(tb, "alice")
        assert r.status_code == 403 and nb in r.json()["detail"], r.text
        r = cred(ta, "bob")
        assert r.status_code == 403 and "bob-secret" not in r.text
    finally:
        for p in pods.values():
            try:
                cp.core.delete_namespaced_pod(p["metadata"]["name"], NS, grace_period_seconds=0)
            except Exception:  # noqa: BLE001 - already gone
                pass


def test_an_agent_pod_gets_the_credential_for_its_nodes_pods_volumes_from_the_api_server(control_plane, silod):
    """A tenant's pod silod did not admit (no silod job) but bound to the agent's node with a
    silod volume of the dataset (inline CSI, or a PVC bound to silod's PV for that namespace):
    the scheduler asks the API server (its own RBAC from deploy/base), and the agent of that node
    gets the credential; the agent of a node with no such pod, or only a mirror pod (created with
    the node's kubelet credentials), gets 403."""
    cp = control_plane
    sched, _ = silod
    tag = uuid.uuid4().hex[:6]
    tenant = f"t{tag}"  # namespace prefix "": the tenant's namespace is its name
    na, nb, nc, nd = f"vol-a-{tag}", f"vol-b-{tag}", f"vol-c-{tag}", f"vol-d-{tag}"
    cp.add_namespace(tenant)
    agents = {n: _pod(cp, f"agent-{n}", n) for n in (na, nb, nc, nd)}
    try:
        tok = {n: _token(cp, p) for n, p in agents.items()}
        r = httpx.post(f"{sched}/v1/tokens", json={"owner": tenant}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        assert r.status_code == 201, r.text
        h = {"Authorization": f"Bearer {r.json()['token']}"}
        cred = {"name": "prod", "access_key_id": "AKIATENANT", "secret_access_key": "tenant-secret"}
        assert httpx.post(f"{sched}/v1/credentials", json=cred, headers=h, timeout=30).status_code == 201
        r = httpx.post(f"{sched}/v1/datasets", json={"name": "files", "uri": "s3://b/t", "size": "1GB",
                                                   "credential": "prod"}, headers=h, timeout=30)
        assert r.status_code == 201, r.text
        container = [{"name": "c", "image": "trainer"}]
        # node A: an inline CSI volume of the dataset
        cp.core.create_namespaced_pod(tenant, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "inline"},
            "spec": {"nodeName": na, "containers": container, "volumes": [
                {"name": "d", "csi": {"driver": "silod.io", "readOnly": True, "volumeAttributes": {"dataset": "files"}}}]}})
        # node B: a PVC bound to silod's PV of the dataset for this namespace
        cp.core.create_persistent_volume({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{tag}"},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                     "csi": {"driver": "silod.io", "volumeHandle": f"silod:{tenant}:files:pv-{tag}",
                             "volumeAttributes": {"dataset": "files", "silod.io/namespace": tenant}}}})
        cp.core.create_namespaced_persistent_volume_claim(tenant, {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data"}, "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                                                   "volumeName": f"pv-{tag}", "resources": {"requests": {"storage": "1Gi"}}}})
        cp.core.create_namespaced_pod(tenant, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "claim"},
            "spec": {"nodeName": nb, "containers": container, "volumes": [
                {"name": "d", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}}]}})
        # node C: a pod whose labels and annotations name the dataset, but no silod volume of it
        cp.core.create_namespaced_pod(tenant, {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "liar", "labels": {"silod.io/dataset": "files"}, "annotations": {"silod.io/dataset": "files"}},
            "spec": {"nodeName": nc, "containers": container}})

        # node D: a mirror pod (what the node's own kubelet credentials can create in any
        # namespace) with an inline silod volume of the dataset: it gives the node no reason.
        cp.core.create_namespaced_pod(tenant, {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"static-{nd}", "annotations": {"kubernetes.io/config.mirror": "0123abcd",
                                                   "kubernetes.io/config.source": "file"}},
            "spec": {"nodeName": nd, "containers": container, "volumes": [
                {"name": "d", "csi": {"driver": "silod.io", "readOnly": True, "volumeAttributes": {"dataset": "files"}}}]}})

        def get(node: str) -> httpx.Response:
            return httpx.get(f"{sched}/v1/datasets/files/source-credential", params={"owner": tenant},
                             headers={"Authorization": f"Bearer {tok[node]}"}, timeout=30)

        for node in (na, nb):
            r = get(node)
            assert r.status_code == 200 and r.json()["credential"]["secret_access_key"] == "tenant-secret", (node, r.text)
        for node in (nc, nd):
            r = get(node)
            assert r.status_code == 403 and "tenant-secret" not in r.text, (node, r.text)
    finally:
        for p in agents.values():
            try:
                cp.core.delete_namespaced_pod(p["metadata"]["name"], NS, grace_period_seconds=0)
            except Exception:  # noqa: BLE001 - already gone
                pass


# --- the review's rules without a control plane: what newer API servers answer (>= 1.30 put the
# node in the review; the test control plane above is older, so these shapes are written out here
# from the TokenReview API reference, not observed).


def _reviewer(tmp: Path, answer: dict, pod: dict | None = None, seen: list | None = None):  # type: ignore[no-untyped-def]
    from http_guard.agent_identity import AgentReviewer, KubeAPI

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request.url.path)
        if request.url.path.endswith("/tokenreviews"):
            return httpx.Response(201, json={"status": answer})
        return httpx.Response(200, json=pod) if pod is not None else httpx.Response(404, json={})

    token = tmp / "reviewer-token"
    token.write_text("reviewer-token")
    return AgentReviewer(KubeAPI("https://127.0.0.1:1", token, None), frozenset({f"system:serviceaccount:{NS}:{AGENT_SA}"}),
                         cache_ttl_s=0, transport=httpx.MockTransport(handler))


JWT = "eyJhbGciOiJSUzI1NiJ9.eyJleHAiOjQxMDI0NDQ4MDB9.c2ln"
USER = {"username": f"system:serviceaccount:{NS}:{AGENT_SA}",
        "extra": {"authentication.kubernetes.io/pod-name": ["agent-x"], "authentication.kubernetes.io/pod-uid": ["u1"]}}


def test_the_node_claim_is_used_when_the_api_server_gives_it(tmp_path):
    seen: list = []
    user = {**USER, "extra": {**USER["extra"], "authentication.kubernetes.io/node-name": ["gpu-7"]}}
    who = _reviewer(tmp_path, {"authenticated": True, "audiences": ["silod"], "user": user}, seen=seen).review(JWT)
    assert who is not None and who.node == "gpu-7"
    assert seen == ["/apis/authentication.k8s.io/v1/tokenreviews"]  # no pod look-up needed


def test_the_pod_must_be_the_bound_one_and_the_token_must_be_for_silod(tmp_path):
    pod = {"metadata": {"uid": "u1"}, "spec": {"nodeName": "gpu-3"}}
    ok = {"authenticated": True, "audiences": ["silod"], "user": USER}
    assert _reviewer(tmp_path, ok, pod).review(JWT).node == "gpu-3"
    assert _reviewer(tmp_path, ok, {"metadata": {"uid": "other"}, "spec": {"nodeName": "gpu-3"}}).review(JWT) is None  # re-created pod
    assert _reviewer(tmp_path, ok, None).review(JWT) is None  # pod gone
    assert _reviewer(tmp_path, {**ok, "audiences": ["https://kubernetes.default.svc"]}, pod).review(JWT) is None
    unbound = {**USER, "extra": {}}
    assert _reviewer(tmp_path, {**ok, "user": unbound}, pod).review(JWT) is None  # a token bound to no pod has no node


def test_tokens_that_are_not_jwts_never_reach_the_api_server(tmp_path):
    seen: list = []
    r = _reviewer(tmp_path, {"authenticated": True, "audiences": ["silod"], "user": USER}, seen=seen)
    for junk in ("", "static-token-0123456789", "a.b.c", "eyJ" + "x" * 20000):
        assert r.review(junk) is None
    assert seen == []


def test_an_api_server_that_does_not_answer_is_a_503_not_a_401_nor_a_leak(tmp_path):
    from fastapi.testclient import TestClient

    from datamanager.app import create_app
    from datamanager.auth import DataManagerAuth
    from http_guard.agent_identity import AgentReviewer, KubeAPI

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    (tmp_path / "t").write_text("reviewer-token")
    reviewer = AgentReviewer(KubeAPI("https://10.96.0.1:443", tmp_path / "t", None),
                             frozenset({f"system:serviceaccount:{NS}:{AGENT_SA}"}), transport=httpx.MockTransport(down))
    auth = DataManagerAuth.from_tokens(DM_SCHEDULER, None)
    auth = DataManagerAuth(auth.scheduler_digest, None, None, (), reviewer)
    (tmp_path / "dm").mkdir()
    with TestClient(create_app(tmp_path / "dm", auth)) as c:
        r = c.post("/v1/clients", json={"client_id": "c", "node": "n1", "dataset": "d1-x", "job": "node-n1_d1-x"},
                   headers={"Authorization": f"Bearer {JWT}"})
        assert r.status_code == 503 and "10.96" not in r.text and r.headers["retry-after"] == "5"
        assert c.post("/v1/clients", json={}, headers={"Authorization": "Bearer not-a-jwt-0123456789"}).status_code == 401
