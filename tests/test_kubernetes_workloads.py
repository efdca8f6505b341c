"""Pure parts of the Kubernetes backend: reading workloads, admission/suspension bodies, placement."""

from __future__ import annotations

import copy

import pytest

from scheduler.backends.kubernetes.placement import NodeState, PodRequest, Taint, Toleration, place, why_not
from scheduler.backends.kubernetes.workloads import (
    JOB, JOBSET, PYTORCHJOB, PodTemplate, WorkloadError, admitted_object, parse_workload, rest_job_object,
    suspended_object,
)

POD = {"restartPolicy": "Never",
       "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "2"}}}],
       "volumes": [{"name": "d", "csi": {"driver": "silod.io", "volumeAttributes": {"dataset": "imagenet"}}}]}
META = {"name": "w", "namespace": "alice", "uid": "u1", "resourceVersion": "7", "labels": {"silod.io/queue": "q"},
        "annotations": {"silod.io/epochs": "2", "silod.io/ideal-throughput": "1GB/s"}}


def job(**spec) -> dict:
    return {"metadata": copy.deepcopy(META), "spec": {"suspend": True, "template": {"spec": copy.deepcopy(POD)}, **spec}}


def test_job_jobset_pytorchjob_are_read_alike():
    wl = parse_workload(JOB, job(parallelism=3))
    assert (wl.gpus, wl.pods, wl.dataset, wl.epochs, wl.ideal_throughput, wl.queue, wl.suspended) == \
        (6, 3, "imagenet", 2.0, 1e9, "q", True)
    js = {"metadata": META, "spec": {"suspend": True, "replicatedJobs": [
        {"name": "a", "replicas": 2, "template": {"spec": {"parallelism": 2, "template": {"spec": POD}}}}]}}
    assert parse_workload(JOBSET, js).gpus == 8
    pt = {"metadata": META, "spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": {
        "Master": {"replicas": 1, "template": {"spec": POD}}, "Worker": {"replicas": 3, "template": {"spec": POD}}}}}
    wl = parse_workload(PYTORCHJOB, pt)
    assert (wl.gpus, wl.suspended) == (8, True)
    assert admitted_object(PYTORCHJOB, pt, ["n1"])["spec"]["runPolicy"]["suspend"] is False


