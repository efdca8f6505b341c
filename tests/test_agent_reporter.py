"""The node agent's consumption bookkeeping: per-pod attribution from cgroups, and counters that
only rise across mount-process and agent restarts (fuse_client/pod_attribution.py,
fuse_client/agent/reporter.py). The end-to-end path (real FUSE reads in a pod's cgroup, reports
over HTTP) is in tests/test_kubernetes_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fuse_client.accounting import MAX_PODS, JobAccounting
from fuse_client.agent.reporter import ConsumptionReporter
from fuse_client.pod_attribution import PodAttribution, pod_uid_of_cgroup_text

UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


@pytest.mark.parametrize("text", [
    f"12:pids:/kubepods/burstable/pod{UID}/0123abcd\n0::/\n",  # cgroupfs driver, v1
    f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/cri-containerd-ab.scope\n",
    f"0::/../../kubepods/pod{UID}/c1\n",  # seen from inside another cgroup namespace
])
def test_pod_uid_from_kubelet_cgroup_layouts(text):
    assert pod_uid_of_cgroup_text(text) == UID


@pytest.mark.parametrize("text", ["0::/\n", f"0::/user.slice/pod{UID}\n", "0::/kubepods/podnot-a-uid/x\n"])
def test_no_pod_outside_kubepods(text):
    assert pod_uid_of_cgroup_text(text) is None


def test_attribution_reads_the_callers_proc_entry(tmp_path):
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(f"0::/kubepods/pod{UID}/c\n")
    (proc / "43").mkdir()
    (proc / "43" / "cgroup").write_text("0::/system.slice/sshd.service\n")
    a = PodAttribution(proc)
    assert (a.pod_of(42), a.pod_of(43), a.pod_of(44), a.pod_of(0)) == (UID, "", "", "")


def test_this_process_is_in_no_pod():
    assert PodAttribution().pod_of(os.getpid()) == "" or "kubepods" in Path("/proc/self/cgroup").read_text()


def test_per_pod_counters_are_bounded():
    acc = JobAccounting(num_items=4)
    for i in range(MAX_PODS + 10):
        acc.pod_opened(f"pod-{i}", hit=True)
        acc.bytes_read(10, hit=True, pod=f"pod-{i}")
    snap = acc.pod_snapshot()
    assert len(snap) == MAX_PODS and snap["pod-0"] == {"read_bytes": 10, "hit_bytes": 10, "miss_bytes": 0,
                                                       "hits": 1, "misses": 0, "miss_service_count": 0,
                                                       "miss_service_us": 0, "miss_service_bytes": 0}
    assert acc.hit_bytes == 10 * (MAX_PODS + 10)  # the mount's own totals still count everything


def write_stats(path: Path, instance: str, pods: dict[str, int]) -> None:
    path.write_text(json.dumps({"instance": instance, "pods": {
        uid: {"read_bytes": n, "hit_bytes": n, "miss_bytes": 0, "hits": 1, "misses": 0} for uid, n in pods.items()}}))


def test_counters_carry_over_a_mount_restart_and_an_agent_restart(tmp_path):
    a, b = tmp_path / "a.stats.json", tmp_path / "b.stats.json"
    state = tmp_path / "consumption.json"

    def reporter() -> ConsumptionReporter:
        return ConsumptionReporter(node="n1", mounts=lambda: [p for p in (a, b) if p.exists()], state_file=state)
    write_stats(a, "m1", {"p1": 100, "p2": 5})
    r = reporter()
    assert {u: c["read_bytes"] for u, c in r.collect().items()} == {"p1": 100, "p2": 5}
    write_stats(a, "m1", {"p1": 150, "p2": 5})
    write_stats(b, "x1", {"p1": 7})  # the pod reads a second dataset too
    assert r.collect()["p1"]["read_bytes"] == 157
    write_stats(a, "m2", {"p1": 20})  # the mount process restarted: its counters began again at 0
    assert r.collect()["p1"]["read_bytes"] == 177
    r2 = reporter()  # the agent restarted: what it carried is on disk
    assert r2.collect()["p1"]["read_bytes"] == 177
    write_stats(a, "m2", {"p1": 30})
    assert r2.collect()["p1"]["read_bytes"] == 187 and r2.collect()["p2"]["read_bytes"] == 5


@pytest.mark.parametrize("extra,env,message", [
    (["--datasets", "{catalog}", "--report-interval", "-1"], {}, "--report-interval -1.0 must be between 0 and 3600"),
    (["--scheduler", "http://127.0.0.1:9", "--report-token-file", "{tmp}/missing"], {"SILOD_AGENT_TOKEN": "t" * 16},
     "--report-token-file"),
])
def test_agent_report_flags_are_checked(tmp_path, extra, env, message):
    from dataplane_helpers import silod_cmd

    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("datasets: []\n")
    args = [a.format(catalog=catalog, tmp=tmp_path) for a in extra]
    r = subprocess.run([*silod_cmd(), "agent", "--node", "n1", "--state-dir", str(tmp_path / "state"),
                        "--socket", str(tmp_path / "csi.sock"), "--kubelet-dir", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_pods_gone_for_a_day_are_forgotten(tmp_path):
    from fuse_client.agent.reporter import FORGET_AFTER_S

    a = tmp_path / "a.stats.json"
    now = [1000.0]
    r = ConsumptionReporter(node="n1", mounts=lambda: [a], state_file=tmp_path / "c.json", clock=lambda: now[0])
    write_stats(a, "m1", {"old": 10, "live": 5})
    assert set(r.collect()) == {"old", "live"}
    write_stats(a, "m2", {"live": 7})  # a new mount process; "old" no longer listed
    now[0] += FORGET_AFTER_S / 2
    assert r.collect()["old"]["read_bytes"] == 10  # still reported (carried)
    now[0] += FORGET_AFTER_S
    write_stats(a, "m2", {"live": 9})
    got = r.collect()
    assert set(got) == {"live"} and got["live"]["read_bytes"] == 14


def test_a_pods_miss_service_is_counted_for_it_and_carried_like_the_other_counters(tmp_path):
    """The mount counts each miss delivered whole for the pod that opened it (its service time in
    whole microseconds, its bytes); the reporter carries them over a mount restart, and over an
    agent state file written before these counters existed."""
    acc = JobAccounting(num_items=4)
    acc.pod_opened("p1", hit=False)
    acc.miss_served(0.0042, 9000, "p1")
    acc.miss_served(0.001, 100)  # outside any pod: the mount's own figures only
    assert acc.pod_snapshot()["p1"]["miss_service_count"] == 1
    assert (acc.pod_snapshot()["p1"]["miss_service_us"], acc.pod_snapshot()["p1"]["miss_service_bytes"]) == (4200, 9000)
    assert acc.miss_service.export()["count"] == 2

    a, state = tmp_path / "a.stats.json", tmp_path / "consumption.json"
    # An agent from before: its state file has the old five counters only.
    state.write_text(json.dumps({f"{a}|p1": {"instance": "m0", "counters": {"read_bytes": 5, "hit_bytes": 5, "miss_bytes": 0,
                                                                            "hits": 1, "misses": 0},
                                              "carried": {"read_bytes": 0, "hit_bytes": 0, "miss_bytes": 0, "hits": 0,
                                                          "misses": 0}, "seen_at": 0.0}}))
    r = ConsumptionReporter(node="n1", mounts=lambda: [a], state_file=state)

    def write(instance: str, count: int, us: int) -> None:
        a.write_text(json.dumps({"instance": instance, "pods": {"p1": {
            "read_bytes": 9000 * count, "hit_bytes": 0, "miss_bytes": 9000 * count, "hits": 0, "misses": count,
            "miss_service_count": count, "miss_service_us": us, "miss_service_bytes": 9000 * count}}}))
    write("m1", 2, 5000)  # a new mount process: the old one's 5 bytes are carried
    got = r.collect()["p1"]
    assert (got["read_bytes"], got["miss_service_count"], got["miss_service_us"]) == (18005, 2, 5000)
    write("m2", 1, 3000)  # restarted again: 2 misses carried, 1 new
    got = r.collect()["p1"]
    assert (got["miss_service_count"], got["miss_service_us"], got["miss_service_bytes"]) == (3, 8000, 27000)
