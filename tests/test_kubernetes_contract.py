"""Kubernetes backend, pure parts: the annotation codec, GPU accounting and gang placement.

No server here; tests/test_kubernetes_backend.py drives the real client against an emulated API.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client

from scheduler.backends.kubernetes.cluster import ClusterState, NodeView, PodView, Toleration, Taint, place_gang
from scheduler.backends.kubernetes.contract import (
    ANN_CACHE, ANN_DATASET, ANN_EPOCHS, ANN_IDEAL, ANN_IO, ANN_JOB_IO, ANN_MODEL, ANN_NODE, ANN_PODS,
    AnnotationError, allocation_annotations, parse_gpu_quantity, parse_job_request, parse_scheduler_state,
)

GOOD = {ANN_DATASET: "imagenet-1k", ANN_IDEAL: "912MB/s", ANN_EPOCHS: "3", ANN_PODS: "2"}


def test_job_request_parses_units():
    req = parse_job_request("ns/p", {**GOOD, "silod.io/dataset-size": "143GB", "silod.io/gpus": "8"})
    assert req.pods == 2 and req.gpus == 8
    assert req.ideal_throughput == pytest.approx(912e6)
    assert req.dataset_size == pytest.approx(143e9)
    assert req.epochs == 3.0


@pytest.mark.parametrize("key,value,words", [
    (ANN_EPOCHS, "-1", "epochs"),
    (ANN_EPOCHS, "three", "not a number"),
    (ANN_EPOCHS, "0", "> 0"),
    (ANN_IDEAL, "-5MB/s", "negative"),
    (ANN_IDEAL, "912XB/s", "unknown unit"),
    (ANN_IDEAL, "912MB", "per second"),
    ("silod.io/dataset-size", "12 parsecs", "unknown unit"),
    ("silod.io/dataset-size", "-1GB", "negative"),
    (ANN_PODS, "1.5", "whole number"),
    (ANN_PODS, "0", ">= 1"),
    ("silod.io/gpus", "two", "whole number"),
])
def test_bad_annotation_names_pod_and_key(key, value, words):
    with pytest.raises(AnnotationError) as info:
        parse_job_request("team/train-0", {**GOOD, key: value})
    message = str(info.value)
    assert "team/train-0" in message and key in message and words in message


def test_missing_required_annotations_say_what_to_add():
    with pytest.raises(AnnotationError, match=ANN_DATASET):
        parse_job_request("p", {ANN_IDEAL: "1MB/s", ANN_EPOCHS: "1"})
    with pytest.raises(AnnotationError, match="ideal-throughput.*model"):
        parse_job_request("p", {ANN_DATASET: "d", ANN_EPOCHS: "1"})
    assert parse_job_request("p", {ANN_DATASET: "d", ANN_MODEL: "resnet50", ANN_EPOCHS: "1"}).model == "resnet50"


def test_scheduler_annotations_round_trip():
    patch = allocation_annotations(node="n1", cache_bytes=50e9 + 0.4, pod_io=1.25e8, job_io=2.5e8, scheduled_at=12.5)
    state = parse_scheduler_state("p", {k: v for k, v in patch.items() if v is not None})
    assert (state.node, state.cache_bytes, state.remote_io, state.job_remote_io, state.scheduled_at) == (
        "n1", 50e9, 1.25e8, 2.5e8, 12.5)
    assert allocation_annotations(node=None, cache_bytes=None, pod_io=None, job_io=None, scheduled_at=None)[ANN_CACHE] is None
    with pytest.raises(AnnotationError, match=ANN_CACHE):
        parse_scheduler_state("p", {ANN_NODE: "n1", ANN_CACHE: "lots"})
    assert {ANN_NODE, ANN_CACHE, ANN_IO, ANN_JOB_IO} <= set(patch)


@pytest.mark.parametrize("text,gpus", [("2", 2), ("0", 0), ("4000m", 4)])
def test_gpu_quantities(text, gpus):
    assert parse_gpu_quantity(text, "q") == gpus


@pytest.mark.parametrize("text", ["1.5", "500m", "-1", "two"])
def test_bad_gpu_quantities(text):
    with pytest.raises(AnnotationError):
        parse_gpu_quantity(text, "q")


def _pod(name, gpus, node=None, phase="Pending", init_gpus=0, scheduler="silod", job=None):
    def res(n):
        return client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(n)}) if n else None
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, namespace="ns", labels={"silod.io/job": job} if job else None),
        spec=client.V1PodSpec(
            scheduler_name=scheduler, node_name=node,
            containers=[client.V1Container(name="a", resources=res(gpus)), client.V1Container(name="b")],
            init_containers=[client.V1Container(name="i", resources=res(init_gpus))] if init_gpus else None,
        ),
        status=client.V1PodStatus(phase=phase),
    )


def _node(name, gpus, ready=True, unschedulable=False):
    return client.V1Node(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1NodeSpec(unschedulable=unschedulable),
        status=client.V1NodeStatus(allocatable={"nvidia.com/gpu": str(gpus), "cpu": "32"},
                                   conditions=[client.V1NodeCondition(type="Ready", status="True" if ready else "False")]),
    )


def test_gpu_accounting_from_client_models():
    state = ClusterState.build(
        [_node("a", 8), _node("b", 4), _node("c", 8, ready=False), _node("d", 8, unschedulable=True)],
        [
            _pod("x", 2, node="a", scheduler="default-scheduler"),  # another scheduler's pod still holds GPUs
            _pod("y", 1, node="a", init_gpus=3),  # init container needs more than the app: 3
            _pod("done", 4, node="b", phase="Succeeded"),  # finished pods hold nothing
            _pod("z", 4, node="b"),
            _pod("pending", 8),  # not bound: holds nothing
        ],
    )
    assert state.used_gpus() == {"a": 5, "b": 4}
    assert state.free_gpus() == {"a": 3, "b": 0}  # c not Ready and d cordoned offer nothing
    assert state.total_gpus == 12
    assert state.foreign_gpus() == 9  # none of them carries the silod job label


def _view(name, gpus, selector=None, tolerations=()):
    return PodView("ns", name, "", "silod", None, "Pending", gpus, {}, {}, selector or {}, tuple(tolerations))


def test_gang_all_or_nothing():
    nodes = {n: NodeView(n, 4, None, {}) for n in ("n1", "n2")}
    gang = [_view("p0", 4), _view("p1", 4)]
    assert place_gang(gang, nodes, {"n1": 4, "n2": 4}) == {"ns/p0": "n1", "ns/p1": "n2"} or \
        place_gang(gang, nodes, {"n1": 4, "n2": 4}) == {"ns/p0": "n2", "ns/p1": "n1"}
    assert place_gang(gang, nodes, {"n1": 4, "n2": 3}) is None  # 7 free GPUs, but not 2 x 4


def test_gang_search_finds_packings_best_fit_misses():
    nodes = {n: NodeView(n, 8, None, {}) for n in ("n0", "n1")}
    gang = [_view("a", 2), _view("b", 3), _view("c", 3), _view("d", 2)]
    placed = place_gang(gang, nodes, {"n0": 4, "n1": 6})  # best-fit-decreasing alone fails here
    assert placed is not None
    load = {"n0": 0, "n1": 0}
    for pod in gang:
        load[placed[pod.key]] += pod.gpus
    assert load == {"n0": 4, "n1": 6}


def test_gang_respects_node_selector_and_taints():
    nodes = {
        "v100": NodeView("v100", 8, None, {"gpu": "v100"}),
        "a100": NodeView("a100", 8, None, {"gpu": "a100"}, taints=(Taint("dedicated", "ml", "NoSchedule"),)),
    }
    free = {"v100": 8, "a100": 8}
    assert place_gang([_view("p", 4, {"gpu": "a100"})], nodes, free) is None  # tainted, not tolerated
    tol = [Toleration("dedicated", "Equal", "ml", "NoSchedule")]
    assert place_gang([_view("p", 4, {"gpu": "a100"}, tol)], nodes, free) == {"ns/p": "a100"}
    assert place_gang([_view("p", 4)], nodes, free) == {"ns/p": "v100"}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.lists(st.integers(0, 8), min_size=1, max_size=3))
def test_gang_placement_is_sound_and_complete(gpus, capacity):
    nodes = {f"n{i}": NodeView(f"n{i}", 8, None, {}) for i in range(len(capacity))}
    free = {f"n{i}": c for i, c in enumerate(capacity)}
    gang = [_view(f"p{i}", g) for i, g in enumerate(gpus)]
    placed = place_gang(gang, nodes, free)
    feasible = any(
        all(sum(g for g, n in zip(gpus, assign) if n == node) <= free[node] for node in free)
        for assign in itertools.product(free, repeat=len(gpus))
    )
    assert (placed is not None) == feasible
    if placed is not None:
        for node in free:
            assert sum(p.gpus for p in gang if placed[p.key] == node) <= free[node]
