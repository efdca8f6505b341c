"""The manifests in deploy/: schema-valid for a real Kubernetes version (offline, with
kubernetes-validate's bundled OpenAPI schemas), kustomizations that point at files that exist,
and consistent with what the code expects (commands that parse, RBAC that covers the calls the
backend makes and nothing more, an example Job that passes Pod Security "restricted")."""

from __future__ import annotations

import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import typer.testing
import yaml

from k8s_emulator import pod_security_violations
from scheduler.backends.kubernetes.workloads import JOB, parse_workload
from scheduler.cli import app

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.30.0"
KUSTOMIZATIONS = sorted(DEPLOY.rglob("kustomization.yaml"))
FILES = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs() -> list[dict]:
    return [d for f in FILES for d in docs(f)]


def find(kind: str, name: str) -> dict:
    return next(d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_there_is_a_base_and_an_overlay():
    names = {f.relative_to(DEPLOY).as_posix() for f in KUSTOMIZATIONS}
    assert names == {"base/kustomization.yaml", "overlays/in-cluster-postgres/kustomization.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_manifest_is_schema_valid(path):
    for doc in docs(path):
        if path.parent.name == "in-cluster-postgres" and path.name.startswith("scheduler-"):
            continue  # a strategic-merge patch is a partial object; checked below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_validation_really_rejects_mistakes():
    bad = yaml.safe_load(yaml.safe_dump(find("Deployment", "silod-scheduler")))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_kustomization_references_exist(path):
    k = yaml.safe_load(path.read_text())
    for res in k.get("resources", []):
        assert (path.parent / res).exists(), f"{path}: resource {res} does not exist"
    for patch in k.get("patches", []):
        target = yaml.safe_load((path.parent / patch["path"]).read_text())
        find(target["kind"], target["metadata"]["name"])  # patches an object the base has


def test_scheduler_deployment_two_replicas_lease_probes_pdb_and_secret():
    dep = find("Deployment", "silod-scheduler")
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz" and c["livenessProbe"]
    assert "--backend-opt=leader-election=true" in c["args"] and "--backend=kubernetes" in c["args"]
    secret_keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    # token-key: one HMAC key for the stored tokens across replicas; secret-keys: one Fernet key
    # list sealing tenants' secrets across replicas (a per-replica key file could not open the
    # other replica's); dm-scheduler-token: the data manager.
    assert secret_keys == {"admin-token", "database-url", "token-key", "secret-keys", "dm-scheduler-token"}
    assert set(find("Secret", "silod-secrets")["stringData"]) >= secret_keys | {"agent-token", "tokens"}
    pdb = find("PodDisruptionBudget", "silod-scheduler")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    svc = find("Service", "silod-scheduler")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_scheduler_and_agent_commands_parse():
    """The containers' command lines are accepted by the real CLI (`--help` after them stops
    before anything runs, but only once every option before it has parsed)."""
    runner = typer.testing.CliRunner()
    for kind, name in (("Deployment", "silod-scheduler"), ("DaemonSet", "silod-agent")):
        c = find(kind, name)["spec"]["template"]["spec"]["containers"][0]
        args = [a.replace("$(DATABASE_URL)", "sqlite:///x.db") for a in c["command"][1:] + c["args"]]
        result = runner.invoke(app, [*args, "--help"])
        assert result.exit_code == 0, (name, result.output)
    dm = find("StatefulSet", "silod-datamanager")["spec"]["template"]["spec"]["containers"][0]
    assert runner.invoke(app, [*dm["command"][1:], "--help"]).exit_code == 0, shlex.join(dm["command"])


def _rules(kind: str, name: str) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in find(kind, name)["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_scheduler_rbac_is_least_privilege_and_covers_its_calls():
    rules = _rules("ClusterRole", "silod-scheduler")
    assert rules[("", "pods")] == {"get", "list", "watch"}  # never creates, patches or deletes pods
    assert rules[("", "nodes")] == {"get", "list", "watch"}
    # Cluster-wide: reading workloads only. Every write (admission, preemption, the Jobs of REST
    # submissions, re-admission's status.startTime) only where a tenant's RoleBinding allows it,
    # never cluster-wide (kube-system): tests/test_kubernetes_upgrade.py checks it on a real API server.
    for res in (("batch", "jobs"), ("jobset.x-k8s.io", "jobsets"), ("kubeflow.org", "pytorchjobs")):
        assert rules[res] == {"get", "list", "watch"}, res
    assert ("batch", "jobs/status") not in rules
    # Per tenant namespace also the jobs' report Secrets: written, never read (no get/list/watch).
    assert _rules("ClusterRole", "silod-scheduler-jobs") == {
        ("", "secrets"): {"create", "update", "delete"},
        ("batch", "jobs"): {"create", "delete", "update", "patch"}, ("batch", "jobs/status"): {"update", "patch"},
        ("jobset.x-k8s.io", "jobsets"): {"update", "patch"}, ("kubeflow.org", "pytorchjobs"): {"update", "patch"}}
    assert not any(d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "silod-scheduler-jobs" for d in all_docs())
    per_tenant = find("RoleBinding", "silod-scheduler-jobs")
    assert per_tenant["metadata"]["namespace"] == "ml-team" and per_tenant["subjects"][0]["name"] == "silod-scheduler"
    # Its own webhook configuration's caBundle, nothing else of admission's.
    hook_rule = next(r for r in find("ClusterRole", "silod-scheduler")["rules"]
                     if r["resources"] == ["mutatingwebhookconfigurations"])
    assert hook_rule["resourceNames"] == ["silod-suspend"] and set(hook_rule["verbs"]) == {"get", "patch"}
    assert rules[("scheduling.k8s.io", "priorityclasses")] >= {"get"}
    assert not any(("", "secrets") == k for k in rules) and not any("*" in v or "*" in k for k, v in rules.items())
    lease = _rules("Role", "silod-scheduler-leader")
    assert lease[("coordination.k8s.io", "leases")] == {"create", "get", "update"}
    for binding_kind, role in (("ClusterRoleBinding", "silod-scheduler"), ("RoleBinding", "silod-scheduler-leader")):
        b = find(binding_kind, role)
        assert b["subjects"][0]["name"] == "silod-scheduler" and b["roleRef"]["name"] == role


def test_only_the_agent_is_privileged_and_the_csi_driver_gives_pod_info():
    privileged = []
    for d in all_docs():
        spec = d.get("spec", {}).get("template", {}).get("spec") if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet") else None
        for c in (spec or {}).get("containers", []):
            if c.get("securityContext", {}).get("privileged"):
                privileged.append((d["metadata"]["name"], c["name"]))
    assert privileged == [("silod-agent", "agent")]
    drv = find("CSIDriver", "silod.io")
    assert drv["spec"]["podInfoOnMount"] is True and drv["spec"]["attachRequired"] is False
    assert "Ephemeral" in drv["spec"]["volumeLifecycleModes"]
    assert find("StorageClass", "silod")
    agent = find("DaemonSet", "silod-agent")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in agent["containers"][0]["volumeMounts"]}
    assert mounts["kubelet-dir"]["mountPropagation"] == "Bidirectional"
    # The agent's identity: its pod's own token for the audience silod checks, not the API's.
    token = next(v for v in agent["volumes"] if v["name"] == "agent-token")
    assert token["projected"]["sources"] == [{"serviceAccountToken": {"audience": "silod", "expirationSeconds": 3600,
                                                                      "path": "token"}}]
    assert agent["automountServiceAccountToken"] is False
    assert mounts["agent-token"]["readOnly"] is True


def _image_user() -> int:
    """The uid the image runs as: deploy/Dockerfile's last USER (root when none)."""
    users = [line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    return int(users[-1]) if users else 0


def _effective_uid(pod_spec: dict, container: dict) -> int:
    for ctx in (container.get("securityContext") or {}, pod_spec.get("securityContext") or {}):
        if "runAsUser" in ctx:
            return int(ctx["runAsUser"])
    return _image_user()


def test_the_agent_container_runs_as_root_and_every_other_silod_container_does_not():
    """Finding 2: `privileged: true` does not change the user; with the image's USER 10001 the
    agent could not create its socket and state dirs nor mount."""
    assert _image_user() != 0
    uids = {}
    for d in all_docs():
        if d["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("containers", []):  # (an overlay's patch is partial)
            if c.get("image", "").split(":")[0] == "silod":
                uids[(d["metadata"]["name"], c["name"])] = _effective_uid(spec, c)
    assert uids.pop(("silod-agent", "agent")) == 0
    assert uids and all(uid != 0 for uid in uids.values()), uids


def test_agent_probes_call_the_csi_probe_rpc():
    spec = find("DaemonSet", "silod-agent")["spec"]["template"]["spec"]
    agent = spec["containers"][0]
    sidecar = next(c for c in spec["containers"] if c["name"] == "liveness-probe")
    port = next(p["containerPort"] for p in agent["ports"] if p["name"] == "healthz")
    assert f"--http-endpoint=:{port}" in sidecar["args"] and "--csi-address=/csi/csi.sock" in sidecar["args"]
    for probe in (agent["livenessProbe"], agent["readinessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": "healthz"}


def _example_jobs() -> list[dict]:
    return [d for f in sorted((DEPLOY / "examples").glob("*.yaml")) for d in docs(f) if d["kind"] == "Job"]


def test_example_jobs_pass_pod_security_restricted_and_are_admissible():
    ns = find("Namespace", "ml-team")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    jobs = _example_jobs()
    assert len(jobs) >= 2
    for job in jobs:
        assert job["metadata"]["namespace"] == "ml-team" and job["spec"]["suspend"] is True
        pod = {"metadata": {"name": "p"}, "spec": job["spec"]["template"]["spec"]}
        assert pod_security_violations(pod, "restricted") == [], job["metadata"]["name"]
        wl = parse_workload(JOB, {**job, "metadata": {**job["metadata"], "uid": "u"}})
        assert wl.queue and wl.dataset == "imagenet" and wl.epochs and wl.gpus >= 1


def test_the_restricted_checker_rejects_a_privileged_pod():
    """The check above could fail: the same checker refuses the pod shape the issue complains of."""
    job = _example_jobs()[0]
    spec = yaml.safe_load(yaml.safe_dump(job["spec"]["template"]["spec"]))
    spec["containers"].append({"name": "fuse", "image": "silod", "securityContext": {"privileged": True}})
    spec["volumes"].append({"name": "host", "hostPath": {"path": "/var/lib/silod"}})
    problems = pod_security_violations({"metadata": {"name": "p"}, "spec": spec}, "restricted")
    assert any("privileged" in p for p in problems) and any("hostPath" in p for p in problems)


def test_data_manager_and_agent_carry_the_data_manager_tokens():
    """The data manager: the scheduler's token from the Secret, the agents by their pods' own
    tokens (TokenReview, with its service account and RBAC), no shared agent token (issue 20);
    the agent's FUSE clients send the projected token, and the probes use the open /healthz."""
    sts = find("StatefulSet", "silod-datamanager")["spec"]["template"]["spec"]
    dm = sts["containers"][0]
    env = {e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"]["key"] for e in dm["env"]}
    assert env == {"SILOD_DM_SCHEDULER_TOKEN": "dm-scheduler-token",
                   "SILOD_DM_AGENT_SERVICE_ACCOUNTS": "silod-system:silod-agent"}
    assert sts["serviceAccountName"] == "silod-datamanager" and find("ServiceAccount", "silod-datamanager")
    assert dm["readinessProbe"]["httpGet"]["path"] == dm["livenessProbe"]["httpGet"]["path"] == "/healthz"
    agent = find("DaemonSet", "silod-agent")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "SILOD_DM_TOKEN_FILE", "value": "/var/run/silod-agent/token"} in agent["env"]
    assert "--report-token-file=/var/run/silod-agent/token" in agent["args"]
    assert not any("dm-agent-token" in str(e) for e in agent["env"])
    binding = find("ClusterRoleBinding", "silod-agent-reviewer")
    assert {s["name"] for s in binding["subjects"]} == {"silod-scheduler", "silod-datamanager"}
    assert find("ClusterRole", "silod-agent-reviewer")["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}]
    assert set(find("Secret", "silod-secrets")["stringData"]) >= {"dm-scheduler-token", "token-key"}


def test_csi_controller_provisions_the_storage_class_and_the_webhook_suspends_labelled_workloads():
    runner = typer.testing.CliRunner()
    sc = find("StorageClass", "silod")
    assert sc["provisioner"] == "silod.io" and find("CSIDriver", "silod.io")
    dep = find("Deployment", "silod-csi-controller")["spec"]["template"]["spec"]
    ctl, prov = dep["containers"]
    assert runner.invoke(app, [*ctl["command"][1:], *ctl["args"], "--help"]).exit_code == 0
    assert "--extra-create-metadata" in prov["args"]  # the PVC's namespace is the tenant
    assert {m["mountPath"] for m in ctl["volumeMounts"]} == {m["mountPath"] for m in prov["volumeMounts"]}
    assert not any(c.get("securityContext", {}).get("privileged") for c in dep["containers"])
    rules = _rules("ClusterRole", "silod-csi-provisioner")
    # patch: csi-provisioner v5 removes its PV finalizer by PATCH (finding 5; tests/test_kubernetes_real.py
    # runs the real sidecar against the real API server).
    assert rules[("", "persistentvolumes")] >= {"create", "delete", "patch"} and ("", "secrets") not in rules
    # The webhook: CREATE of labelled Jobs/JobSets/PyTorchJobs, served by the scheduler Service.
    wh = find("MutatingWebhookConfiguration", "silod-suspend")["webhooks"][0]
    assert wh["objectSelector"]["matchExpressions"] == [{"key": "silod.io/queue", "operator": "Exists"}]
    assert wh["failurePolicy"] == "Fail" and wh["sideEffects"] == "None" and wh["admissionReviewVersions"] == ["v1"]
    # No caBundle in the manifest: `kubectl apply` would reset the one silod writes (cabundle.py).
    assert "caBundle" not in wh["clientConfig"]
    assert {(r["apiGroups"][0], r["resources"][0]) for r in wh["rules"]} == {
        ("batch", "jobs"), ("jobset.x-k8s.io", "jobsets"), ("kubeflow.org", "pytorchjobs")}
    svc = find("Service", "silod-scheduler")
    port = next(p for p in svc["spec"]["ports"] if p["port"] == wh["clientConfig"]["service"]["port"])
    c = find("Deployment", "silod-scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert any(p["name"] == port["targetPort"] and p["containerPort"] == 9443 for p in c["ports"])
    assert "--webhook-listen=0.0.0.0:9443" in c["args"]
