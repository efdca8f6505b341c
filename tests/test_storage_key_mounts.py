"""One storage key per (tenant, dataset) end to end (issue 20, finding 2): two tenants each
register a dataset named `files`; the scheduler allocates cache to each by its storage key; the
node agent publishes both into pods on one node; each mount registers with the data manager under
its own key, enforces its own tenant's allocation, caches into its own directory and reads its own
tenant's data.

Everything is real: `silod serve` (null backend) and `silod datamanager` on 127.0.0.1, the
`silod agent` process over its CSI unix socket (as kubelet calls it), real FUSE and bind mounts
(root and /dev/fuse needed; under CI=true their absence fails the test).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from dataplane_helpers import free_port, item_files, make_dataset, read_epoch, silod_cmd, start_datamanager, wait_until

try:
    from test_kubernetes_csi_agent import AgentProc, _fuse  # noqa: F401 - the autouse root/FUSE check
except ImportError:
    from tests.test_kubernetes_csi_agent import AgentProc, _fuse  # noqa: F401

pytestmark = [pytest.mark.fuse]

ADMIN, ALICE, BOB, AGENT = "admin-token-0123456789", "alice-token-0123456789", "bob-token-0123456789", "agent-n1-token-0123456789"


def _serve(root: Path, dm_url: str) -> tuple[subprocess.Popen, str]:
    (root / "tokens.txt").write_text(f"alice:{ALICE}\nbob:{BOB}\nagent-n1:{AGENT}\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update(SILOD_ADMIN_TOKEN=ADMIN, XDG_STATE_HOME=str(root / "xdg"))
    proc = subprocess.Popen(
        [*silod_cmd(), "serve", "--backend", "null", "--listen", f"127.0.0.1:{port}", "--state-dir", str(root / "state"),
         "--gpus", "8", "--gpus-per-node", "8", "--cache", "1TB", "--remote-io", "1GB/s", "--tokens", str(root / "tokens.txt"),
         "--policy", "fifo", "--round", "1h", "--datamanager", dm_url, "--allow-uri", f"file://{root}/remote/",
         "--node-agent", "agent-n1=n1"],
        env=env, stdout=(root / "serve.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (root / "serve.log").read_text()[-3000:]
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "silod serve did not come up"
        time.sleep(0.2)


def _call(method: str, url: str, token: str, body: dict | None = None) -> dict:
    r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code in (200, 201), r.text
    return r.json()


def test_two_tenants_datasets_of_one_name_get_separate_keys_caches_and_allocations(tmp_path):
    data = {"alice": make_dataset(tmp_path / "remote" / "alice-files", n_files=30, seed=1),
            "bob": make_dataset(tmp_path / "remote" / "bob-files", n_files=50, seed=2)}
    assert data["alice"].total != data["bob"].total  # allocations that could be told apart
    dm = start_datamanager(tmp_path / "dm")
    serve, base = _serve(tmp_path, dm.url)
    agent = None
    try:
        keys = {}
        for tenant, token in (("alice", ALICE), ("bob", BOB)):
            ds = data[tenant]
            rec = _call("POST", f"{base}/v1/datasets", token,
                        {"name": "files", "uri": f"file://{ds.root}", "size": ds.total})
            keys[tenant] = rec["key"]
            _call("POST", f"{base}/v1/jobs", token,
                  {"name": f"{tenant}-train", "gpus": 1, "dataset": "files", "epochs": 5, "ideal_throughput": 1e9})
        assert keys["alice"] != keys["bob"]
        _call("POST", f"{base}/v1/rounds", ADMIN)
        # The scheduler's cache allocation of each key, as pushed to the data manager.
        def pushed() -> dict | None:
            st = httpx.get(f"{dm.url}/v1/status", timeout=10).json()["datasets"]
            got = {t: st.get(k, {}).get("allocated_bytes") for t, k in keys.items()}
            return got if all(got.values()) else None

        allocated = wait_until(pushed, 30, 0.2, "cache allocations pushed")
        assert allocated["alice"] != allocated["bob"]

        env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
        env.update(SILOD_AGENT_TOKEN=AGENT, SILOD_ALLOWED_URIS=f"file://{tmp_path}/remote/")
        agent = AgentProc(tmp_path, None, "n1", env=env, resolver_args=[
            "--scheduler", base, "--manager", dm.url, "--report-interval", "0"])
        agent.start()
        targets = {}
        for tenant in ("alice", "bob"):
            targets[tenant] = agent.target(f"pod-{tenant}")
            agent.publish(f"vol-{tenant}", targets[tenant], namespace=tenant, dataset="files")
        for tenant in ("alice", "bob"):
            read_epoch(targets[tenant], data[tenant], seed=3)  # each pod reads its own tenant's bytes

        # Each mount enforces its own key's allocation and reports under its key.
        for tenant in ("alice", "bob"):
            stats = wait_until(lambda t=tenant: (s := agent.stats(t, "files"))["cache_allocation_bytes"] == allocated[t]
                               and s["read_bytes"] >= data[t].total and s, 20, 0.2, f"{tenant}'s mount allocation")
            assert stats["dataset"] == keys[tenant]
            assert stats["job"] == f"node-n1_{keys[tenant]}"
            # Its own cache directory, holding its own tenant's items only.
            cached = item_files(agent.state / "cache" / tenant, keys[tenant])
            assert cached and sum(p.stat().st_size for p in cached) == stats["cached_bytes"] > 0
            assert not (agent.state / "cache" / tenant / "files").exists()

        status = httpx.get(f"{dm.url}/v1/status").json()
        node = status["nodes"]["n1"]["datasets"]
        assert set(node) == set(keys.values()), node  # two entries, none named `files`
        assert "files" not in status["datasets"]
        for tenant, key in keys.items():
            assert node[key]["allocated_bytes"] == allocated[tenant]
            assert 0 < node[key]["cached_bytes"] <= allocated[tenant]
            assert list(node[key]["jobs"]) == [f"node-n1_{key}"]
        metrics = httpx.get(f"{dm.url}/metrics").text
        for key in keys.values():
            assert f'silod_dataset_cached_bytes{{dataset="{key}",node="n1"}}' in metrics \
                or f'silod_dataset_cached_bytes{{node="n1",dataset="{key}"}}' in metrics, metrics[:2000]
        for tenant in ("alice", "bob"):  # the pods end: their mounts go (and unregister)
            agent.unpublish(f"vol-{tenant}", targets[tenant])
        wait_until(lambda: not httpx.get(f"{dm.url}/v1/status", timeout=10).json()["clients"], 20, 0.2, "clients gone")
    finally:
        if agent is not None:
            agent.cleanup()
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)
        dm.kill()
