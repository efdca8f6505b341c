"""Two real `silod serve --backend kubernetes` processes with leader election, against the
EMULATED API server (tests/k8s_emulator.py): one Lease holder admits workloads; when it dies,
the other takes the Lease over and admits the next one. Both serve the REST API."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest
from kubernetes import client

from dataplane_helpers import free_port, silod_cmd
from k8s_emulator import EmulatedCluster
from test_kubernetes_admission import kubectl_job

pytestmark = [pytest.mark.slow]
ADMIN = "admin-token-0123456789"


def serve(cluster: EmulatedCluster, tmp_path, identity: str, port: int) -> subprocess.Popen:
    log = open(tmp_path / f"{identity}.log", "ab")
    return subprocess.Popen(
        [*silod_cmd(), "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path / 'silod.db'}",
         "--backend", "kubernetes", "--gpus", "4", "--gpus-per-node", "4", "--cache", "1GB", "--remote-io", "1GB/s",
         "--policy", "fifo", "--round", "1s", "--state-dir", str(tmp_path / identity),
         "--backend-opt", f"server={cluster.url}", "--backend-opt", "leader-election=true",
         "--backend-opt", "lease-namespace=silod-system", "--backend-opt", f"identity={identity}",
         "--backend-opt", "lease-seconds=3"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SILOD_ADMIN_TOKEN": ADMIN})


def test_one_leader_admits_and_the_standby_takes_over(tmp_path):
    with EmulatedCluster() as cluster:
        cluster.add_namespace("silod-system")
        cluster.add_namespace("admin")
        cluster.add_node("n1", 4)
        ports = {"a": free_port(), "b": free_port()}
        procs = {"a": serve(cluster, tmp_path, "a", ports["a"])}
        try:
            leases = client.CoordinationV1Api(cluster.api_client())
            holder = lambda: leases.read_namespaced_lease("silod-scheduler", "silod-system").spec.holder_identity  # noqa: E731

            def lease_is(who: str) -> bool:
                try:
                    return holder() == who
                except client.exceptions.ApiException:
                    return False

            # Generous timeouts: a cold `silod serve` imports a lot, and CI machines are shared.
            cluster.wait(lambda: lease_is("a"), timeout=120, what=lambda: "a to lead " + _tail(tmp_path, "a"))
            procs["b"] = serve(cluster, tmp_path, "b", ports["b"])
            for who in ("a", "b"):  # both serve the API
                cluster.wait(lambda w=who: _healthy(ports[w]), timeout=120, what=lambda w=who: f"{w} to serve " + _tail(tmp_path, w))
            r = httpx.post(f"http://127.0.0.1:{ports['b']}/v1/datasets", headers={"Authorization": f"Bearer {ADMIN}"},
                           json={"name": "imagenet", "uri": "s3://d/i", "size": "1GB"})
            assert r.status_code == 201, r.text
            cluster.call(lambda em: em.create(em.resources[("batch", "jobs")], "admin", kubectl_job("one", ns="admin")))
            cluster.wait(lambda: not cluster.obj("jobs", "admin", "one", group="batch")["spec"]["suspend"], timeout=30,
                         what="the leader to admit")
            assert holder() == "a"
            procs["a"].send_signal(signal.SIGKILL)
            procs["a"].wait(10)
            cluster.wait(lambda: lease_is("b"), timeout=60, what=lambda: "b to take the Lease over " + _tail(tmp_path, "b"))
            two = kubectl_job("two", ns="admin")
            cluster.call(lambda em: em.create(em.resources[("batch", "jobs")], "admin", two))
            pod = cluster.wait(lambda: cluster.pods_of("admin", "one"), what="job one's pod")[0]
            cluster.finish_pod("admin", pod["metadata"]["name"])  # frees the GPUs for job two
            cluster.wait(lambda: not cluster.obj("jobs", "admin", "two", group="batch")["spec"]["suspend"], timeout=30,
                         what="the new leader to admit")
            lease = leases.read_namespaced_lease("silod-scheduler", "silod-system")
            assert lease.spec.lease_transitions == 1
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
                    p.wait(20)


def _tail(tmp_path, who: str) -> str:
    path = tmp_path / f"{who}.log"
    return f"(log: {path.read_text()[-1500:] if path.exists() else 'none'})"


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_unreachable_api_server_is_one_clear_error(tmp_path):
    port = free_port()
    r = subprocess.run(
        [*silod_cmd(), "serve", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--backend", "kubernetes", "--gpus", "4",
         "--gpus-per-node", "4", "--cache", "1GB", "--remote-io", "1GB/s", "--state-dir", str(tmp_path / "s"),
         "--backend-opt", f"server=http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "SILOD_ADMIN_TOKEN": ADMIN})
    assert r.returncode == 2
    assert f"cannot read the cluster from the Kubernetes API at http://127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr
