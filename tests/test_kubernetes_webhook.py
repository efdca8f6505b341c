"""The mutating admission webhook: real HTTPS, real AdmissionReview v1 bodies, and the emulated
API server (tests/k8s_emulator.py; no real cluster can run here) calling it on CREATE through the
MutatingWebhookConfiguration of deploy/base, so a Job created running is stored suspended before
any pod exists."""

from __future__ import annotations

import base64
import copy
import json
import ssl
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from k8s_emulator import EmulatedCluster, json_patch
from scheduler.backends.kubernetes.webhook import BadReview, WebhookServer, review_response
from scheduler.backends.kubernetes.workloads import report_env
from tls_helpers import issue, make_ca

try:
    from test_kubernetes_admission import RESTRICTED, SAFE_CONTAINER, kubectl_job
except ImportError:
    from tests.test_kubernetes_admission import RESTRICTED, SAFE_CONTAINER, kubectl_job

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SVC_DNS = "silod-scheduler.silod-system.svc"


def review(obj: dict, *, kind: str = "Job", group: str = "batch", version: str = "v1", op: str = "CREATE") -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": kind.lower() + "s"},
        "operation": op, "userInfo": {"username": "alice"}, "object": obj, "namespace": "alice",
        "name": obj["metadata"]["name"]}}


def patched(body: dict, answer: dict) -> dict:
    resp = answer["response"]
    assert resp["uid"] == body["request"]["uid"] and resp["allowed"] is True
    if "patch" not in resp:
        return body["request"]["object"]
    assert resp["patchType"] == "JSONPatch"
    return json_patch(copy.deepcopy(body["request"]["object"]), json.loads(base64.b64decode(resp["patch"])))


# --- the decision, pure ------------------------------------------------------------------------

@pytest.mark.parametrize("spec_suspend", [False, None])
def test_a_labelled_job_created_running_gets_suspended(spec_suspend):
    job = kubectl_job("eager", suspend=False)
    if spec_suspend is None:
        del job["spec"]["suspend"]
    body = review(job)
    assert patched(body, review_response(body))["spec"]["suspend"] is True


def test_pytorchjob_is_suspended_through_run_policy_and_jobset_through_spec():
    ptj = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": "p", "namespace": "alice", "labels": {"silod.io/queue": "default"}},
           "spec": {"pytorchReplicaSpecs": {}}}
    body = review(ptj, kind="PyTorchJob", group="kubeflow.org")
    assert patched(body, review_response(body))["spec"]["runPolicy"] == {"suspend": True}
    js = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": {"name": "s", "namespace": "alice", "labels": {"silod.io/queue": "q"}}, "spec": {"suspend": False}}
    body = review(js, kind="JobSet", group="jobset.x-k8s.io", version="v1alpha2")
    assert patched(body, review_response(body))["spec"]["suspend"] is True


@pytest.mark.parametrize("case", ["unlabelled", "already-suspended", "update", "other-kind", "same-kind-other-group"])
def test_no_patch_when_there_is_nothing_to_do(case):
    job = kubectl_job("j", suspend=case == "already-suspended")
    kw: dict = {}
    if case == "unlabelled":
        del job["metadata"]["labels"]["silod.io/queue"]
    if case == "update":
        kw["op"] = "UPDATE"
    if case == "other-kind":
        kw.update(kind="Deployment", group="apps")
    if case == "same-kind-other-group":
        kw.update(group="example.com")
    if case == "already-suspended":  # nothing to suspend; its silod volume's mount still gets HostToContainer
        for c in job["spec"]["template"]["spec"]["containers"]:
            for m in c.get("volumeMounts") or []:
                m["mountPropagation"] = "HostToContainer"
            c["env"] = report_env("silod-report-job-j")  # and its containers the reporter's variables
    answer = review_response(review(job, **kw))
    assert answer["response"]["allowed"] is True and "patch" not in answer["response"]


def test_every_container_gets_the_reporters_variables_from_the_jobs_report_secret():
    """SILOD_JOB_ID, SILOD_SERVER and SILOD_TOKEN from Secret silod-report-<kind>-<name> (written
    when silod admits the workload); a variable the owner set stays the owner's."""
    job = kubectl_job("j")
    containers = job["spec"]["template"]["spec"]["containers"]
    containers.append({**copy.deepcopy(containers[0]), "name": "side", "env": [{"name": "SILOD_SERVER", "value": "mine"}]})
    body = review(job)
    got = patched(body, review_response(body))["spec"]["template"]["spec"]["containers"]
    refs = {(e["name"], e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"],
             e["valueFrom"]["secretKeyRef"]["optional"]) for e in got[0]["env"]}
    assert refs == {("SILOD_JOB_ID", "silod-report-job-j", "job-id", True),
                    ("SILOD_SERVER", "silod-report-job-j", "server", True),
                    ("SILOD_TOKEN", "silod-report-job-j", "token", True)}
    assert got[1]["env"][0] == {"name": "SILOD_SERVER", "value": "mine"}
    assert [e["name"] for e in got[1]["env"]] == ["SILOD_SERVER", "SILOD_JOB_ID", "SILOD_TOKEN"]
    ptj = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": "p", "namespace": "alice", "labels": {"silod.io/queue": "default"}},
           "spec": {"pytorchReplicaSpecs": {"Worker": {"template": {"spec": {"containers": [{"name": "w"}]}}}}}}
    body = review(ptj, kind="PyTorchJob", group="kubeflow.org")
    env = patched(body, review_response(body))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env} == {"silod-report-pytorchjob-p"}


def test_every_mount_of_a_silod_volume_gets_host_to_container_propagation():
    """So a pod keeps its data across node agent restarts (tests/test_kubernetes_agent_restart.py
    shows it with real mounts); other volumes and a propagation the owner chose are left alone."""
    silod_vol = {"name": "data", "csi": {"driver": "silod.io", "readOnly": True, "volumeAttributes": {"dataset": "d"}}}
    other_vol = {"name": "scratch", "emptyDir": {}}
    pod = {"containers": [{"name": "a", "image": "x", "volumeMounts": [
        {"name": "scratch", "mountPath": "/s"}, {"name": "data", "mountPath": "/data", "readOnly": True}]},
        {"name": "b", "image": "x", "volumeMounts": [{"name": "data", "mountPath": "/d", "mountPropagation": "None"}]}],
        "initContainers": [{"name": "i", "image": "x", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "volumes": [other_vol, silod_vol]}
    job = kubectl_job("j", suspend=False)
    job["spec"]["template"]["spec"] = copy.deepcopy(pod)
    body = review(job)
    got = patched(body, review_response(body))["spec"]["template"]["spec"]
    assert got["containers"][0]["volumeMounts"][1]["mountPropagation"] == "HostToContainer"
    assert "mountPropagation" not in got["containers"][0]["volumeMounts"][0]
    assert got["containers"][1]["volumeMounts"][0]["mountPropagation"] == "None"  # the owner's choice
    assert got["initContainers"][0]["volumeMounts"][0]["mountPropagation"] == "HostToContainer"
    ptj = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": "p", "namespace": "alice", "labels": {"silod.io/queue": "default"}},
           "spec": {"pytorchReplicaSpecs": {"Master": {"template": {"spec": copy.deepcopy(pod)}},
                                            "Wor/ker": {"template": {"spec": copy.deepcopy(pod)}}}}}
    body = review(ptj, kind="PyTorchJob", group="kubeflow.org")
    out = patched(body, review_response(body))["spec"]["pytorchReplicaSpecs"]
    for role in ("Master", "Wor/ker"):
        assert out[role]["template"]["spec"]["containers"][0]["volumeMounts"][1]["mountPropagation"] == "HostToContainer"
    js = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": {"name": "s", "namespace": "alice", "labels": {"silod.io/queue": "q"}},
          "spec": {"replicatedJobs": [{"name": "w", "template": {"spec": {"template": {"spec": copy.deepcopy(pod)}}}}]}}
    body = review(js, kind="JobSet", group="jobset.x-k8s.io", version="v1alpha2")
    out = patched(body, review_response(body))["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert out["containers"][0]["volumeMounts"][1]["mountPropagation"] == "HostToContainer"


@pytest.mark.parametrize("bad", [
    None, [], "x", {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"kind": {"kind": "Job"}}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 5}},
])
def test_malformed_reviews_are_refused(bad):
    with pytest.raises(BadReview):
        review_response(bad)


# --- over real HTTPS ------------------------------------------------------------------------------

@pytest.fixture
def pki(tmp_path):
    ca = make_ca(tmp_path / "pki", "webhook-ca")
    serving = issue(ca, tmp_path / "pki", "webhook", dns=(SVC_DNS,), ips=("127.0.0.1",))
    apiserver_ca = make_ca(tmp_path / "pki", "apiserver-client-ca")
    apiserver = issue(apiserver_ca, tmp_path / "pki", "kube-apiserver", client=True)
    stranger_ca = make_ca(tmp_path / "pki", "stranger-ca")
    stranger = issue(stranger_ca, tmp_path / "pki", "stranger", client=True)
    return {"ca": ca, "serving": serving, "apiserver_ca": apiserver_ca, "apiserver": apiserver, "stranger": stranger}


