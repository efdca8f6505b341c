"""Scheduling fields of a workload's pods (issue 44, Build items 4 and 5): node affinity by
kube-scheduler's rules, one admission check for the webhook and REST submissions, and REST
pod templates carrying tolerations, nodeSelector, affinity and resources.

Pure functions here, and the REST API on the emulated API server (tests/k8s_emulator.py) for
what a submission answers; tests/test_kubernetes_real_scheduling.py checks the same fields
against the real kube-apiserver and kube-scheduler."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from scheduler.backends.kubernetes.nodematch import NodeLabels, node_selected, pod_spec_problems, term_matches
from scheduler.backends.kubernetes.placement import NodeState, PodRequest, Taint, Toleration, place
from scheduler.backends.kubernetes.webhook import review_response
from scheduler.backends.kubernetes.workloads import JOB, PodTemplate, admission_problems, parse_workload, rest_job_object

try:
    from test_kubernetes_admission import H_ALICE, kubectl_job, stack, cluster  # noqa: F401 - fixtures
    from test_kubernetes_webhook import review
except ImportError:
    from tests.test_kubernetes_admission import H_ALICE, kubectl_job, stack, cluster  # noqa: F401
    from tests.test_kubernetes_webhook import review

ZONE_A = {"kubernetes.io/hostname": "a", "zone": "a", "gpu-gen": "9"}
ZONE_B = {"kubernetes.io/hostname": "b", "zone": "b", "gpu-gen": "8"}


def affinity(*terms: dict) -> dict:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def expr(key: str, op: str, *values: str) -> dict:
    return {"key": key, "operator": op, **({"values": list(values)} if values else {})}


@pytest.mark.parametrize(("term", "a", "b"), [
    ({"matchExpressions": [expr("zone", "In", "a", "c")]}, True, False),
    ({"matchExpressions": [expr("zone", "NotIn", "a")]}, False, True),
    ({"matchExpressions": [expr("missing", "NotIn", "x")]}, True, True),  # absent label: NotIn matches
    ({"matchExpressions": [expr("zone", "Exists")]}, True, True),
    ({"matchExpressions": [expr("zone", "DoesNotExist")]}, False, False),
    ({"matchExpressions": [expr("gpu-gen", "Gt", "8")]}, True, False),
    ({"matchExpressions": [expr("gpu-gen", "Lt", "9")]}, False, True),
    ({"matchExpressions": [expr("zone", "Gt", "1")]}, False, False),  # not an integer: no match
    ({"matchFields": [expr("metadata.name", "In", "b")]}, False, True),
    ({"matchExpressions": [expr("zone", "In", "a")], "matchFields": [expr("metadata.name", "In", "b")]}, False, False),
    ({}, False, False),  # an empty term selects no node
])
def test_node_affinity_terms_follow_kube_schedulers_rules(term, a, b):
    assert term_matches(term, "a", ZONE_A) is a
    assert term_matches(term, "b", ZONE_B) is b


def test_terms_are_ored_and_the_node_selector_anded():
    terms = [{"matchExpressions": [expr("zone", "In", "a")]}, {"matchExpressions": [expr("zone", "In", "b")]}]
    assert node_selected("a", ZONE_A, {}, terms) and node_selected("b", ZONE_B, {}, terms)
    assert not node_selected("b", ZONE_B, {"gpu-gen": "9"}, terms)
    assert node_selected("b", ZONE_B, {}, None)  # no affinity: every node


def test_placement_honours_the_owners_required_node_affinity():
    """Before, placement read nodeSelector only: a pod whose affinity asks for zone b could be
    placed on zone a, where silod's own hostname term ANDed with the owner's matches nothing."""
    nodes = [NodeState("a", "a", 8, 1e12, labels=ZONE_A), NodeState("b", "b", 8, 1e12, labels=ZONE_B)]
    terms = ({"matchExpressions": [expr("zone", "In", "b")]},)
    pod = PodRequest("p", 4, affinity_terms=terms)
    assert place([pod], nodes, dataset="d", cache_bytes=0, io_per_pod=0) == {"p": "b"}
    nowhere = PodRequest("q", 4, affinity_terms=({"matchExpressions": [expr("zone", "In", "c")]},))
    assert place([nowhere], nodes, dataset="d", cache_bytes=0, io_per_pod=0) is None


def test_the_owners_affinity_is_read_without_silods_own_admission_term():
    """An admitted workload carries silod's hostname term ANDed into the owner's: re-admission
    must see the owner's terms only, or a preempted job could never move to other nodes."""
    from scheduler.backends.kubernetes.workloads import admitted_object

    job = kubectl_job("j")
    job["metadata"]["uid"] = "u1"
    job["spec"]["template"]["spec"]["affinity"] = affinity({"matchExpressions": [expr("zone", "In", "a", "b")]})
    admitted = admitted_object(JOB, job, ["a"])
    wl = parse_workload(JOB, admitted)
    assert wl.pod_sets[0].affinity_terms == ({"matchExpressions": [expr("zone", "In", "a", "b")]},)
    nodes = [NodeState("b", "b", 8, 1e12, labels=ZONE_B)]
    pod = PodRequest("p", 2, affinity_terms=wl.pod_sets[0].affinity_terms)
    assert place([pod], nodes, dataset="d", cache_bytes=0, io_per_pod=0) == {"p": "b"}


