"""Each node's cache disk comes from its node agent (issue 44, round 3).

On the REAL control plane (tests/k8s_testenv.py: kube-apiserver v1.24.0-alpha snapshot, RBAC from
deploy/base): a real `silod serve --backend kubernetes` (tests/sdk_helpers.Served) checking agent
tokens with a real TokenReview as its own service account, and a real `silod agent` process for
node A with its pod's projected token (a TokenRequest bound to an agent pod on node A, as
kubelet makes it). The agent measures its cache directory (statvfs) capped by its --cache-size and
sends it with its consumption reports; the scheduler plans node A with it ("agent" in
/v1/cluster), node B keeps its silod.io/cache-capacity annotation ("annotation"). Node A's agent
reports a smaller disk than the even share it had before, so a job whose dataset's cache does
not fit there is placed on node B (placement's tie-break by name would have chosen A).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import httpx
import pytest

from dataplane_helpers import make_dataset, silod_cmd
from k8s_testenv import SILOD_SA, ControlPlane, wait
from sdk_helpers import ADMIN_TOKEN, Served

try:
    from test_agent_tokenreview import AGENT_SA, NS, _pod, _token
except ImportError:
    from tests.test_agent_tokenreview import AGENT_SA, NS, _pod, _token

pytestmark = [pytest.mark.slow]

CAP = 3_000_000_000  # the agent's --cache-size: far below the even share (100 GB) node A had


def test_a_nodes_cache_is_what_its_agent_reports_and_a_smaller_disk_gets_less_cache(control_plane: ControlPlane,
                                                                                     tmp_path):
    cp = control_plane
    tag = uuid.uuid4().hex[:6]
    a, b, tenant = f"cd-a-{tag}", f"cd-b-{tag}", f"cd-t-{tag}"
    cp.add_namespace(tenant, {"pod-security.kubernetes.io/enforce": "restricted"})
    here = {"cache-disk-test": tag}  # the job's nodeSelector: other tests' nodes are not candidates
    cp.add_node(a, 4, labels=here)
    cp.add_node(b, 4, labels=here, annotations={"silod.io/cache-capacity": "80GB"})
    ds = make_dataset(tmp_path / "remote", n_files=4)
    kube = {"SILOD_KUBE_API": cp.url, "SILOD_KUBE_CA_FILE": str(cp.ca), "SILOD_KUBE_TOKEN_FILE": str(cp.token_file(SILOD_SA))}
    served = Served(tmp_path, "--backend-opt", f"kubeconfig={cp.kubeconfig(SILOD_SA)}", "--policy", "fifo",
                    "--gpus", "64", "--gpus-per-node", "8", "--cache", "200GB", "--remote-io", "1GB/s",
                    "--allow-uri", f"file://{tmp_path / 'remote'}/", "--agent-service-account", f"{NS}:{AGENT_SA}",
                    backend="kubernetes", tokens={tenant: f"{tenant}-token-01"}, env=kube)
    agent = None
    try:
        op = httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)

        def nodes() -> dict[str, dict]:
            r = op.get("/v1/cluster")
            assert r.status_code == 200, r.text
            return {n["name"]: n for n in r.json()["nodes"]}

        # Before any report: A has an even share of --cache (over the Ready GPU nodes), B its annotation.
        wait(lambda: {n: (v["cache"], v["cache_source"]) for n, v in nodes().items() if n in (a, b)}
             == {a: (200e9 / _gpu_nodes(cp), "share"), b: (80e9, "annotation")}, 60,
             lambda: f"the nodes before any report: {nodes()}", interval=0.5)

        pod = _pod(cp, f"agent-{tag}", a)
        token_file = tmp_path / "agent-token"
        token_file.write_text(_token(cp, pod))
        cache_root = tmp_path / "agent-state"
        agent = subprocess.Popen(
            [*silod_cmd(), "agent", "--node", a, "--socket", str(tmp_path / "csi.sock"), "--state-dir", str(cache_root),
             "--kubelet-dir", str(tmp_path / "kubelet"), "--scheduler", served.url, "--report-interval", "1",
             "--report-token-file", str(token_file), "--cache-size", "3GB"],
            env={**{k: v for k, v in os.environ.items() if not k.startswith("SILOD_")},
                 "SILOD_AGENT_TOKEN_FILE": str(token_file)},
            stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        st = os.statvfs(tmp_path)
        expected = min(st.f_blocks * st.f_frsize, CAP)  # the disk under the cache directory, capped
        wait(lambda: (nodes()[a]["cache"], nodes()[a]["cache_source"]) == (expected, "agent"), 60,
             lambda: f"node A's agent-reported disk: {nodes().get(a)}; agent: {(tmp_path / 'agent.log').read_text()[-1500:]}",
             interval=0.5)
        assert (nodes()[b]["cache"], nodes()[b]["cache_source"]) == (80e9, "annotation")

        # The plan: a job whose dataset wants 50 GB of cache on its node goes to B, not to A.
        user = httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.tokens[tenant]}"}, timeout=30)
        r = user.post("/v1/datasets", json={"name": "big", "uri": f"file://{ds.root}", "size": "50GB"})
        assert r.status_code == 201, r.text
        r = user.post("/v1/jobs", json={"name": "j", "gpus": 4, "dataset": "big", "epochs": 1,
                                        "ideal_throughput": "100MB/s",
                                        "pod_template": {"image": "trainer:1", "node_selector": here}})
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        # Admitted: silod unsuspended its Job with the placement (the job is "running" in silod from
        # the round that starts it, a moment before the backend writes the Job).
        stored = wait(lambda: (j := cp.job(tenant, f"silod-{job}"))["spec"].get("suspend") is False and j, 90,
                      lambda: f"the job admitted: {user.get(f'/v1/jobs/{job}').json()}", interval=0.5)
        terms = stored["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        hosts = {v for t in terms for e in t["matchExpressions"] if e["key"] == "kubernetes.io/hostname" for v in e["values"]}
        assert hosts == {b}, hosts
        used = op.get("/v1/cluster").json()["cache"]["used"]
        assert used > expected, used  # the job's cache: more than node A's disk could ever hold

        # Only node A's agent may say what node A's disk is; nobody says it for another node.
        agent_token = token_file.read_text()
        r = httpx.post(f"{served.url}/v1/agents/{b}/consumption", json={"pods": [], "cache_disk_bytes": 10**15},
                       headers={"Authorization": f"Bearer {agent_token}"}, timeout=30)
        assert r.status_code == 403, r.text
        r = user.post(f"/v1/agents/{a}/consumption", json={"pods": [], "cache_disk_bytes": 10**15})
        assert r.status_code == 403, r.text
        for bad in (-1, 2**60, "1TB", 1.5):
            r = httpx.post(f"{served.url}/v1/agents/{a}/consumption", json={"pods": [], "cache_disk_bytes": bad},
                           headers={"Authorization": f"Bearer {agent_token}"}, timeout=30)
            assert r.status_code == 422 and "cache_disk_bytes" in r.text, (bad, r.text)
        time.sleep(2)
        assert nodes()[b]["cache"] == 80e9 and nodes()[a]["cache"] == expected
    finally:
        if agent is not None and agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(30)
        served.stop()
        cp.cleanup_namespace(tenant)
        cp.delete_nodes([a, b])
        try:
            cp.core.delete_namespaced_pod(f"agent-{tag}", NS, grace_period_seconds=0)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _gpu_nodes(cp: ControlPlane) -> int:
    """Ready, schedulable GPU nodes now (other tests' nodes on the shared control plane count too)."""
    count = 0
    for n in cp.core.list_node().items:
        conds = {c.type: c.status for c in (n.status.conditions or [])}
        if not (n.spec and n.spec.unschedulable) and conds.get("Ready") == "True" \
                and int((n.status.allocatable or {}).get("nvidia.com/gpu", "0")) > 0:
            count += 1
    return count


def test_an_agents_report_counts_while_fresh_then_the_fallback_is_back(tmp_path):
    """The store keeps each node's latest report; a report older than the freshness window is not
    read (the agent may be gone, the disk replaced). Real SQLite, the store's own clock."""
    from sqlalchemy.orm import sessionmaker

    from scheduler.backends.kubernetes.backend import AGENT_DISK_FRESH_S
    from scheduler.service.consumption import ConsumptionStore
    from scheduler.service.db import open_database

    now = [1000.0]
    store = ConsumptionStore(sessionmaker(open_database(f"sqlite:///{tmp_path / 'c.db'}")), clock=lambda: now[0])
    store.record_cache_disk("n1", "agent-a", 5e9)
    store.record_cache_disk("n1", "agent-a", 4e9)  # the latest wins
    now[0] += 30
    store.record_cache_disk("n2", "agent-b", 7e9)
    assert store.cache_disks(AGENT_DISK_FRESH_S) == {"n1": 4e9, "n2": 7e9}
    now[0] += AGENT_DISK_FRESH_S - 10
    assert store.cache_disks(AGENT_DISK_FRESH_S) == {"n2": 7e9}
