"""End to end on an EMULATED Kubernetes (tests/k8s_emulator.py; the same scenario on the real control plane is
tests/test_kubernetes_real_e2e.py, without the cgroup-measured consumption checked here):

one `silod serve --backend kubernetes` program (REST over real HTTP, one SQLite database, the
scheduling loop with the Gavel policy, the admission controller) and one real `silod agent`
(CSI over a real unix socket, real FUSE and bind mounts). A job submitted by REST and one created
"with kubectl" are admitted in policy order, time-shared by suspension in Gavel rounds, resumed,
and finished; their pods read the dataset through the CSI-published mount. The emulator's Job
controller, scheduler and kubelet do what the real ones do for these objects (its docstring says
what is and is not emulated); the tests below play the training containers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from dataplane_helpers import force_unmount, make_dataset, require_fuse, silod_cmd
from k8s_emulator import EmulatedCluster
from scheduler.service.api.app import create_app
from scheduler.service.api.auth import TokenStore, load_token_key
from scheduler.service.scheduler_process import ADMIN, Principal
from scheduler.service.cli import build_service
from test_kubernetes_admission import SAFE_CONTAINER, kubectl_job
from test_kubernetes_webhook import SILOD_SA

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

ADMIN_TOKEN = "admin-token-0123456789"
ALICE = "alice-token-0001"
AGENT = "agent-token-00003"

def _token_store(service, tokens_file):  # type: ignore[no-untyped-def]
    """The admin token and the tenants' tokens file, stored hashed in the service's database."""
    store = TokenStore(service.engine, load_token_key(tokens_file.parent / "token-key"), admin_token=ADMIN_TOKEN)
    store.import_file(tokens_file)
    return store



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world(tmp_path):
    require_fuse()
    if os.geteuid() != 0:
        pytest.fail("bind mounts need root") if os.environ.get("CI", "").lower() == "true" else pytest.skip("needs root")
    ds = make_dataset(tmp_path / "remote", n_files=40)
    sock = tmp_path / "plugins" / "silod.io" / "csi.sock"
    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\nagent:{AGENT}\n")
    with EmulatedCluster(kubelet_root=kubelet, csi_sockets={"n1": str(sock)}) as cluster:
        cluster.add_namespace("alice", {"pod-security.kubernetes.io/enforce": "restricted"})
        cluster.add_node("n1", 4, cache="1GB", remote_io="1GB/s")
        # silod talks to the API server as its service account (the webhook lets only it unsuspend).
        cluster.call(lambda em: em.users.__setitem__("scheduler-sa-token", SILOD_SA))
        (tmp_path / "sa-token").write_text("scheduler-sa-token\n")
        service = build_service(db=f"sqlite:///{tmp_path / 'silod.db'}", backend="kubernetes", policy="gavel",
                                round_s=4.0, gpus="4", gpus_per_node="4", cache="1GB", remote_io="1GB/s",
                                state_dir=tmp_path / "state",
                                backend_opts={"server": cluster.url, "token-file": str(tmp_path / "sa-token")},
                                allowed_uris=[f"file://{tmp_path / 'remote'}/"],  # the operator allows the local dataset
                                # the agent's token looks up alice's dataset to mount it, and is bound to
                                # node n1: its consumption reports count for n1's pods only
                                node_agents=["agent=n1"])
        service.config = dataclasses.replace(service.config, poll_seconds=0.2, min_event_gap_s=0.5)
        import uvicorn

        port = free_port()
        app = create_app(service, _token_store(service, tokens), run_loop=True)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        agent_log = open(tmp_path / "agent.log", "ab")
        agent = subprocess.Popen(
            [*silod_cmd(), "agent", "--socket", str(sock), "--state-dir", str(tmp_path / "agent"), "--node", "n1",
             "--scheduler", url, "--kubelet-dir", str(kubelet), "--report-interval", "0.5"],
            stdout=agent_log, stderr=subprocess.STDOUT, env={**os.environ, "SILOD_AGENT_TOKEN": AGENT})
        # The scheduler's admission webhook, installed as deploy/base's configuration.
        from scheduler.backends.kubernetes.webhook import WebhookServer
        from test_kubernetes_webhook import install_webhook
        from tls_helpers import issue, make_ca

        ca = make_ca(tmp_path / "pki", "webhook-ca")
        serving = issue(ca, tmp_path / "pki", "webhook", dns=("silod-scheduler.silod-system.svc",))
        webhook = WebhookServer("127.0.0.1", 0, serving.cert, serving.key, admitters=frozenset({SILOD_SA})).start()
        install_webhook(cluster, {"ca": ca}, webhook)
        try:
            cluster.wait(sock.exists, what="the agent's socket")
            yield cluster, service, url, ds
        finally:
            webhook.stop()
            server.should_exit = True
            thread.join(20)
            agent.terminate()
            agent.wait(30)
            for line in reversed(Path("/proc/mounts").read_text().splitlines()):
                if line.split()[1].startswith(str(tmp_path)):
                    force_unmount(Path(line.split()[1]))


READER = """
import hashlib, json, sys
from pathlib import Path
root = Path(sys.argv[1])
out = {}
for rel in json.loads(sys.argv[2]):
    out[rel] = hashlib.sha256((root / rel).read_bytes()).hexdigest()