CLUSTER = [NodeLabels("a", ZONE_A, gpus=8), NodeLabels("b", ZONE_B, gpus=8), NodeLabels("cpu", {"zone": "x"}, gpus=0)]


@pytest.mark.parametrize("spec_patch", [
    {"nodeSelector": {"zone": "x"}},  # only a CPU node matches: GPU pods never run there
    {"nodeSelector": {"zone": "a", "gpu-gen": "8"}},
    {"affinity": affinity({"matchExpressions": [expr("zone", "In", "c")]})},
])
def test_the_webhook_refuses_a_selector_no_gpu_node_matches_naming_it(spec_patch):
    job = kubectl_job("picky")
    job["spec"]["template"]["spec"].update(copy.deepcopy(spec_patch))
    answer = review_response(review(job), nodes=lambda: CLUSTER)["response"]
    assert answer["allowed"] is False and answer["status"]["code"] == 422, answer
    message = answer["status"]["message"]
    assert "no node of the cluster matches" in message and "0 of 2 node(s) with GPUs" in message, message
    assert ("nodeSelector " in message) == ("nodeSelector" in spec_patch), message
    # Without the node list (or in a cluster with no GPU node yet) it is not refused for that.
    assert review_response(review(job))["response"]["allowed"] is True
    assert review_response(review(job), nodes=lambda: CLUSTER[2:])["response"]["allowed"] is True


def test_the_webhook_admits_a_selector_some_gpu_node_matches():
    job = kubectl_job("ok")
    job["spec"]["template"]["spec"]["affinity"] = affinity({"matchExpressions": [expr("zone", "In", "c")]},
                                                           {"matchExpressions": [expr("gpu-gen", "Gt", "8")]})
    assert review_response(review(job), nodes=lambda: CLUSTER)["response"]["allowed"] is True


def test_a_node_list_that_fails_does_not_block_admission():
    def broken():
        raise OSError("API server unreachable")
    assert review_response(review(kubectl_job("j")), nodes=broken)["response"]["allowed"] is True


@pytest.mark.parametrize(("spec_patch", "named"), [
    ({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}, "operator Exists takes no value"),
    ({"tolerations": [{"key": "k", "operator": "Like"}]}, "use Equal or Exists"),
    ({"tolerations": [{"key": "k", "effect": "NoWay"}]}, "effect 'NoWay'"),
    ({"tolerations": [{"operator": "Equal", "value": "v"}]}, "an empty key needs operator Exists"),
    ({"affinity": affinity({"matchExpressions": [expr("zone", "Near", "a")]})}, "operator 'Near'"),
    ({"affinity": affinity({"matchExpressions": [expr("zone", "In")]})}, "operator In needs values"),
    ({"affinity": affinity({"matchExpressions": [expr("gen", "Gt", "a")]})}, "takes one integer value"),
    ({"affinity": affinity({"matchFields": [expr("metadata.labels", "In", "a")]})}, "the only node field"),
    ({"affinity": affinity()}, "has no nodeSelectorTerms"),
])
def test_malformed_scheduling_fields_are_named(spec_patch, named):
    job = kubectl_job("bad")
    job["spec"]["template"]["spec"].update(spec_patch)
    problems = admission_problems(JOB, job, CLUSTER)
    assert problems and named in " ".join(problems), problems
    answer = review_response(review(job), nodes=lambda: CLUSTER)["response"]
    assert answer["allowed"] is False and named in answer["status"]["message"]


