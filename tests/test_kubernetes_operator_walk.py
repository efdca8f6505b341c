"""The operator's walk through docs/kubernetes.md, in its order, on ONE real control plane
(tests/k8s_testenv.py: etcd, "kube-apiserver v1.24.0-alpha snapshot" with its Job controller and
kube-scheduler, RBAC on, deploy/base applied, silod authenticated as its own service account),
checking at each step what an operator checks:

1. Install: the webhook configuration exactly as deploy/base has it (no caBundle), silod writes
   its CA at start (the `CaBundleKeeper` that `silod serve --webhook-listen` runs), a tenant
   namespace as workloads-namespace.yaml makes it, one 4-GPU node; /v1/cluster shows its GPUs.
2. Submit: a REST job (POST /v1/jobs) and a labelled Job created running "with kubectl" (stored
   suspended by the webhook); both are admitted and their pods run on the node.
3. Agent restart: the kubectl Job's dataset mount propagation, as the API server stored it, is
   the one a reader's container gets; the real `silod agent` is SIGKILLed under the reader and
   started again; the reader gets its data back, every byte checked
   (tests/test_kubernetes_agent_restart.py's mechanism).
4. Upgrade: the manifests re-applied server-side and client-side; a new REST job and a new
   labelled Job are still admitted (201, stored suspended), and silod had nothing to rewrite.
5. Add a node: a second 4-GPU Node; the next round plans on it (/v1/cluster lists it) and the
   two jobs waiting since step 4 run there (node a is full). /v1/cluster lists each node with its
   free GPUs, and its `gpus.total` grows from 4 to 8 (what the Ready nodes offer; --gpus only caps it).
6. Delete a job: `kubectl delete job`; its silod job ends (failed, "... was deleted") within a
   round and its GPUs are free.

What the test environment cannot do, and is therefore not in the walk: building and pushing the
image and running the Deployments/DaemonSet (no kubelet, no container runtime, no registry: the
image build is tests/test_image.py; here silod serve runs in-process as the scheduler
Deployment would run it, and the agent as a host process); `kubectl rollout status` (no
controller manager); the Service route to the webhook (loopback-only rule: the API server calls
it by `url: https://127.0.0.1:PORT`); the agent in step 3 reads its dataset catalog from a file
instead of asking the scheduler (its data path is what is under test there). The test plays the
kubelet (tests/k8s_testenv.py, Kubelet). Waits are on conditions, generous for a loaded 2-core
machine.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import threading
import uuid

import httpx
import pytest
from kubernetes import client

from dataplane_helpers import make_dataset, require_fuse
from k8s_testenv import SILOD_SA, ControlPlane, Kubelet, free_port, kubectl_job, wait

try:
    from test_kubernetes_agent_restart import restart_agent_under_reader
    from test_kubernetes_upgrade import CONFIG, _client_side_apply, _manifest_webhook, _server_side_apply, restore_ca_bundle
except ImportError:
    from tests.test_kubernetes_agent_restart import restart_agent_under_reader
    from tests.test_kubernetes_upgrade import CONFIG, _client_side_apply, _manifest_webhook, _server_side_apply, restore_ca_bundle

pytestmark = [pytest.mark.slow, pytest.mark.fuse]

ADMIN_TOKEN = "admin-token-walk-0123456789"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


def test_the_operator_walk_of_docs_kubernetes_md(control_plane: ControlPlane, tmp_path):
    require_fuse()
    if os.geteuid() != 0:
        pytest.fail("bind mounts need root") if os.environ.get("CI", "").lower() == "true" else pytest.skip("needs root")
    from scheduler.backends.kubernetes import load_api_client
    from scheduler.backends.kubernetes.cabundle import CaBundleKeeper
    from scheduler.service.api.app import create_app
    from scheduler.service.api.auth import TokenStore, load_token_key
    from scheduler.service.cli import build_service
    import uvicorn

    cp = control_plane
    cp.start_kube_scheduler()
    admission = client.AdmissionregistrationV1Api(cp.api_client())
    ca_pem = base64.b64decode(admission.read_mutating_webhook_configuration(CONFIG).webhooks[0].client_config.ca_bundle)
    ns = f"walk-{uuid.uuid4().hex[:8]}"
    a, b = f"{ns}-a", f"{ns}-b"
    user_token = f"{ns}-token-0001"
    nodes: list[str] = []
    keeper = server = thread = None
    service = None
    try:
        # --- 1. install -----------------------------------------------------------------------
        admission.delete_mutating_webhook_configuration(CONFIG)
        _server_side_apply(cp, _manifest_webhook(cp.webhook.url))  # `kubectl apply -k` of deploy/base's webhook
        assert not admission.read_mutating_webhook_configuration(CONFIG).webhooks[0].client_config.ca_bundle
        keeper = CaBundleKeeper(load_api_client(kubeconfig=str(cp.kubeconfig(SILOD_SA))), ca_pem, CONFIG, interval_s=3600)
        keeper.start()  # silod serve at start, as its own service account
        assert admission.read_mutating_webhook_configuration(CONFIG).webhooks[0].client_config.ca_bundle  # Verify's check
        cp.add_namespace(ns, RESTRICTED)  # install step 5: the tenant's namespace and RoleBinding
        nodes.append(a)
        cp.add_node(a, 4)
        ds = make_dataset(tmp_path / "remote", n_files=4)
        tokens = tmp_path / "tokens"
        tokens.write_text(f"{ns}:{user_token}\n")
        service = build_service(db=f"sqlite:///{tmp_path / 'silod.db'}", backend="kubernetes", policy="fifo",
                                round_s=4.0, gpus="64", gpus_per_node="8", cache="1TB", remote_io="1GB/s",
                                state_dir=tmp_path / "state", backend_opts={"kubeconfig": str(cp.kubeconfig(SILOD_SA))},
                                allowed_uris=[f"file://{tmp_path / 'remote'}/"])
        service.config = dataclasses.replace(service.config, poll_seconds=0.2, min_event_gap_s=0.5)
        store = TokenStore(service.engine, load_token_key(tmp_path / "token-key"), admin_token=ADMIN_TOKEN)
        store.import_file(tokens)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(service, store, run_loop=True), host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait(lambda: server.started, 60, "silod serve")
        url = f"http://127.0.0.1:{port}"
        op = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        user = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {user_token}"}, timeout=30)
        kubelet = Kubelet(cp, [a, b])

        def cluster() -> dict:
            r = op.get("/v1/cluster")
            assert r.status_code == 200, r.text
            return r.json()

        # The round plans on the nodes /v1/cluster lists (each with its free GPUs), and its
        # `gpus.total` is what they offer (the --gpus flag, 64, only caps it).
        wait(lambda: {n["name"]: n["gpus"] for n in cluster()["nodes"]}.get(a) == 4, 60, "the node in /v1/cluster",
             interval=0.5)
        assert cluster()["gpus"]["total"] == 4

        # --- 2. submit a REST job and a kubectl Job; both run ----------------------------------
        r = user.post("/v1/datasets", json={"name": "ds", "uri": f"file://{ds.root}", "size": ds.total})
        assert r.status_code == 201, r.text

        def submit_rest(name: str) -> str:
            r = user.post("/v1/jobs", json={"name": name, "gpus": 2, "dataset": "ds", "epochs": 1,
                                            "ideal_throughput": "1MB/s", "pod_template": {"image": "trainer:1"}})
            assert r.status_code == 201, r.text
            return r.json()["id"]

        def submit_kubectl(name: str) -> None:
            created = cp.batch.create_namespaced_job(ns, kubectl_job(name))
            assert created.spec.suspend is True, name  # the webhook stored it suspended

        def job_state(workload: str) -> dict | None:
            r = user.get("/v1/jobs")
            assert r.status_code == 200, r.text
            jobs = r.json()
            # A REST job's Job is silod-<id>; a kubectl one's silod job is named job.<name>.<uid>.
            return next((j for j in jobs if j["name"].startswith(f"job.{workload}.") or f"silod-{j['id']}" == workload),
                        None)

        def running(workloads: list[str]) -> bool:
            kubelet.step(ns)
            pods = {(p["metadata"].get("labels") or {}).get("job-name") for p in cp.pods(ns)
                    if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}
            states = [job_state(w) for w in workloads]
            return set(workloads) <= pods and all(s and s["state"] == "running" for s in states)

        def states() -> list:
            return [(j["name"], j["state"], j.get("message")) for j in user.get("/v1/jobs").json()]

        rest1 = f"silod-{submit_rest('by-rest')}"
        submit_kubectl("by-kubectl")
        wait(lambda: running([rest1, "by-kubectl"]), 120, lambda: f"both first jobs to run: {states()}", interval=0.5)
        assert cluster()["gpus"]["used"] == 4

        # --- 3. restart the agent under a reader ------------------------------------------------
        stored = cp.batch.read_namespaced_job("by-kubectl", ns)
        propagation = stored.spec.template.spec.containers[0].volume_mounts[0].mount_propagation
        assert propagation == "HostToContainer"
        (tmp_path / "restart").mkdir()
        final = restart_agent_under_reader(tmp_path / "restart", propagation)
        assert final["mismatches"] == 0 and final["passes"] > 0, final

        # --- 4. upgrade: re-apply the manifests, submit again -----------------------------------
        _server_side_apply(cp, _manifest_webhook(cp.webhook.url))
        _client_side_apply(cp, _manifest_webhook(cp.webhook.url))
        rest2 = f"silod-{submit_rest('by-rest-2')}"
        submit_kubectl("by-kubectl-2")  # admission still works: created, stored suspended
        keeper.check()
        assert keeper.writes == 1  # the re-apply left silod's caBundle alone
        assert cp.batch.read_namespaced_job(rest2, ns).spec.suspend is True  # no GPUs left: waits

        # --- 5. add a node: capacity grows in the next round, the waiting jobs run ---------------
        nodes.append(b)
        cp.add_node(b, 4)
        wait(lambda: b in {n["name"] for n in cluster()["nodes"]}, 60, lambda: f"the new node: {cluster()['nodes']}",
             interval=0.5)
        assert cluster()["gpus"]["total"] == 8
        wait(lambda: running([rest2, "by-kubectl-2"]), 120, lambda: f"the second jobs to run: {states()}", interval=0.5)
        second = {(p["metadata"].get("labels") or {}).get("job-name"): p["spec"].get("nodeName") for p in cp.pods(ns)
                  if (p["metadata"].get("labels") or {}).get("job-name") in (rest2, "by-kubectl-2")}
        assert set(second.values()) == {b}, second  # node a is full: they run on the new one
        assert cluster()["gpus"]["used"] == 8

        # --- 6. delete a job's workload: its silod job ends within a round --------------------
        cp.batch.delete_namespaced_job("by-kubectl", ns, propagation_policy="Background")
        wait(lambda: (job_state("by-kubectl") or {}).get("state") not in ("running", "queued", None), 30,
             lambda: f"the deleted Job's silod job to end: {job_state('by-kubectl')}", interval=0.5)
        ended = job_state("by-kubectl")
        assert ended["state"] == "failed" and "was deleted" in (ended.get("message") or ""), ended
        wait(lambda: cluster()["gpus"]["used"] == 6, 30, lambda: f"its GPUs freed: {cluster()['gpus']}", interval=0.5)
    finally:
        if keeper is not None:
            keeper.stop()
        if server is not None:
            server.should_exit = True
            thread.join(30)
        if service is not None:
            service.close()
        restore_ca_bundle(cp, ca_pem)
        try:
            cp.cleanup_namespace(ns)
        except Exception:  # noqa: BLE001 - the namespace may not exist if install failed early
            pass
        cp.delete_nodes(nodes)
