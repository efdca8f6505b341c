"""The node agent never holds its node-wide lock while a dataset's mount lists its source
(issue 45, item 5): a slow index stalled every other tenant's volume set-up (30.8 s instead of
2.3 s).

The mount processes here are a stand-in for `silod mount` (a script that takes 3 s for the slow
source, as a slow index listing does, then mounts a real tmpfs at the mount point and unmounts it
on SIGTERM): the agent only starts the process and waits for a mount point, and what is tested is
the agent's locking, not FUSE. The bind mounts into the "pods" are real (root)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

FAKE_MOUNT = """
import signal, subprocess, sys, time
args = sys.argv[1:]
path, source = args[1], args[args.index("--source") + 1]
if "slow" in source:
    time.sleep(3.0)  # listing a slow source
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", path], check=True)

def stop(*_):
    subprocess.run(["umount", "-l", path])
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(1)
"""


def test_a_slow_source_does_not_stall_another_tenants_volume(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("bind mounts need root")
    from fuse_client.agent.datasets import DatasetSource
    from fuse_client.agent.volumes import VolumeManager

    fake = tmp_path / "fake_silod.py"
    fake.write_text(FAKE_MOUNT)
    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    vm = VolumeManager(tmp_path / "state", "node1", silod=[sys.executable, str(fake)], kubelet_dir=kubelet,
                       idle_unmount_s=0)
    done: dict[str, float] = {}
    errors: list[BaseException] = []
    t0 = time.monotonic()

    def publish(tenant: str, name: str, uri: str) -> None:
        try:
            vm.publish(f"vol-{tenant}", str(kubelet / f"pod-{tenant}" / "data"), DatasetSource(tenant, name, uri),
                       "ns", f"pod-{tenant}")
            done[tenant] = time.monotonic() - t0
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        slow = threading.Thread(target=publish, args=("alice", "big", "http://slow.example/ds/"))
        slow.start()
        time.sleep(0.3)  # alice's mount is listing its source now
        fast = threading.Thread(target=publish, args=("bob", "small", "http://fast.example/ds/"))
        fast.start()
        fast.join(10)
        slow.join(10)
        assert not errors, errors
        assert done["bob"] < 2.0, f"bob's volume waited for alice's slow source: {done}"
        assert done["alice"] >= 3.0, done
        assert os.path.ismount(kubelet / "pod-bob" / "data") and os.path.ismount(kubelet / "pod-alice" / "data")
    finally:
        for tenant in ("alice", "bob"):
            try:
                vm.unpublish(f"vol-{tenant}", str(kubelet / f"pod-{tenant}" / "data"))
            except Exception:
                pass
        vm.close(unmount_all=True)
