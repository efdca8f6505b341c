"""Step reports from pods on Kubernetes (issue 44, round 3), on the REAL control plane
(tests/k8s_testenv.py: kube-apiserver v1.24.0-alpha snapshot, its Job controller, RBAC on, deploy/base
applied, the admission webhook on 127.0.0.1) with a real `silod serve --backend kubernetes`
(tests/sdk_helpers.Served), authenticated to the API server as its own service account.

When silod admits a job's workload it writes a per-job Secret into the workload's namespace (the
job's report token, the API's URL, the job's id), owned by the workload; the pods read it as
SILOD_TOKEN / SILOD_SERVER / SILOD_JOB_ID (a REST job's Job carries the references; a kubectl
Job gets them from the webhook at CREATE). Checked: the references are in the Job and in the pods
the API server stored; the token posts the job's step reports (202) and nothing else (another
job's report, reading or submitting anything: 403); once the job ends the token is refused (401)
and the Secret is gone; silod's identity cannot write a Secret into a namespace that is not a
tenant's (no RoleBinding), so no workload there gets one.
"""

from __future__ import annotations

import base64
import uuid

import httpx
import pytest
from kubernetes import client

from dataplane_helpers import make_dataset
from k8s_testenv import SILOD_SA, ControlPlane, Kubelet, kubectl_job, wait
from sdk_helpers import Served

pytestmark = [pytest.mark.slow]

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
REPORT = {"step_seconds": 0.5, "batch_bytes": 1_000_000}


def _secret(cp: ControlPlane, ns: str, name: str) -> dict | None:
    try:
        got = cp.core.read_namespaced_secret(name, ns)
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return cp.api_client().sanitize_for_serialization(got)


def _data(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def _env_refs(containers: list[dict]) -> dict[str, tuple[str, str]]:
    """SILOD_* variable -> (Secret name, key) of a pod spec's first container."""
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in containers[0].get("env") or [] if (e.get("valueFrom") or {}).get("secretKeyRef")}


@pytest.fixture
def cluster(control_plane: ControlPlane, tmp_path):
    cp = control_plane
    tag = uuid.uuid4().hex[:6]
    alice, bob = f"rt-alice-{tag}", f"rt-bob-{tag}"
    node = f"rt-gpu-{tag}"
    cp.add_namespace(alice, RESTRICTED)
    cp.add_namespace(bob, RESTRICTED)
    cp.add_node(node, 8)
    ds = make_dataset(tmp_path / "remote", n_files=4)
    served = Served(tmp_path, "--backend-opt", f"kubeconfig={cp.kubeconfig(SILOD_SA)}",
                    "--backend-opt", "api-url={url}", "--allow-uri", f"file://{tmp_path / 'remote'}/",
                    "--policy", "fifo", "--gpus", "64", "--gpus-per-node", "8", "--cache", "1TB", "--remote-io", "1GB/s",
                    backend="kubernetes", tokens={alice: f"{alice}-token-0001", bob: f"{bob}-token-0002"})
    try:
        for user in (alice, bob):
            r = httpx.post(f"{served.url}/v1/datasets", json={"name": "ds", "uri": f"file://{ds.root}", "size": ds.total},
                           headers={"Authorization": f"Bearer {served.tokens[user]}"}, timeout=30)
            assert r.status_code == 201, r.text
        yield cp, served, alice, bob, node
    finally:
        served.stop()
        for ns in (alice, bob):
            cp.cleanup_namespace(ns)
        cp.delete_nodes([node])


