"""Living with an install on a REAL control plane (tests/k8s_testenv.py: etcd, kube-apiserver, the
upstream Job controller; "kube-apiserver v1.24.0-alpha snapshot", RBAC on, deploy/base applied,
silod authenticated as its own service account): re-applying the manifests (the documented
upgrade) keeps admission working, and silod's rights to change workloads end at the tenant
namespaces.
"""

from __future__ import annotations

import base64
import json
import ssl
import uuid

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from k8s_testenv import SILOD_SA, ControlPlane, deploy_base_docs

pytestmark = [pytest.mark.slow]

CONFIG = "silod-suspend"


def _manifest_webhook(url: str) -> dict:
    """deploy/base's MutatingWebhookConfiguration as written, except for what the loopback-only
    rule demands: the API server calls `url` on 127.0.0.1 instead of the Service (whatever else
    the manifest's clientConfig holds, a caBundle included, is kept)."""
    doc = next(d for d in deploy_base_docs() if d["kind"] == "MutatingWebhookConfiguration")
    for wh in doc["webhooks"]:
        cc = dict(wh["clientConfig"])
        cc.pop("service")
        cc["url"] = url
        wh["clientConfig"] = cc
    return doc


def _server_side_apply(cp: ControlPlane, doc: dict) -> None:
    """`kubectl apply --server-side --force-conflicts`: the API server's own apply."""
    r = httpx.patch(f"{cp.url}/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{doc['metadata']['name']}",
                    params={"fieldManager": "kubectl", "force": "true"}, content=json.dumps(doc),
                    headers={"Authorization": f"Bearer {cp.tokens['admin']}", "Content-Type": "application/apply-patch+yaml"},
                    verify=ssl.create_default_context(cafile=str(cp.ca)), timeout=30)
    assert r.status_code in (200, 201), r.text


def _client_side_apply(cp: ControlPlane, doc: dict) -> None:
    """What client-side `kubectl apply` sends for a changed manifest: a strategic merge patch of its
    fields (webhooks merge by name), so a field the manifest does not carry is left alone."""
    client.AdmissionregistrationV1Api(cp.api_client()).patch_mutating_webhook_configuration(
        doc["metadata"]["name"], {"webhooks": doc["webhooks"]})


