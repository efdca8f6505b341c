"""The manifests in deploy/: schema-valid for a real Kubernetes version (offline, with
kubernetes-validate's bundled schemas), and consistent with what the code expects."""

from __future__ import annotations

import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from scheduler.backends.kubernetes.__main__ import build_parser
from scheduler.backends.kubernetes.cluster import ClusterState
from scheduler.backends.kubernetes.contract import SCHEDULER_NAME, parse_job_request

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.30.0"  # oldest schema bundled that has native sidecars (restartPolicy on init containers)
FILES = sorted(DEPLOY.rglob("*.yaml"))


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs() -> list[dict]:
    return [d for f in FILES for d in docs(f)]


def find(kind: str, name: str) -> dict:
    return next(d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_there_are_manifests():
    names = {f.relative_to(DEPLOY).as_posix() for f in FILES}
    assert {"00-namespace.yaml", "10-scheduler.yaml", "20-datamanager.yaml", "examples/training-job.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_manifest_is_schema_valid(path):
    for doc in docs(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_validation_really_rejects_mistakes():
    bad = find("Deployment", "silod-scheduler")
    bad = yaml.safe_load(yaml.safe_dump(bad))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _rules(name: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rule in find("ClusterRole", name)["rules"]:
        for res in rule["resources"]:
            out.setdefault(res, set()).update(rule["verbs"])
    return out


def test_scheduler_rbac_covers_the_calls_it_makes():
    rules = _rules("silod-scheduler")
    assert {"get", "list", "watch", "patch"} <= rules["pods"]
    assert "create" in rules["pods/binding"]
    assert {"get", "list", "watch"} <= rules["nodes"]
    assert "create" in rules["events"]
    binding = find("ClusterRoleBinding", "silod-scheduler")
    deployment = find("Deployment", "silod-scheduler")
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"][0]["name"] == sa and binding["roleRef"]["name"] == "silod-scheduler"
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"


def test_scheduler_command_parses():
    container = find("Deployment", "silod-scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "scheduler.backends.kubernetes"]
    args = build_parser().parse_args(container["args"])
    assert args.policy == "fifo" and args.cache_system == "silod"


def test_datamanager_statefulset_and_service():
    sts = find("StatefulSet", "silod-datamanager")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == shlex.split("silod datamanager --listen 0.0.0.0:8700 --state /var/lib/silod")
    assert sts["spec"]["replicas"] == 1
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/var/lib/silod"}
    svc = find("Service", "silod-datamanager")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()  # the Service selects the pod
    assert svc["spec"]["ports"][0]["port"] == 8700


def _example_pods():
    for doc in all_docs():
        if doc["kind"] == "Pod":
            yield doc["metadata"], doc["spec"]
        elif doc["kind"] == "Job":
            yield doc["spec"]["template"]["metadata"], doc["spec"]["template"]["spec"]


def test_example_jobs_follow_the_contract():
    examples = list(_example_pods())
    assert len(examples) >= 2
    for meta, spec in examples:
        assert spec["schedulerName"] == SCHEDULER_NAME
        assert meta["labels"]["silod.io/job"]
        request = parse_job_request(meta["labels"]["silod.io/job"], meta["annotations"])
        assert request.epochs > 0 and request.dataset


def _quantities_as_strings(obj):
    """YAML reads `nvidia.com/gpu: 4` as an int; the API server turns quantities into strings."""
    if isinstance(obj, dict):
        return {k: ({q: str(n) for q, n in v.items()} if k in ("limits", "requests") else _quantities_as_strings(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_quantities_as_strings(v) for v in obj]
    return obj


def test_example_gang_matches_its_job_and_gpu_requests():
    from kubernetes import client

    job = find("Job", "resnet50-imagenet")
    template = job["spec"]["template"]
    request = parse_job_request("t", template["metadata"]["annotations"])
    assert request.pods == job["spec"]["parallelism"] == job["spec"]["completions"]
    pod = client.V1Pod.from_dict(_quantities_as_strings({
        "apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": "p", "namespace": "default"},
        "spec": template["spec"]}))
    view = ClusterState.build([], [pod]).pods[0]
    assert view.gpus == 4 and view.is_silod  # the sidecar asks for no GPU


def test_fuse_sidecar_can_mount():
    spec = find("Job", "resnet50-imagenet")["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "silod-fuse")
    assert sidecar["restartPolicy"] == "Always" and sidecar["securityContext"]["privileged"] is True
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["data"]["mountPropagation"] == "Bidirectional"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["dev-fuse"]["name"]]["hostPath"]["path"] == "/dev/fuse"
    assert volumes["cache"]["hostPath"]["path"].startswith("/var/lib/silod")
    trainer = spec["containers"][0]
    assert {m["name"]: m for m in trainer["volumeMounts"]}["data"]["mountPropagation"] == "HostToContainer"
    assert "silod mount" in sidecar["args"][0] and "--manager" in sidecar["args"][0]