def test_pods_get_a_token_for_their_own_jobs_reports_only(cluster):
    cp, served, alice, bob, node = cluster
    user = httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.tokens[alice]}"}, timeout=30)

    def submit(name: str) -> str:
        r = user.post("/v1/jobs", json={"name": name, "gpus": 2, "dataset": "ds", "epochs": 1,
                                        "ideal_throughput": "1MB/s", "pod_template": {"image": "trainer:1"}})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    a, b = submit("a"), submit("b")
    secret_a, secret_b = f"silod-report-job-silod-{a}", f"silod-report-job-silod-{b}"

    def state(job_id: str) -> str:
        return user.get(f"/v1/jobs/{job_id}").json()["state"]

    wait(lambda: state(a) == state(b) == "running" and _secret(cp, alice, secret_a) and _secret(cp, alice, secret_b),
         90, lambda: f"both jobs admitted with their Secrets: {state(a)}, {state(b)}; {served.log_tail(1500)}",
         interval=0.5)

    # The Secret: in the job's own namespace, owned by its Job (deleting the Job deletes it).
    job_a = cp.job(alice, f"silod-{a}")
    stored = _secret(cp, alice, secret_a)
    owner = stored["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"], o["uid"]) for o in owner] == [("Job", f"silod-{a}", job_a["metadata"]["uid"])]
    data = _data(stored)
    assert data["server"] == served.url and data["job-id"] == a and data["token"].startswith("silod_")
    assert _secret(cp, bob, secret_a) is None  # nowhere else

    # The env the API server stored, in the Job's template and in the pods its controller made.
    refs = {"SILOD_SERVER": (secret_a, "server"), "SILOD_TOKEN": (secret_a, "token")}
    assert _env_refs(job_a["spec"]["template"]["spec"]["containers"]) == refs
    pods = wait(lambda: [p for p in cp.pods(alice) if (p["metadata"].get("labels") or {}).get("job-name") == f"silod-{a}"],
                60, "the Job controller's pod of job a")
    assert _env_refs(pods[0]["spec"]["containers"]) == refs
    assert {"name": "SILOD_JOB_ID", "value": a} in pods[0]["spec"]["containers"][0]["env"]

    # The pod's token reports its own job's steps to the real silod serve ...
    pod = httpx.Client(base_url=data["server"], headers={"Authorization": f"Bearer {data['token']}"}, timeout=30)
    r = pod.post(f"/v1/jobs/{a}/report", json=REPORT)
    assert r.status_code == 202, r.text
    # ... and does nothing else: not another job's report, not a read, not a submission.
    for method, path, body in (("POST", f"/v1/jobs/{b}/report", REPORT), ("GET", "/v1/jobs", None),
                               ("GET", f"/v1/jobs/{a}", None), ("GET", "/v1/datasets", None),
                               ("POST", "/v1/jobs", {"name": "x", "gpus": 1, "dataset": "ds", "epochs": 1,
                                                     "ideal_throughput": "1MB/s"}),
                               ("DELETE", f"/v1/jobs/{b}", None), ("GET", "/v1/cluster", None)):
        r = pod.request(method, path, json=body)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
    assert state(b) == "running"

    # The job ends (cancelled): its token is refused and its Secret is gone.
    assert user.delete(f"/v1/jobs/{a}").status_code == 200
    wait(lambda: pod.post(f"/v1/jobs/{a}/report", json=REPORT).status_code == 401, 30, "the ended job's token refused",
         interval=0.5)
    wait(lambda: _secret(cp, alice, secret_a) is None, 30, "the ended job's Secret deleted", interval=0.5)
    token_b = _data(_secret(cp, alice, secret_b))["token"]
    r = httpx.post(f"{served.url}/v1/jobs/{b}/report", json=REPORT, headers={"Authorization": f"Bearer {token_b}"})
    assert r.status_code == 202, r.text  # the other job's token still works


def test_a_kubectl_job_gets_the_env_from_the_webhook_and_loses_the_token_when_it_finishes(cluster):
    cp, served, alice, bob, node = cluster
    user = httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.tokens[alice]}"}, timeout=30)
    created = cp.batch.create_namespaced_job(alice, kubectl_job("by-kubectl"))
    stored_env = {e.name: (e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key)
                  for e in created.spec.template.spec.containers[0].env or []}
    secret = "silod-report-job-by-kubectl"
    assert stored_env == {"SILOD_JOB_ID": (secret, "job-id"), "SILOD_SERVER": (secret, "server"),
                          "SILOD_TOKEN": (secret, "token")}

    def job() -> dict | None:
        return next((j for j in user.get("/v1/jobs").json() if j["name"].startswith("job.by-kubectl.")), None)

    wait(lambda: (job() or {}).get("state") == "running" and _secret(cp, alice, secret), 90,
         lambda: f"the kubectl Job admitted with its Secret: {job()}", interval=0.5)
    data = _data(_secret(cp, alice, secret))
    assert data["job-id"] == job()["id"]
    r = httpx.post(f"{served.url}/v1/jobs/{data['job-id']}/report", json=REPORT,
                   headers={"Authorization": f"Bearer {data['token']}"}, timeout=30)
    assert r.status_code == 202, r.text

    # Its pods run and finish (the test plays kubelet, the real Job controller completes the Job).
    cp.start_kube_scheduler()
    kubelet = Kubelet(cp, [node])
    pods = wait(lambda: [p for p in cp.pods(alice) if (p["metadata"].get("labels") or {}).get("job-name") == "by-kubectl"
                         and p["spec"].get("nodeName")], 60, "the pod bound")
    kubelet.step(alice)
    kubelet.finish(alice, pods[0]["metadata"]["name"])
    wait(lambda: (job() or {}).get("state") == "finished", 60, lambda: f"the job finished: {job()}", interval=0.5)
    wait(lambda: httpx.post(f"{served.url}/v1/jobs/{data['job-id']}/report", json=REPORT,
                            headers={"Authorization": f"Bearer {data['token']}"}).status_code == 401, 30,
         "the finished job's token refused", interval=0.5)
    wait(lambda: _secret(cp, alice, secret) is None, 30, "the finished job's Secret deleted", interval=0.5)


def test_silod_cannot_write_a_secret_where_no_tenant_rolebinding_lets_it(control_plane: ControlPlane):
    """deploy/base grants the Secret verbs only through the per-tenant RoleBinding: in a namespace
    without it (another team's, kube-system) silod's own identity is refused by the API server,
    whatever a workload or a REST caller asks for."""
    cp = control_plane
    other = f"rt-other-{uuid.uuid4().hex[:6]}"
    cp.add_namespace(other, tenant=False)
    silod = client.CoreV1Api(cp.api_client(SILOD_SA))
    body = {"metadata": {"name": "silod-report-job-x"}, "stringData": {"token": "t"}}
    for ns in (other, "kube-system"):
        with pytest.raises(client.exceptions.ApiException) as exc:
            silod.create_namespaced_secret(ns, body)
        assert exc.value.status == 403, ns
    # Nor may it read Secrets anywhere, tenants' included (it writes its own, never reads).
    with pytest.raises(client.exceptions.ApiException) as exc:
        silod.list_namespaced_secret(other)
    assert exc.value.status == 403