def _submit(cp: ControlPlane, ns: str, name: str) -> dict:
    """A labelled Job as a user creates it (suspend: false): the webhook must suspend it."""
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": name, "labels": {"silod.io/queue": "default"}},
           "spec": {"suspend": False, "template": {"spec": {"restartPolicy": "Never", "containers": [
               {"name": "c", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}
    got = client.BatchV1Api(cp.api_client()).create_namespaced_job(ns, job)
    return cp.api_client().sanitize_for_serialization(got)


def test_reapplying_the_manifests_keeps_the_webhook_working(control_plane: ControlPlane):
    """Install (the configuration as the manifest has it), silod starts and writes its CA, a user
    submits; the operator re-applies the manifests both ways kubectl does (the upgrade in
    docs/kubernetes.md); every submission after is still admitted suspended. On the code before
    this check the manifest carried `caBundle: ""` and nothing wrote it: the first submission
    already failed on the certificate."""
    from scheduler.backends.kubernetes import load_api_client
    from scheduler.backends.kubernetes.cabundle import CaBundleKeeper

    cp = control_plane
    admission = client.AdmissionregistrationV1Api(cp.api_client())
    # The test control plane's own webhook CA (the fixture put it in the bundle): our "replica".
    before = admission.read_mutating_webhook_configuration(CONFIG)
    ca_pem = base64.b64decode(before.webhooks[0].client_config.ca_bundle)
    ns = f"up-{uuid.uuid4().hex[:8]}"
    cp.add_namespace(ns)
    keeper = CaBundleKeeper(load_api_client(kubeconfig=str(cp.kubeconfig(SILOD_SA))), ca_pem, CONFIG, interval_s=3600)
    try:
        # A fresh install: the configuration exactly as deploy/base has it.
        admission.delete_mutating_webhook_configuration(CONFIG)
        _server_side_apply(cp, _manifest_webhook(cp.webhook.url))
        installed = admission.read_mutating_webhook_configuration(CONFIG)
        assert not installed.webhooks[0].client_config.ca_bundle  # the manifest carries none
        keeper.start()  # what `silod serve --webhook-listen` does at start, as silod's service account
        assert keeper.writes == 1
        assert _submit(cp, ns, "first")["spec"]["suspend"] is True
        # The upgrade: apply the same manifests again, server-side and client-side.
        _server_side_apply(cp, _manifest_webhook(cp.webhook.url))
        assert _submit(cp, ns, "after-server-side-apply")["spec"]["suspend"] is True
        _client_side_apply(cp, _manifest_webhook(cp.webhook.url))
        assert _submit(cp, ns, "after-client-side-apply")["spec"]["suspend"] is True
        keeper.check()
        assert keeper.writes == 1  # nothing was lost, so nothing was rewritten
        # An apply of an older manifest that still carried `caBundle: ""` wipes it: the next
        # check (every minute in silod serve) repairs it.
        old = _manifest_webhook(cp.webhook.url)
        for wh in old["webhooks"]:
            wh["clientConfig"]["caBundle"] = ""
        _server_side_apply(cp, old)
        with pytest.raises(ApiException) as refused:
            _submit(cp, ns, "while-wiped")
        assert refused.value.status == 500 and "x509" in refused.value.body
        keeper.check()
        assert keeper.writes == 2
        assert _submit(cp, ns, "repaired")["spec"]["suspend"] is True
    finally:
        keeper.stop()
        restore_ca_bundle(cp, ca_pem)
        cp.cleanup_namespace(ns)


def restore_ca_bundle(cp: ControlPlane, ca_pem: bytes) -> None:
    """Leave the shared control plane's webhook configuration as the fixture made it (its CA in
    every webhook's caBundle), whatever a test applied over it."""
    admission = client.AdmissionregistrationV1Api(cp.api_client())
    cfg = admission.read_mutating_webhook_configuration(CONFIG)
    for i, wh in enumerate(cfg.webhooks):
        if base64.b64decode(wh.client_config.ca_bundle or "") != ca_pem:
            admission.patch_mutating_webhook_configuration(CONFIG, [
                {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": base64.b64encode(ca_pem).decode()}])


def test_silod_changes_workloads_only_in_tenant_namespaces(control_plane: ControlPlane):
    """deploy/base's RBAC, on the real API server: silod's service account reads Jobs everywhere
    but may update, patch or suspend them only where a tenant's RoleBinding
    (workloads-namespace.yaml) grants it; kube-system is not such a place."""
    cp = control_plane
    tenant, other = f"rb-{uuid.uuid4().hex[:8]}", f"plain-{uuid.uuid4().hex[:8]}"
    cp.add_namespace(tenant)
    cp.add_namespace(other, tenant=False)
    admin, silod = client.BatchV1Api(cp.api_client()), client.BatchV1Api(cp.api_client(SILOD_SA))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
           "spec": {"suspend": True, "template": {"spec": {"restartPolicy": "Never",
                                                           "containers": [{"name": "c", "image": "x"}]}}}}
    try:
        for ns in (tenant, other, "kube-system"):
            job["metadata"]["name"] = f"j-{uuid.uuid4().hex[:6]}"
            admin.create_namespaced_job(ns, job)
            assert silod.read_namespaced_job(job["metadata"]["name"], ns).metadata.name  # reads everywhere
            patch = {"spec": {"suspend": False}}
            if ns == tenant:
                silod.patch_namespaced_job(job["metadata"]["name"], ns, patch)
                silod.patch_namespaced_job_status(job["metadata"]["name"], ns, {"status": {}})
            else:
                for call in (lambda: silod.patch_namespaced_job(job["metadata"]["name"], ns, patch),
                             lambda: silod.patch_namespaced_job_status(job["metadata"]["name"], ns, {"status": {}})):
                    with pytest.raises(ApiException) as denied:
                        call()
                    assert denied.value.status == 403, (ns, denied.value.body)
            admin.delete_namespaced_job(job["metadata"]["name"], ns, propagation_policy="Background")
    finally:
        cp.cleanup_namespace(tenant)
        cp.cleanup_namespace(other)
