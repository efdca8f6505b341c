"""Kubernetes backend integration tests: the REAL `kubernetes` client against an EMULATED API server.

No real cluster can run on the test machines. tests/k8s_emulator.py serves kmock's in-memory
Kubernetes emulator (plus the pods/binding subresource) over HTTP on 127.0.0.1; the scheduler
talks to it exactly as it would to a cluster: list/watch/patch/binding/events through CoreV1Api.
Kubelets are not emulated: a test finishes a pod by patching its status.phase.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client

sys.path.insert(0, str(Path(__file__).parent))
from k8s_emulator import EVENTS, EmulatedCluster  # noqa: E402

from estimator.errors import UserError  # noqa: E402
from policies.registry import estimator_for, get_policy  # noqa: E402
from policies.types import ClusterCapacity  # noqa: E402
from scheduler.backends.base import BackendConfig, ClusterBackend, JobAllocation, JobSpec, DatasetInfo, load_backend  # noqa: E402
from scheduler.backends.kubernetes import KubernetesBackend, KubernetesScheduler, Watcher  # noqa: E402
from scheduler.backends.kubernetes.contract import (  # noqa: E402
    ANN_CACHE, ANN_IO, ANN_JOB_IO, ANN_NODE, LABEL_JOB,
)

GB, MB = 1e9, 1e6
NS = "default"


@pytest.fixture()
def cluster():
    with EmulatedCluster() as c:
        yield c


def make_node(api, name, gpus, **labels):
    api.create_node({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "32"},
                   "conditions": [{"type": "Ready", "status": "True"}]},
    })


def make_pod(api, name, *, job=None, gpus=1, pods=1, scheduler="silod", node=None, annotations=None,
             dataset="imagenet", size="100GB", ideal="200MB/s", epochs="2"):
    ann = {"silod.io/pods": str(pods), "silod.io/dataset": dataset, "silod.io/dataset-size": size,
           "silod.io/ideal-throughput": ideal, "silod.io/epochs": epochs}
    ann.update(annotations or {})
    spec = {"schedulerName": scheduler,
            "containers": [{"name": "train", "image": "trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}}]}
    if node:
        spec["nodeName"] = node
    api.create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL_JOB: job} if job else {},
                     "annotations": ann if job else {}},
        "spec": spec,
    })


def set_phase(api, name, phase):
    api.patch_namespaced_pod(name, NS, {"status": {"phase": phase}}, _content_type="application/merge-patch+json")


def scheduler_for(cluster, policy="fifo", cache=50 * GB, remote_io=1 * GB):
    backend = KubernetesBackend(cluster.api())
    return KubernetesScheduler(backend, get_policy(policy), estimator_for("silod"), cache=cache, remote_io=remote_io)


def pods(api):
    return {p.metadata.name: p for p in api.list_namespaced_pod(NS).items}


def events(cluster, reason=None):
    return [e for e in cluster.objects(EVENTS) if reason is None or e.get("reason") == reason]


def test_backend_conforms_and_loads_by_name(cluster, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emu\n"
        f"clusters: [{{name: emu, cluster: {{server: '{cluster.url}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: u}}]\n")
    make_node(cluster.api(), "n1", 8)
    capacity = ClusterCapacity(gpus=8, cache=100 * GB, remote_io=1 * GB)
    backend = load_backend("kubernetes", BackendConfig(capacity=capacity, state_dir=tmp_path,
                                                       options={"kubeconfig": str(kubeconfig)}))
    assert isinstance(backend, ClusterBackend) and isinstance(backend, KubernetesBackend)
    desc = backend.describe()
    assert [(n.name, n.gpus, n.cache) for n in desc.nodes] == [("n1", 8, 100 * GB)]
    assert desc.remote_io == 1 * GB
    backend.stop("no-such-job")  # idempotent, never raises
    assert backend.poll() == []


def test_gang_binds_two_pod_job_only_when_both_fit(cluster):
    api = cluster.api()
    make_node(api, "n1", 4)
    make_node(api, "n2", 4)
    make_pod(api, "other", gpus=1, scheduler="default-scheduler", node="n2")  # holds 1 GPU on n2
    make_pod(api, "a-0", job="a", gpus=4, pods=2)
    sched = scheduler_for(cluster)

    sched.run_once()  # only one of the two pods exists yet
    assert cluster.bindings() == []
    make_pod(api, "a-1", job="a", gpus=4, pods=2)
    report = sched.run_once()  # 7 GPUs free, but not 2 x 4
    assert cluster.bindings() == [] and report.started == []
    assert all(p.spec.node_name is None for n, p in pods(api).items() if n.startswith("a-"))
    assert events(cluster, "SiloDWaitingForGPUs")

    set_phase(api, "other", "Succeeded")  # its GPU is released
    report = sched.run_once()
    assert report.started == ["default/a"]
    now = pods(api)
    assert {now["a-0"].spec.node_name, now["a-1"].spec.node_name} == {"n1", "n2"}
    assert sorted((b[1], b[3]) for b in cluster.bindings()) == [("a-0", 201), ("a-1", 201)]


def test_gpu_accounting_across_nodes(cluster):
    api = cluster.api()
    make_node(api, "big", 8)
    make_node(api, "small", 2)
    make_pod(api, "foreign", gpus=6, scheduler="default-scheduler", node="big")
    for i in range(4):
        make_pod(api, f"j{i}", job=f"j{i}", gpus=1)
    make_pod(api, "wide", job="wide", gpus=3)
    sched = scheduler_for(cluster)
    sched.run_once()
    state = sched.backend.refresh()
    used = state.used_gpus()
    assert used["big"] <= 8 and used["small"] <= 2
    assert sum(used.values()) == 6 + 4  # the four 1-GPU jobs fit; the 3-GPU job does not (2 + 2 free)
    assert pods(api)["wide"].spec.node_name is None
    assert state.free_gpus() == {"big": 0, "small": 0}
    assert sched.backend.describe().gpus == 10


def test_allocation_annotations_written_and_io_split(cluster):
    api = cluster.api()
    make_node(api, "n1", 4)
    make_node(api, "n2", 4)
    make_pod(api, "a-0", job="a", gpus=3, pods=2, ideal="400MB/s")
    make_pod(api, "a-1", job="a", gpus=1, pods=2, ideal="400MB/s")
    # b's dataset is smaller and read faster: more cache efficient (f*/d), it is cached first.
    make_pod(api, "b-0", job="b", gpus=2, dataset="openimages", size="50GB", ideal="400MB/s")
    sched = scheduler_for(cluster, cache=60 * GB, remote_io=300 * MB)
    report = sched.run_once()
    plan = report.plan
    assert plan is not None and set(plan.running) == {"default/a", "default/b"}
    now = pods(api)
    for job, names, dataset in (("default/a", ["a-0", "a-1"], "imagenet"), ("default/b", ["b-0"], "openimages")):
        anns = [now[n].metadata.annotations for n in names]
        assert {a[ANN_CACHE] for a in anns} == {str(round(plan.cache[dataset]))}  # same on every pod
        assert all(float(a[ANN_JOB_IO]) == pytest.approx(plan.remote_io[job], abs=1) for a in anns)
        assert sum(float(a[ANN_IO]) for a in anns) == pytest.approx(plan.remote_io[job], abs=2)
        assert all(a[ANN_NODE] == now[n].spec.node_name for a, n in zip(anns, names, strict=True))
    a0, a1 = (float(now[n].metadata.annotations[ANN_IO]) for n in ("a-0", "a-1"))
    assert a0 == pytest.approx(3 * a1, rel=1e-6)  # split by GPUs: 3:1
    assert sum(plan.cache.values()) <= 60 * GB + 1
    assert plan.cache["openimages"] == pytest.approx(50 * GB) and plan.cache["imagenet"] < 60 * GB

    # The plan changes when a job finishes: the survivor's annotations follow, its binding does not.
    set_phase(api, "b-0", "Succeeded")
    report = sched.run_once()
    assert any(e.job_id == "default/b" and e.kind == "finished" for e in report.events)
    assert report.updated == ["default/a"]
    assert report.plan.cache["imagenet"] == pytest.approx(60 * GB)
    assert float(pods(api)["a-0"].metadata.annotations[ANN_CACHE]) == pytest.approx(report.plan.cache["imagenet"], abs=1)
    assert len(cluster.bindings()) == 3


def test_restart_rebuilds_state_from_annotations(cluster):
    api = cluster.api()
    make_node(api, "n1", 4)
    make_node(api, "n2", 4)
    make_pod(api, "a-0", job="a", gpus=4, pods=2)
    make_pod(api, "a-1", job="a", gpus=4, pods=2)
    first = scheduler_for(cluster)
    first.run_once()
    first.backend.refresh()  # placements() reads the state of the last refresh
    before = first.backend.placements()
    assert set(before) == {"default/a"} and len(cluster.bindings()) == 2
    make_pod(api, "b-0", job="b", gpus=2)  # arrives while the scheduler is down; no room for it

    restarted = scheduler_for(cluster)  # a new process: new client, no memory
    report = restarted.run_once()
    assert restarted.backend.placements()["default/a"] == before["default/a"]  # allocation recovered
    assert len(cluster.bindings()) == 2  # nothing bound twice, b not squeezed in
    assert report.started == [] and pods(api)["b-0"].spec.node_name is None
    assert restarted.core.planner.received.get("default/a", 0.0) >= 0.0
    assert "default/a" in restarted.core.planner.received  # GPU time it already had is restored

    set_phase(api, "a-0", "Succeeded")
    set_phase(api, "a-1", "Succeeded")
    report = restarted.run_once()  # the recovered job is tracked: its end is reported, b starts
    assert [(e.job_id, e.kind) for e in report.events] == [("default/a", "finished")]
    assert report.started == ["default/b"]


def test_interrupted_gang_is_completed_where_promised(cluster):
    api = cluster.api()
    make_node(api, "n1", 4)
    make_node(api, "n2", 4)
    make_node(api, "n3", 4)
    intent = {ANN_CACHE: "1000", ANN_IO: "50000000", ANN_JOB_IO: "100000000", "silod.io/scheduled-at": "100.0"}
    # A crash after the intent was written and a-0 bound, before a-1 was bound.
    make_pod(api, "a-0", job="a", gpus=4, pods=2, node="n3", annotations={**intent, ANN_NODE: "n3"})
    make_pod(api, "a-1", job="a", gpus=4, pods=2, annotations={**intent, ANN_NODE: "n2"})
    sched = scheduler_for(cluster)
    sched.run_once()
    now = pods(api)
    assert (now["a-0"].spec.node_name, now["a-1"].spec.node_name) == ("n3", "n2")
    assert cluster.bindings() == [(NS, "a-1", "n2", 201)]
    sched.run_once()
    assert len(cluster.bindings()) == 1


def test_pods_without_silod_labels_are_ignored(cluster):
    api = cluster.api()
    make_node(api, "n1", 8)
    make_pod(api, "plain", gpus=1, scheduler="default-scheduler")  # someone else's pod
    make_pod(api, "nolabel", gpus=1)  # schedulerName silod but no job label: reported, not bound
    make_pod(api, "labelled-other", job="x", gpus=1, scheduler="default-scheduler")
    sched = scheduler_for(cluster)
    report = sched.run_once()
    sched.run_once()
    assert cluster.bindings() == [] and report.started == []
    assert not cluster.requests("PATCH", "pods")  # nothing was annotated either
    assert all(p.spec.node_name is None for p in pods(api).values())
    warned = events(cluster, "SiloDNoJobLabel")
    assert [e["involvedObject"]["name"] for e in warned] == ["nolabel"]  # once, not every round


@pytest.mark.parametrize("key,value", [
    ("silod.io/epochs", "-2"),
    ("silod.io/epochs", "many"),
    ("silod.io/ideal-throughput", "200 furlongs/s"),
    ("silod.io/dataset-size", "-100GB"),
    ("silod.io/pods", "two"),
])
def test_bad_annotations_leave_pod_pending_with_event(cluster, key, value, caplog):
    api = cluster.api()
    make_node(api, "n1", 8)
    make_pod(api, "bad-0", job="bad", gpus=1, annotations={key: value})
    make_pod(api, "good-0", job="good", gpus=1)
    sched = scheduler_for(cluster)
    report = sched.run_once()  # must not raise
    sched.run_once()
    now = pods(api)
    assert now["bad-0"].spec.node_name is None and report.started == ["default/good"]
    assert now["good-0"].spec.node_name == "n1"
    warned = events(cluster, "SiloDInvalidSpec")
    assert len(warned) == 1  # once per distinct problem, not once per round
    ev = warned[0]
    assert ev["type"] == "Warning" and ev["involvedObject"]["name"] == "bad-0"
    assert key in ev["message"] and "default/bad-0" in ev["message"]
    assert key in caplog.text


def test_bad_gpu_request_is_reported(cluster):
    api = cluster.api()
    make_node(api, "n1", 8)
    make_pod(api, "frac-0", job="frac", gpus="500m")
    scheduler_for(cluster).run_once()
    assert pods(api)["frac-0"].spec.node_name is None
    assert "whole devices" in events(cluster, "SiloDInvalidSpec")[0]["message"]


def test_binding_reply_quirk_of_the_client(cluster):
    """Why _bind skips deserialisation: the server replies with a Status, which the generated
    client cannot turn into a V1Binding, so a successful binding looks like an exception."""
    api = cluster.api()
    make_node(api, "n1", 1)
    make_pod(api, "p", job="p", gpus=1)
    body = client.V1Binding(metadata=client.V1ObjectMeta(name="p"),
                            target=client.V1ObjectReference(kind="Node", api_version="v1", name="n1"))
    with pytest.raises(ValueError):
        api.create_namespaced_pod_binding("p", NS, body)
    assert pods(api)["p"].spec.node_name == "n1"  # ... and yet it was bound


def test_service_mode_start_stop_poll(cluster):
    api = cluster.api()
    make_node(api, "n1", 8)
    make_pod(api, "s-0", job="svc", gpus=2)
    backend = KubernetesBackend(cluster.api())
    backend.refresh()
    spec = JobSpec(job_id="svc", name="svc", owner="me", gpus=2,
                   dataset=DatasetInfo("imagenet", "s3://b/imagenet", 100 * GB), ideal_throughput=200 * MB,
                   total_bytes=200 * GB, consumed_bytes=0.0)
    backend.start(spec, JobAllocation("svc", 2, 1.0, cache_bytes=10 * GB, remote_io=180 * MB))
    assert pods(api)["s-0"].metadata.annotations[ANN_JOB_IO] == "180000000"
    api.patch_namespaced_pod("s-0", NS, {"metadata": {"annotations": {"silod.io/consumed-bytes": "5000"}}},
                             _content_type="application/merge-patch+json")
    assert [(e.kind, e.consumed_bytes) for e in backend.poll()] == [("progress", 5000.0)]
    backend.stop("svc")
    backend.stop("svc")
    assert "s-0" not in pods(api)
    with pytest.raises(UserError, match="no pods labelled"):
        backend.start(JobSpec(job_id="ghost", name="g", owner="me", gpus=1, dataset=spec.dataset,
                              ideal_throughput=1.0, total_bytes=1.0, consumed_bytes=0.0),
                      JobAllocation("ghost", 1, 1.0, None, None))


def test_watcher_wakes_the_loop(cluster):
    api = cluster.api()
    wake = threading.Event()
    watcher = Watcher(cluster.api(), wake, read_timeout=2.0)
    watcher.start()
    try:
        time.sleep(0.3)
        wake.clear()
        make_pod(api, "late", job="late", gpus=1)
        assert wake.wait(5.0)
    finally:
        watcher.stop()


def test_run_forever_with_watcher_binds_new_gangs(cluster):
    api = cluster.api()
    make_node(api, "n1", 4)
    make_node(api, "n2", 4)
    sched = scheduler_for(cluster)
    stop = threading.Event()
    watcher = Watcher(cluster.api(), sched.wake, read_timeout=2.0)
    watcher.start()
    loop = threading.Thread(target=sched.run_forever, args=(60.0, stop), kwargs={"min_gap": 0.1}, daemon=True)
    loop.start()
    try:
        time.sleep(0.5)  # the first (empty) round has run; the next one waits 60 s unless woken
        make_pod(api, "g-0", job="g", gpus=4, pods=2)
        make_pod(api, "g-1", job="g", gpus=4, pods=2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(cluster.bindings()) < 2:
            time.sleep(0.1)
        assert sorted(b[1] for b in cluster.bindings()) == ["g-0", "g-1"]
    finally:
        stop.set()
        sched.wake.set()
        loop.join(5)
        watcher.stop()
    assert not loop.is_alive()


def test_cli_rejects_bad_flags_without_traceback(capsys):
    from scheduler.backends.kubernetes.__main__ import main

    assert main(["--cache", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--cache" in err and "Traceback" not in err