def test_status_conditions_decide_finished_and_failed():
    done = job(); done["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    bad = job(); bad["status"] = {"conditions": [{"type": "Failed", "status": "True", "message": "BackoffLimitExceeded"}]}
    assert parse_workload(JOB, done).phase == "finished"
    assert parse_workload(JOB, bad).phase == "failed" and "Backoff" in parse_workload(JOB, bad).message


def test_bad_workloads_are_clear_errors():
    two = job()
    two["spec"]["template"]["spec"]["volumes"].append(
        {"name": "e", "csi": {"driver": "silod.io", "volumeAttributes": {"dataset": "other"}}})
    with pytest.raises(WorkloadError, match="one dataset"):
        parse_workload(JOB, two)
    frac = job()
    frac["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "500m"
    with pytest.raises(WorkloadError, match="whole devices"):
        parse_workload(JOB, frac)


def test_admission_ands_into_owner_terms_and_readmission_replaces_only_ours():
    obj = job()
    owner_term = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}
    obj["spec"]["template"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [owner_term]}}}
    a = admitted_object(JOB, obj, ["n2", "n1"])
    terms = a["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [owner_term["matchExpressions"][0],
                                           {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1", "n2"]}]}]
    assert a["spec"]["suspend"] is False and a["metadata"]["annotations"]["silod.io/admitted-nodes"] == "n1,n2"
    s = suspended_object(JOB, a)
    assert s["spec"]["suspend"] is True
    b = admitted_object(JOB, s, ["n3"])
    terms = b["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"] == [owner_term["matchExpressions"][0],
                                            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n3"]}]
    assert obj["spec"]["suspend"] is True  # inputs are not mutated


def test_rest_job_object_is_restricted_and_suspended():
    body = rest_job_object(job_id="42", name="r", namespace="alice", queue="default", gpus=4, dataset="imagenet",
                           template=PodTemplate(image="img", pods=2))
    spec = body["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert body["metadata"]["name"] == "silod-42" and body["spec"]["suspend"] is True
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and body["spec"]["parallelism"] == 2
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and spec["securityContext"]["runAsNonRoot"]
    assert spec["volumes"][0]["csi"] == {"driver": "silod.io", "readOnly": True, "volumeAttributes": {"dataset": "imagenet"}}
    with pytest.raises(WorkloadError, match="split evenly"):
        rest_job_object(job_id="1", name="r", namespace="a", queue="q", gpus=3, dataset="d",
                        template=PodTemplate(image="i", pods=2))


def node(name, gpus, cache=100.0, io=100.0, used=None, io_used=0.0, labels=None):
    return NodeState(name=name, hostname=name, gpus_free=gpus, cache_capacity=cache, cache_used=used or {},
                     io_capacity=io, io_used=io_used, labels=labels or {})


def test_placement_checks_gpus_cache_and_node_io():
    pods = [PodRequest("p0", 2), PodRequest("p1", 2)]
    # Enough GPUs on n1 alone, but its disk holds another dataset: both pods go to n2.
    nodes = [node("n1", 4, used={"other": 80.0}), node("n2", 4)]
    assert place(pods, nodes, dataset="d", cache_bytes=50.0, io_per_pod=10.0) == {"p0": "n2", "p1": "n2"}
    # The same dataset already cached there needs no extra room.
    nodes = [node("n1", 4, used={"d": 80.0})]
    assert place(pods, nodes, dataset="d", cache_bytes=90.0, io_per_pod=10.0) == {"p0": "n1", "p1": "n1"}
    # Each node's remote-IO share fits one pod's IO only: the gang spreads.
    nodes = [node("n1", 4, io=60.0), node("n2", 4, io=60.0)]
    assert sorted(place(pods, nodes, dataset="d", cache_bytes=0.0, io_per_pod=50.0).values()) == ["n1", "n2"]
    assert place(pods, [node("n1", 4, io=60.0)], dataset="d", cache_bytes=0.0, io_per_pod=50.0) is None
    assert "cache" in why_not(pods, [node("n1", 4, cache=10.0)], dataset="d", cache_bytes=50.0, io_per_pod=0.0)


def test_placement_search_finds_what_best_fit_misses():
    # Best fit puts the 2-GPU pod on the 2-free node... and then the two 3-GPU pods need 3+3.
    pods = [PodRequest("a", 3), PodRequest("b", 3), PodRequest("c", 2)]
    nodes = [node("n1", 3), node("n2", 5)]
    got = place(pods, nodes, dataset="d", cache_bytes=0.0, io_per_pod=0.0)
    assert got is not None
    per = {}
    for k, n in got.items():
        per[n] = per.get(n, 0) + {"a": 3, "b": 3, "c": 2}[k]
    assert per["n1"] <= 3 and per["n2"] <= 5
    sel = [PodRequest("x", 1, {"zone": "b"})]
    assert place(sel, [node("n1", 4, labels={"zone": "a"})], dataset="d", cache_bytes=0, io_per_pod=0) is None


def test_tolerations_match_taints_as_kubernetes_does():
    gpu = Taint("nvidia.com/gpu", "present", "NoSchedule")
    assert Toleration("nvidia.com/gpu", "Exists", "", "NoSchedule").tolerates(gpu)
    assert Toleration("nvidia.com/gpu", "Equal", "present", "").tolerates(gpu)  # empty effect: every effect
    assert not Toleration("nvidia.com/gpu", "Equal", "other", "NoSchedule").tolerates(gpu)
    assert not Toleration("nvidia.com/gpu", "Exists", "", "NoExecute").tolerates(gpu)
    assert Toleration("", "Exists").tolerates(gpu)  # tolerates everything
    tainted = NodeState("g", "g", 4, 1e12, taints=(gpu,))
    soft = NodeState("s", "s", 4, 1e12, taints=(Taint("x", "", "PreferNoSchedule"),))
    plain = PodRequest("p", 4)
    assert place([plain], [tainted], dataset="d", cache_bytes=0, io_per_pod=0) is None
    assert "nvidia.com/gpu" in why_not([plain], [tainted], dataset="d", cache_bytes=0, io_per_pod=0)
    assert place([plain], [soft], dataset="d", cache_bytes=0, io_per_pod=0) == {"p": "s"}  # only a preference
    tolerant = PodRequest("p", 4, {}, (Toleration("nvidia.com/gpu", "Exists", "", "NoSchedule"),))
    assert place([tolerant], [tainted], dataset="d", cache_bytes=0, io_per_pod=0) == {"p": "g"}
    # The workload's pod template carries them to placement.
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "a", "uid": "u"},
           "spec": {"template": {"spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                          "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}
    (_, _, _, tols), = parse_workload(JOB, job).pod_list()
    assert tols == (("nvidia.com/gpu", "Exists", "", ""),)