print(json.dumps(out))
"""


def read_volume(cluster: EmulatedCluster, pod, path: Path, ds) -> int:  # type: ignore[no-untyped-def]
    """The container reads every item through the published volume, as a process in the pod's
    cgroup (so the node agent attributes the reads to the pod)."""
    import json
    import sys

    done = cluster.run_in_pod(pod, [sys.executable, "-c", READER, str(path), json.dumps(sorted(ds.digests))])
    if done.returncode != 0:
        raise OSError(f"reader failed: {done.stderr[-300:]}")
    got = json.loads(done.stdout)
    assert got == ds.digests
    return sum(ds.sizes[rel] for rel in got)


def suspend_timeline(cluster: EmulatedCluster) -> list[tuple[str, bool]]:
    """(Job name, suspended) each time a Job's spec.suspend changed, in resourceVersion order."""
    out: list[tuple[str, bool]] = []
    last: dict[str, bool] = {}
    for _rv, key, _kind, obj in cluster.call(lambda em: list(em.history)):
        if key != ("batch", "jobs"):
            continue
        name, susp = obj["metadata"]["name"], bool(obj["spec"].get("suspend"))
        if last.get(name) != susp:
            last[name] = susp
            out.append((name, susp))
    return out


def test_rest_and_kubectl_jobs_share_one_queue_gavel_time_shares_them_by_suspension(world):
    cluster, service, url, ds = world
    h = {"Authorization": f"Bearer {ALICE}"}
    with httpx.Client(base_url=url, headers=h, timeout=30) as api:
        r = api.post("/v1/datasets", json={"name": "ds", "uri": f"file://{ds.root}", "size": ds.total})
        assert r.status_code == 201, r.text
        r = api.post("/v1/jobs", json={"name": "by-rest", "gpus": 4, "dataset": "ds", "epochs": 1,
                                       "ideal_throughput": "1MB/s", "pod_template": {"image": "trainer:1"}})
        assert r.status_code == 201, r.text
        rest_id = r.json()["id"]
    rest_job = f"silod-{rest_id}"
    time.sleep(0.3)
    # Created running, as most users write a Job: the webhook suspends it at creation.
    manifest = kubectl_job("by-kubectl", gpus=4, dataset="ds", container=SAFE_CONTAINER, suspend=False)
    manifest["metadata"]["annotations"]["silod.io/ideal-throughput"] = "1MB/s"
    cluster.call(lambda em: em.create(em.resources[("batch", "jobs")], "alice", manifest))

    runs: dict[str, int] = {rest_job: 0, "by-kubectl": 0}
    read: dict[str, int] = {}
    full_reads: dict[str, int] = {rest_job: 0, "by-kubectl": 0}
    seen_pods: set[str] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = [j for j in cluster.objects("jobs", group="batch", namespace="alice")
                if any(c["type"] == "Complete" and c["status"] == "True" for c in (j.get("status") or {}).get("conditions", []))]
        if len(done) == 2:
            break
        for name in runs:
            for pod in cluster.pods_of("alice", name):
                if pod["status"].get("phase") != "Running" or pod["metadata"]["uid"] in seen_pods:
                    continue
                seen_pods.add(pod["metadata"]["uid"])
                runs[name] += 1
                vol = "dataset" if name == rest_job else "data"
                path = cluster.volume_path(pod, vol)
                assert path is not None
                try:
                    read[name] = read_volume(cluster, pod, path, ds)  # the container reads its data through CSI
                    full_reads[name] += 1
                except OSError:
                    # Preempted while reading: the Job controller removed the pod and kubelet
                    # unpublished its volume, as a real container would be killed mid-epoch.
                    if any(p["metadata"]["uid"] == pod["metadata"]["uid"] for p in cluster.pods_of("alice", name)):
                        raise
                    continue
                if runs[name] >= 2:  # finish on its second run: it was preempted and resumed first
                    cluster.finish_pod("alice", pod["metadata"]["name"])
        time.sleep(0.1)
    timeline = suspend_timeline(cluster)
    assert not cluster.controller_errors
    admin = Principal(ADMIN, is_admin=True)
    jobs = {j.name: j for j in service.list_jobs(admin)}
    assert len(done) == 2, (timeline, runs, {k: (v.state, v.message) for k, v in jobs.items()})
    cluster.wait(lambda: all(j.state == "finished" for j in service.list_jobs(admin)), what="the service to see both end")
    jobs = {j.name: j for j in service.list_jobs(admin)}

    # The kubectl Job was created running and stored suspended (the webhook's patch), so its
    # first pods came from silod's admission, not from its creation.
    assert ("suspend.silod.io", "CREATE", "Job/by-kubectl", True) in cluster.em.webhook_calls
    assert next(susp for name, susp in timeline if name == "by-kubectl") is True
    # silod's admissions were UPDATE reviews of its own service account, and the webhook let them through.
    assert ("suspend.silod.io", "UPDATE", "Job/by-kubectl", False) in cluster.em.webhook_calls
    # Policy order: the REST job (submitted first) was admitted first, the kubectl one waited.
    admissions = [name for name, susp in timeline if not susp]
    assert admissions[0] == rest_job
    # A Gavel round preempted by suspension and resumed: each ran twice, alternating.
    assert (rest_job, True) in timeline[timeline.index((rest_job, False)) + 1:]
    assert admissions.count(rest_job) >= 2 and admissions.count("by-kubectl") >= 2
    assert runs[rest_job] >= 2 and runs["by-kubectl"] >= 2
    assert read == {rest_job: ds.total, "by-kubectl": ds.total}
    # One program, one database, one queue; silod never deleted a pod or a user's workload.
    kube = next(j for n, j in jobs.items() if n.startswith("job.by-kubectl."))
    assert jobs["by-rest"].state == kube.state == "finished" and kube.owner == jobs["by-rest"].owner == "alice"
    assert not [r for r in cluster.em.requests if r[0] == "DELETE"]
    rpcs = {c[0] for c in cluster.em.csi_calls}
    assert rpcs == {"NodePublishVolume", "NodeUnpublishVolume"}

    # Trusted consumption: the agent measured what each job's pods read (attributed by their
    # cgroup, reported with its node-bound token) and GET /v1/jobs/{id} shows it.
    def measured(job_id: str) -> dict | None:
        r = httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["measured"]
    seen = []
    for job, name in ((jobs["by-rest"], rest_job), (kube, "by-kubectl")):
        # Every complete read of a pod, at least (a pod preempted mid-read adds what it read).
        want = full_reads[name] * ds.total
        m = cluster.wait(lambda job=job, want=want: (m := measured(job.id)) and m["read_bytes"] >= want and m,
                         timeout=30, what=lambda job=job: f"measured consumption of job {job.id}: {measured(job.id)}")
        pods_read = runs[name]
        assert m["read_bytes"] <= pods_read * ds.total  # never more than its pods read
        assert m["read_bytes"] == m["hit_bytes"] + m["miss_bytes"]
        assert m["hits"] + m["misses"] >= len(ds.digests) and 1 <= m["pods"] <= pods_read
        # The misses the pods' mount delivered whole, with their service time (the loader term's L
        # for a Kubernetes pod's job): never more than the pods' misses, and about a read's time.
        assert m["miss_service_count"] <= m["misses"] and m["miss_service_bytes"] <= m["miss_bytes"], m
        assert m["miss_service_us"] <= m["miss_service_count"] * 60 * 10**6, m
        seen.append(m)
    # The dataset's first read (by whichever job's pod came first) missed, and the agent reported
    # those misses' service time with the pod's counters.
    assert sum(m["misses"] for m in seen) >= 1, seen
    assert sum(m["miss_service_count"] for m in seen) >= 1 and sum(m["miss_service_us"] for m in seen) > 0, seen