@pytest.fixture
def webhook(pki):
    server = WebhookServer("127.0.0.1", 0, pki["serving"].cert, pki["serving"].key, max_body=64 * 1024).start()
    yield server
    server.stop()


def client(pki, cert=None) -> httpx.Client:  # type: ignore[no-untyped-def]
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return httpx.Client(verify=ctx, timeout=10)


def test_https_review_round_trip(pki, webhook):
    body = review(kubectl_job("eager", suspend=False))
    with client(pki) as c:
        r = c.post(webhook.url, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["apiVersion"] == "admission.k8s.io/v1" and r.json()["kind"] == "AdmissionReview"
    assert patched(body, r.json())["spec"]["suspend"] is True
    assert webhook.app.reviews == 1


def test_bad_bodies_get_4xx_and_the_server_keeps_serving(pki, webhook):
    with client(pki) as c:
        assert c.post(webhook.url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
        assert c.post(webhook.url, json={"kind": "AdmissionReview"}).status_code == 400
        assert c.post(webhook.url, content=b"[]" * 10, headers={"content-type": "text/plain"}).status_code == 415
        deep = b"[" * 100_000 + b"]" * 100_000
        assert c.post(webhook.url, content=deep, headers={"content-type": "application/json"}).status_code == 413
        nested = b"[" * 30_000 + b"]" * 30_000  # under the cap, deeper than the parser allows
        assert c.post(webhook.url, content=nested, headers={"content-type": "application/json"}).status_code == 400

        def chunks():  # no Content-Length: counted while it streams in
            for _ in range(100):
                yield b" " * 1024
        assert c.post(webhook.url, content=chunks(), headers={"content-type": "application/json"}).status_code == 413
        assert c.get(webhook.url).status_code == 405
        good = review(kubectl_job("after", suspend=False))
        assert patched(good, c.post(webhook.url, json=good).json())["spec"]["suspend"] is True


def test_plain_http_and_untrusted_certificates_do_not_work(pki, webhook):
    with pytest.raises(httpx.HTTPError):
        httpx.post(webhook.url.replace("https://", "http://"), json={}, timeout=5)
    with pytest.raises(httpx.ConnectError):  # a client that trusts another CA refuses our certificate
        other = make_ca(Path(pki["ca"].cert).parent / "other", "other-ca")
        httpx.post(webhook.url, json={}, verify=ssl.create_default_context(cafile=str(other.cert)), timeout=5)


def test_with_a_client_ca_only_the_api_server_certificate_gets_in(pki):
    server = WebhookServer("127.0.0.1", 0, pki["serving"].cert, pki["serving"].key,
                           client_ca=pki["apiserver_ca"].cert).start()
    try:
        body = review(kubectl_job("eager", suspend=False))
        with client(pki, pki["apiserver"]) as c:
            assert patched(body, c.post(server.url, json=body).json())["spec"]["suspend"] is True
        for cert in (None, pki["stranger"]):
            with pytest.raises(httpx.HTTPError), client(pki, cert) as c:
                c.post(server.url, json=body)
        assert server.app.reviews == 1
    finally:
        server.stop()


# --- the emulated API server calls it ---------------------------------------------------------------

def install_webhook(cluster: EmulatedCluster, pki, server: WebhookServer, failure_policy: str | None = None) -> dict:
    """deploy/base's MutatingWebhookConfiguration, with the caBundle cert-manager would inject."""
    cfg = next(d for d in yaml.safe_load_all((DEPLOY / "base" / "webhook.yaml").read_text()) if d)
    cfg["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(pki["ca"].pem()).decode()
    if failure_policy:
        cfg["webhooks"][0]["failurePolicy"] = failure_policy
    cluster.call(lambda em: em.webhook_services.__setitem__(("silod-system", "silod-scheduler"),
                                                            ("127.0.0.1", server.port)))
    res = ("admissionregistration.k8s.io", "mutatingwebhookconfigurations")
    return cluster.call(lambda em: em.create(em.resources[res], None, cfg))


def test_the_emulated_api_server_stores_a_labelled_job_suspended_and_no_pod_starts(pki, webhook):
    with EmulatedCluster() as cluster:
        cluster.add_namespace("alice", RESTRICTED)
        cluster.add_node("n1", 4)
        install_webhook(cluster, pki, webhook)
        jobs = ("batch", "jobs")
        cluster.call(lambda em: em.create(em.resources[jobs], "alice", kubectl_job("eager", suspend=False)))
        plain = kubectl_job("plain", suspend=False)
        del plain["metadata"]["labels"]["silod.io/queue"]
        cluster.call(lambda em: em.create(em.resources[jobs], "alice", plain))
        # The first version ever stored is suspended; the unlabelled Job was not sent at all.
        first = next(obj for _rv, key, kind, obj in cluster.call(lambda em: list(em.history))
                     if key == jobs and kind == "ADDED" and obj["metadata"]["name"] == "eager")
        assert first["spec"]["suspend"] is True
        assert cluster.em.webhook_calls == [("suspend.silod.io", "CREATE", "Job/eager", True)]
        cluster.wait(lambda: cluster.pods_of("alice", "plain"), what="the unlabelled Job's pods")
        assert not cluster.pods_of("alice", "eager")
        assert webhook.app.reviews == 1


def test_failure_policy_fail_refuses_labelled_creates_while_the_webhook_is_down(pki, webhook):
    with EmulatedCluster() as cluster:
        cluster.add_namespace("alice", RESTRICTED)
        install_webhook(cluster, pki, webhook)
        cluster.call(lambda em: em.webhook_services.__setitem__(("silod-system", "silod-scheduler"),
                                                                ("127.0.0.1", 1)))  # nothing listens there
        from k8s_emulator import ApiError

        with pytest.raises(ApiError, match="failed calling webhook"):
            cluster.call(lambda em: em.create(em.resources[("batch", "jobs")], "alice",
                                              kubectl_job("eager", suspend=False)))
        assert not cluster.objects("jobs", group="batch", namespace="alice")


def test_the_api_server_checks_the_serving_certificate_against_the_ca_bundle(pki, webhook, tmp_path):
    """A webhook configuration whose caBundle is another CA's: the API server refuses to talk."""
    with EmulatedCluster() as cluster:
        cluster.add_namespace("alice", RESTRICTED)
        cfg = install_webhook(cluster, pki, webhook)
        other = make_ca(tmp_path / "other", "other-ca")

        def swap(em):  # type: ignore[no-untyped-def]
            res = em.resources[("admissionregistration.k8s.io", "mutatingwebhookconfigurations")]
            new = copy.deepcopy(cfg)
            new["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(other.pem()).decode()
            em.replace(res, None, cfg["metadata"]["name"], new)
        cluster.call(swap)
        from k8s_emulator import ApiError

        with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED"):
            cluster.call(lambda em: em.create(em.resources[("batch", "jobs")], "alice",
                                              kubectl_job("eager", suspend=False)))
        assert webhook.app.reviews == 0


def test_serve_refuses_a_webhook_without_certificates(tmp_path):
    import subprocess

    from dataplane_helpers import silod_cmd

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*silod_cmd(), "serve", "--state-dir", str(tmp_path), *args], capture_output=True,
                              text=True, timeout=120)
    r = serve("--backend", "kubernetes", "--webhook-listen", "127.0.0.1:0")
    assert r.returncode == 2 and "--webhook-cert and --webhook-key" in r.stderr, r.stderr
    r = serve("--backend", "local", "--webhook-listen", "127.0.0.1:0", "--webhook-cert", "x", "--webhook-key", "y")
    assert r.returncode == 2 and "--backend kubernetes" in r.stderr, r.stderr
    r = serve("--backend", "kubernetes", "--webhook-listen", "127.0.0.1:0", "--webhook-cert", str(tmp_path / "nope"),
              "--webhook-key", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr


# --- UPDATE: only silod's admission unsuspends a queued workload --------------------------------

SILOD_SA = "system:serviceaccount:silod-system:silod-scheduler"


def update_review(old: dict, new: dict, user: str, **kw) -> dict:  # type: ignore[no-untyped-def]
    body = review(new, op="UPDATE", **kw)
    body["request"]["oldObject"] = old
    body["request"]["userInfo"] = {"username": user}
    return body


@pytest.mark.parametrize("user,allowed", [("alice", False), ("system:anonymous", False), (SILOD_SA, True)])
def test_unsuspending_a_queued_job_is_silods_alone(user, allowed):
    old = kubectl_job("q", suspend=True)
    new = kubectl_job("q", suspend=False)
    answer = review_response(update_review(old, new, user), frozenset({SILOD_SA}))["response"]
    assert answer["allowed"] is allowed and "patch" not in answer
    if not allowed:
        assert answer["status"]["code"] == 403 and "only silod's admission may unsuspend" in answer["status"]["message"]


def test_other_updates_pass():
    admitters = frozenset({SILOD_SA})
    running, queued = kubectl_job("q", suspend=False), kubectl_job("q", suspend=True)
    assert review_response(update_review(running, queued, "alice"), admitters)["response"]["allowed"]  # suspending
    edited = copy.deepcopy(queued)
    edited["metadata"]["annotations"]["note"] = "x"
    assert review_response(update_review(queued, edited, "alice"), admitters)["response"]["allowed"]
    plain_old, plain_new = copy.deepcopy(queued), copy.deepcopy(running)
    for o in (plain_old, plain_new):
        del o["metadata"]["labels"]["silod.io/queue"]
    assert review_response(update_review(plain_old, plain_new, "alice"), admitters)["response"]["allowed"]
    # Dropping the label in the same update does not help.
    assert not review_response(update_review(queued, plain_new, "alice"), admitters)["response"]["allowed"]
    ptj_old = {"metadata": {"name": "p", "labels": {"silod.io/queue": "q"}}, "spec": {"runPolicy": {"suspend": True}}}
    ptj_new = {"metadata": {"name": "p", "labels": {"silod.io/queue": "q"}}, "spec": {"runPolicy": {"suspend": False}}}
    assert not review_response(update_review(ptj_old, ptj_new, "alice", kind="PyTorchJob", group="kubeflow.org"),
                               admitters)["response"]["allowed"]


def test_through_the_api_server_the_owner_cannot_unsuspend_but_silod_admits(pki, tmp_path):
    """The emulated API server sends UPDATE reviews with the request's user; silod's backend
    talks to it with its service account's token, the owner as `alice`."""
    from k8s_emulator import ApiError
    from scheduler.service.cli import build_service

    try:
        from test_kubernetes_admission import ROOT, job_named, step
    except ImportError:
        from tests.test_kubernetes_admission import ROOT, job_named, step

    server = WebhookServer("127.0.0.1", 0, pki["serving"].cert, pki["serving"].key,
                           admitters=frozenset({SILOD_SA})).start()
    try:
        with EmulatedCluster() as cluster:
            cluster.add_namespace("alice", RESTRICTED)
            cluster.add_node("n1", 4)
            cluster.call(lambda em: em.users.__setitem__("scheduler-sa-token", SILOD_SA))
            install_webhook(cluster, pki, server)
            (tmp_path / "sa-token").write_text("scheduler-sa-token\n")
            service = build_service(db=f"sqlite:///{tmp_path / 'k.db'}", backend="kubernetes", policy="fifo",
                                    round_s=360, gpus="4", gpus_per_node="4", cache="100GB", remote_io="1GB/s",
                                    state_dir=tmp_path / "state",
                                    backend_opts={"server": cluster.url, "token-file": str(tmp_path / "sa-token")})
            try:
                from scheduler.service.types import NewDataset, Principal

                service.catalogue.register_dataset(Principal("alice"), NewDataset("imagenet", "s3://d/i", 10e9))
                jobs = ("batch", "jobs")

                def as_alice(em):  # type: ignore[no-untyped-def]
                    em.acting_user = "alice"
                    return em.create(em.resources[jobs], "alice", kubectl_job("mine", suspend=False))
                assert cluster.call(as_alice)["spec"]["suspend"] is True
                with pytest.raises(ApiError, match="only silod's admission may unsuspend"):
                    cluster.call(lambda em: em.patch(em.resources[jobs], "alice", "mine", {"spec": {"suspend": False}},
                                                     "application/merge-patch+json"))
                assert not cluster.pods_of("alice", "mine")
                service.apply_events(service.backend.poll())
                step(service)  # silod's admission: an UPDATE by its service account
                assert service.get_job(ROOT, job_named(service, "job.mine.").id).state == "running"
                assert cluster.obj("jobs", "alice", "mine", group="batch")["spec"]["suspend"] is False
                cluster.wait(lambda: cluster.pods_of("alice", "mine"), what="pods after silod's admission")
            finally:
                service.close()
    finally:
        server.stop()


@pytest.mark.parametrize("read_only", [False, None])
def test_a_writable_silod_volume_is_refused_at_creation_with_the_reason(read_only):
    """The node agent publishes datasets read-only only: a labelled workload whose silod volume
    lacks `readOnly: true` would be queued, admitted and then never start its pods. Refused now."""
    job = kubectl_job("w", suspend=False)
    csi = job["spec"]["template"]["spec"]["volumes"][0]["csi"]
    if read_only is None:
        del csi["readOnly"]
    else:
        csi["readOnly"] = read_only
    answer = review_response(review(job))["response"]
    assert answer["allowed"] is False and answer["status"]["code"] == 422
    assert "readOnly: true" in answer["status"]["message"] and "data" in answer["status"]["message"]
    csi["readOnly"] = True
    assert review_response(review(job))["response"]["allowed"] is True