def test_a_rest_jobs_template_carries_its_scheduling_fields_into_the_job():
    template = PodTemplate(
        image="t:1", tolerations=({"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"},),
        node_selector={"zone": "a"}, affinity=affinity({"matchExpressions": [expr("gpu-gen", "In", "9")]}),
        resources={"requests": {"memory": "8Gi", "example.com/nic": "1"}, "limits": {"memory": "8Gi"}}, pods=2)
    body = rest_job_object(job_id="7", name="n", namespace="alice", queue="default", gpus=4, dataset="d",
                           template=template)
    spec = body["spec"]["template"]["spec"]
    assert spec["tolerations"] == [dict(template.tolerations[0])] and spec["nodeSelector"] == {"zone": "a"}
    assert spec["affinity"] == template.affinity
    res = spec["containers"][0]["resources"]
    assert res["requests"] == {"memory": "8Gi", "example.com/nic": "1", "nvidia.com/gpu": "2"}
    assert res["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "2"}
    assert admission_problems(JOB, body, CLUSTER) == []
    wl = parse_workload(JOB, {**body, "metadata": {**body["metadata"], "uid": "u"}})
    assert wl.pod_sets[0].tolerations == (("dedicated", "Equal", "train", "NoSchedule"),)
    assert wl.pod_sets[0].affinity_terms == ({"matchExpressions": [expr("gpu-gen", "In", "9")]},)
    from scheduler.backends.kubernetes.workloads import WorkloadError

    with pytest.raises(WorkloadError, match="silod sets it from gpus / pods"):
        rest_job_object(job_id="7", name="n", namespace="alice", queue="default", gpus=4, dataset="d",
                        template=PodTemplate(image="t:1", resources={"limits": {"nvidia.com/gpu": "8"}}))


def test_pod_spec_problems_ignore_a_cluster_without_gpu_nodes():
    spec = {"nodeSelector": {"zone": "z"}, "containers": []}
    assert pod_spec_problems(spec, "p", [NodeLabels("cpu", {}, 0)], gpus=1) == []
    assert pod_spec_problems(spec, "p", [NodeLabels("cpu", {}, 0)], gpus=0)  # CPU pods: the CPU node counts


def test_a_gpu_taint_is_refused_unless_the_pod_tolerates_it():
    """The toleration the ExtendedResourceToleration plugin adds (which the backend adds to its
    pods' view with --backend-opt extended-resource-toleration=true: test_backend_options_reach_the_backend)
    is what opens a nvidia.com/gpu-tainted node."""
    tainted = NodeState("g", "g", 8, 1e12, taints=(Taint("nvidia.com/gpu", "present", "NoSchedule"),))
    plain = PodRequest("p", 4)
    assert place([plain], [tainted], dataset="d", cache_bytes=0, io_per_pod=0) is None
    tolerant = PodRequest("p", 4, tolerations=(Toleration("nvidia.com/gpu", "Exists", "", "NoSchedule"),))
    assert place([tolerant], [tainted], dataset="d", cache_bytes=0, io_per_pod=0) == {"p": "g"}


# --- the REST API (emulated API server) ------------------------------------------------------

def _submit(client, template: dict, name: str = "r"):  # type: ignore[no-untyped-def]
    return client.post("/v1/jobs", headers=H_ALICE, json={
        "name": name, "gpus": 2, "dataset": "imagenet", "epochs": 1, "ideal_throughput": "100MB/s",
        "pod_template": {"image": "t:1", **template}})


def test_rest_jobs_accept_tolerations_node_selector_affinity_and_resources(stack):
    service, client = stack
    cluster_nodes = service.backend.node_labels()
    assert {n.name for n in cluster_nodes} >= {"n1", "n2"}
    r = _submit(client, {
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"}],
        "node_selector": {"kubernetes.io/hostname": "n2"},
        "affinity": {"node_affinity": affinity({"matchExpressions": [expr("kubernetes.io/hostname", "In", "n2")]})[
            "nodeAffinity"]},
        "resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "4Gi"}}})
    assert r.status_code == 201, r.text
    job = service.backend.custom.get_namespaced_custom_object("batch", "v1", "alice", "jobs", f"silod-{r.json()['id']}")
    spec = job["spec"]["template"]["spec"]
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"}]
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "n2"}
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"] == [expr("kubernetes.io/hostname", "In", "n2")]
    assert spec["containers"][0]["resources"]["requests"]["memory"] == "4Gi"


@pytest.mark.parametrize(("template", "named"), [
    ({"node_selector": {"zone": "nowhere"}}, "no node of the cluster matches its nodeSelector zone=nowhere"),
    ({"affinity": {"node_affinity": affinity({"matchExpressions": [expr("zone", "In")]})["nodeAffinity"]}},
     "operator In needs values"),
    ({"resources": {"limits": {"nvidia.com/gpu": "4"}}}, "silod sets it from gpus / pods"),
])
def test_a_rest_template_silod_would_never_admit_is_a_422_and_records_nothing(stack, template, named):
    service, client = stack
    before = client.get("/v1/jobs", headers=H_ALICE).json()
    r = _submit(client, template)
    assert r.status_code == 422, r.text
    assert named in r.text and "pod_template" in r.text, r.text
    assert client.get("/v1/jobs", headers=H_ALICE).json() == before  # refused before it was recorded


@pytest.mark.parametrize("template", [
    {"tolerations": [{"key": "k", "operator": "Like"}]},
    {"node_selector": {"zone": "a b"}},
    {"affinity": {"nodeAffinity": {}}},  # the REST API spells fields snake_case
    {"resources": {"requests": {"memory": "lots"}}},
])
def test_rest_template_fields_are_validated_by_the_schema(stack, template):
    _, client = stack
    r = _submit(client, template)
    assert r.status_code == 422, r.text


@pytest.mark.parametrize(("opt", "named"), [
    ("unschedulable-grace=0s", "unschedulable-grace='0s': give a duration between 1s and 30d"),
    ("unschedulable-grace=soon", "unschedulable-grace='soon'"),
    ("extended-resource-toleration=yes", "extended-resource-toleration='yes': true when the API server runs"),
])
def test_bad_backend_options_are_named(opt, named):
    from estimator.errors import UserError
    from policies.types import ClusterCapacity
    from scheduler.backends.base import BackendConfig
    from scheduler.backends.kubernetes import create_backend

    key, value = opt.split("=", 1)
    config = BackendConfig(capacity=ClusterCapacity(gpus=8, cache=1e12, remote_io=1e9), state_dir=Path("/nonexistent"),
                           options={"server": "http://127.0.0.1:9", key: value})
    with pytest.raises(UserError, match=named.replace("(", r"\(")):
        create_backend(config)


def test_backend_options_reach_the_backend():
    from policies.types import ClusterCapacity
    from scheduler.backends.base import BackendConfig
    from scheduler.backends.kubernetes import create_backend

    backend = create_backend(BackendConfig(
        capacity=ClusterCapacity(gpus=8, cache=1e12, remote_io=1e9), state_dir=Path("/nonexistent"),
        options={"server": "http://127.0.0.1:9", "unschedulable-grace": "5m", "extended-resource-toleration": "true"}))
    assert backend.pending_grace_s == 300 and backend.extended_resource_toleration is True
    wl = parse_workload(JOB, {**kubectl_job("j"), "metadata": {**kubectl_job("j")["metadata"], "uid": "u"}})
    assert backend._pod_requests(wl)[0].tolerations == (Toleration("nvidia.com/gpu", "Exists", "", "NoSchedule"),)
    backend.extended_resource_toleration = False
    assert backend._pod_requests(wl)[0].tolerations == ()
    backend.close()
