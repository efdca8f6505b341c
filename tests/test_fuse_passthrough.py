"""The raw /dev/fuse front end and FUSE passthrough, on real mounts (issue 12, part 5).

Passthrough needs root (the backing-file ioctl needs CAP_SYS_ADMIN) and Linux >= 6.9 with
CONFIG_FUSE_PASSTHROUGH. Without them these tests skip, except under CI=true, where they fail:
CI runs as root on the same kernel as development, so a refusal there is a regression.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dataplane_helpers import force_unmount, item_files, make_dataset, mounted, read_epoch, start_mount, wait_until

pytestmark = pytest.mark.fuse


def _require(condition: bool, why: str) -> None:
    if condition:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def require_raw() -> None:
    _require(os.geteuid() == 0, "the raw FUSE front end mounts with mount(2): run as root")


def require_passthrough() -> None:
    require_raw()
    from fuse_client.rawfuse.device import kernel_release

    _require(kernel_release() >= (6, 9), f"FUSE passthrough needs Linux >= 6.9 (this is {os.uname().release})")


def _stats_after(m, predicate, timeout: float = 5.0) -> dict:
    return wait_until(lambda: (lambda s: s if predicate(s) else None)(m.fresh_stats()), timeout, message="stats")


def _reads(stats: dict) -> int:
    return stats["fuse_requests"].get("READ", 0)


def test_auto_backend_is_raw_with_passthrough_on_this_kernel(tmp_path):
    require_passthrough()
    ds = make_dataset(tmp_path / "remote", n_files=4, seed=1)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache") as m:
        s = m.fresh_stats()
        assert s["fuse_backend"] == "raw", m.log()
        assert s["passthrough"] is True, f"the kernel refused passthrough: {m.log()}"


def test_passthrough_reads_of_cached_items_never_reach_the_daemon(tmp_path):
    require_passthrough()
    ds = make_dataset(tmp_path / "remote", n_files=24, min_size=5_000, max_size=400_000, seed=2)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw") as m:
        assert m.fresh_stats()["passthrough"] is True, m.log()
        read_epoch(m.mountpoint, ds, seed=1)  # epoch 1: misses, fetched whole at open, then passthrough
        s1 = _stats_after(m, lambda s: s["misses"] == 24)
        assert s1["passthrough_opens"] == 24 and s1["items_cached"] == 24
        assert s1["miss_bytes"] == ds.total  # accounted at open

        read_epoch(m.mountpoint, ds, seed=2)  # epoch 2: hits, opened in passthrough mode
        rel = max(ds.sizes, key=ds.sizes.get)
        want = (ds.root / rel).read_bytes()
        with open(m.mountpoint / rel, "rb", buffering=0) as f:  # partial reads and mmap, passthrough too
            assert os.pread(f.fileno(), 1000, 12345) == want[12345:13345]
            assert os.pread(f.fileno(), 10, len(want) - 4) == want[-4:]
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert hashlib.sha256(mm).hexdigest() == ds.digests[rel]
        s2 = _stats_after(m, lambda s: s["hits"] == 25)
        assert s2["passthrough_opens"] == 49
        # Not one byte of the 49 passthrough opens came through this process:
        assert _reads(s2) == 0 and s2["read_requests"] == 0
        # ...so they are accounted at open, as whole items.
        assert s2["hit_bytes"] == ds.total + ds.sizes[rel]
        # Misses' backing ids closed at release; the 24 cached items' ids are kept for re-opens.
        assert s2["open_handles"] == 0
        assert s2["fuse_backing_files"] == s2["fuse_backing_files_kept_idle"] == 24


def _deleted_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").endswith(" (deleted)")
        except OSError:
            pass
    return n


def test_kept_backing_files_serve_reopens_and_never_count_an_evicted_item_as_a_hit(tmp_path):
    """Re-opens of cached items use the backing file kept since the last open (no open(2), no
    ioctl); an item evicted by another process meanwhile is a miss again, and its kept
    descriptor is closed by the sweep so its disk space is freed."""
    require_passthrough()
    from fuse_client.cache_store import DatasetCache

    ds = make_dataset(tmp_path / "remote", n_files=40, min_size=20_000, max_size=60_000, seed=5)
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache, "--fuse-backend", "raw") as m:
        read_epoch(m.mountpoint, ds, seed=1)  # misses: not kept
        read_epoch(m.mountpoint, ds, seed=2)  # hits: opened from the cache, then kept
        s2 = _stats_after(m, lambda s: s["hits"] == 40)
        assert s2["fuse_kept_opens"] == 0 and s2["fuse_backing_files_kept_idle"] == 40
        read_epoch(m.mountpoint, ds, seed=3)  # re-opens: every one from a kept backing file
        s3 = _stats_after(m, lambda s: s["hits"] == 80)
        assert s3["fuse_kept_opens"] == 40 and _reads(s3) == 0
        assert s3["hit_bytes"] == 2 * ds.total

        # Another mount of the dataset shrinks the shared cache: random evictions by unlink.
        other = DatasetCache(cache, "ds")
        other.set_allocation(ds.total // 2)
        cached = {p.name for p in item_files(cache, "ds")}
        assert 0 < len(cached) < 40
        # The sweep closes the kept descriptors of the evicted items (their space is freed)...
        wait_until(lambda: _deleted_fds(m.proc.pid) == 0 or None, 6.0, message="kept descriptors of evicted items closed")
        s4 = m.fresh_stats()
        assert s4["fuse_backing_files_kept_idle"] == len(cached)
        read_epoch(m.mountpoint, ds, seed=4)  # ...and an evicted item is never a hit again
        s5 = _stats_after(m, lambda s: s["hits"] + s["misses"] == 160)
        assert s5["hits"] - s3["hits"] == len(cached)
        assert s5["fuse_kept_opens"] - s3["fuse_kept_opens"] == len(cached)
        assert s5["misses"] - s3["misses"] == 40 - len(cached)


def test_an_item_evicted_between_sweeps_is_reopened_as_a_miss(tmp_path):
    """The fstat at every kept re-open, not the sweep, decides hit or miss: evict and re-open at
    once (no sweep ran in between)."""
    require_passthrough()
    from fuse_client.cache_store import DatasetCache

    ds = make_dataset(tmp_path / "remote", n_files=30, min_size=20_000, max_size=60_000, seed=6)
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache, "--fuse-backend", "raw",
                 env={"SILOD_RAW_KEEP_BACKING": "8"}) as m:
        read_epoch(m.mountpoint, ds, seed=1)
        read_epoch(m.mountpoint, ds, seed=2)
        s2 = _stats_after(m, lambda s: s["hits"] == 30)
        assert s2["fuse_backing_files_kept_idle"] == 8  # SILOD_RAW_KEEP_BACKING bounds them, least recent dropped
        DatasetCache(cache, "ds").set_allocation(0)  # every item evicted
        read_epoch(m.mountpoint, ds, seed=3)
        s3 = _stats_after(m, lambda s: s["hits"] + s["misses"] == 90)
        assert s3["hits"] == 30 and s3["misses"] == 60  # no hit in epoch 3


def test_without_passthrough_the_same_reads_reach_the_daemon(tmp_path):
    require_raw()
    ds = make_dataset(tmp_path / "remote", n_files=24, min_size=5_000, max_size=400_000, seed=2)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw",
                 "--no-passthrough", "--no-kernel-cache") as m:
        assert m.fresh_stats()["passthrough"] is False
        read_epoch(m.mountpoint, ds, seed=1)
        s1 = _stats_after(m, lambda s: s["misses"] == 24)
        read_epoch(m.mountpoint, ds, seed=2)  # byte-identical (read_epoch checks every digest)
        s2 = _stats_after(m, lambda s: s["hits"] == 24)
        assert s2["passthrough_opens"] == 0
        assert _reads(s2) - _reads(s1) >= 24  # every cached item was read through the daemon
        assert s2["hit_bytes"] == ds.total  # counted per read, not at open


def test_raw_metadata_listing_and_errors(tmp_path):
    require_raw()
    ds = make_dataset(tmp_path / "remote", n_files=12, seed=3, subdirs=3)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw") as m:
        mnt = m.mountpoint
        assert sorted(os.listdir(mnt)) == ["class0", "class1", "class2"]
        for d in ("class0", "class1", "class2"):
            want = sorted(r.split("/")[1] for r in ds.sizes if r.startswith(d + "/"))
            assert sorted(os.listdir(mnt / d)) == want
            assert sorted(os.listdir(mnt / d)) == want  # again: served from the kernel's cache
            with os.scandir(mnt / d) as it:
                entries = list(it)
            assert all(e.is_file() and not e.is_dir() for e in entries)
            assert {e.name: e.stat().st_size for e in entries} == {r.split("/")[1]: n for r, n in ds.sizes.items() if r.startswith(d + "/")}
        st = os.stat(mnt / "class1")
        assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o555
        rel = sorted(ds.sizes)[0]
        st = os.stat(mnt / rel)
        assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o444 and st.st_size == ds.sizes[rel]
        for _ in range(2):  # the second time from the kernel's negative entry
            with pytest.raises(FileNotFoundError):
                os.stat(mnt / "class1" / "nope.bin")
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / "no-such-dir" / "x")
        with pytest.raises(NotADirectoryError):
            os.listdir(mnt / rel)
        with pytest.raises(OSError) as e:
            open(mnt / rel, "r+b")
        assert e.value.errno in (errno.EROFS, errno.EACCES)
        with pytest.raises(OSError) as e:
            (mnt / "class0" / "new.bin").write_bytes(b"x")
        assert e.value.errno in (errno.EROFS, errno.EACCES)
        with pytest.raises(IsADirectoryError):
            (mnt / "class0").read_bytes()
        sv = os.statvfs(mnt)
        assert sv.f_files == 12 and sv.f_blocks * sv.f_frsize >= ds.total
        # Reads at offsets, of a miss (daemon) and then of a hit (passthrough or page cache).
        want = (ds.root / rel).read_bytes()
        for _ in range(2):
            with open(mnt / rel, "rb", buffering=0) as f:
                for off in (0, 1, 4095, 4096, len(want) - 1, len(want), len(want) + 10):
                    assert os.pread(f.fileno(), 7000, off) == want[off:off + 7000]
        s = m.fresh_stats()
        assert s["fuse_requests"].get("IOCTL", 0) == 0  # buffering=0: no isatty probe
        with open(mnt / rel, "rb") as f:  # buffered: Python asks isatty(); answered ENOTTY
            assert f.read() == want
        assert m.fresh_stats()["fuse_requests"].get("IOCTL", 0) >= 1


def test_raw_concurrent_readers_mixing_misses_and_passthrough_hits_on_one_item(tmp_path):
    require_raw()
    ds = make_dataset(tmp_path / "remote", n_files=30, min_size=20_000, max_size=200_000, seed=4)
    errors: list = []

    def reader(seed: int) -> None:
        order = sorted(ds.sizes)
        random.Random(seed).shuffle(order)
        try:
            for rel in order[:20]:
                data = (m.mountpoint / rel).read_bytes()
                if hashlib.sha256(data).hexdigest() != ds.digests[rel]:
                    errors.append(f"content of {rel} differs")
        except OSError as exc:
            errors.append(repr(exc))

    # --io-rate slows fetches so that opens of one item overlap: some wait for the fetch (a
    # daemon-served open) while others already find it cached (passthrough) - the kernel must
    # accept both modes on one inode.
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw",
                 "--io-rate", "20MB/s") as m:
        threads = [threading.Thread(target=reader, args=(i % 4,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:5]
        s = m.fresh_stats()
        assert s["hits"] + s["misses"] == 16 * 20
        assert s["failed_opens"] == 0


def test_unmount_while_files_are_open_keeps_them_readable_then_exits(tmp_path):
    require_raw()
    ds = make_dataset(tmp_path / "remote", n_files=4, min_size=300_000, max_size=300_000, seed=5)
    a, b = sorted(ds.sizes)[:2]
    m = start_mount(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw")
    try:
        (m.mountpoint / a).read_bytes()  # cached: the next open of a is a hit
        fa = open(m.mountpoint / a, "rb", buffering=0)
        fb = open(m.mountpoint / b, "rb", buffering=0)  # a miss: served by the daemon
        m.proc.send_signal(signal.SIGTERM)  # unmounts (lazily: files are open)
        wait_until(lambda: not os.path.ismount(m.mountpoint), 10, message="lazy unmount")
        assert fa.read() == (ds.root / a).read_bytes()
        assert fb.read() == (ds.root / b).read_bytes()  # the daemon still serves the open file
        assert m.proc.poll() is None  # ...until the last file is closed
        fa.close()
        fb.close()
        assert m.proc.wait(15) == 0
    finally:
        m.stop()


def test_kill9_of_the_raw_server_leaves_no_hung_mount(tmp_path):
    require_raw()
    ds = make_dataset(tmp_path / "remote", n_files=6, seed=6)
    rels = sorted(ds.sizes)
    m = start_mount(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw")
    try:
        (m.mountpoint / rels[0]).read_bytes()
        f = open(m.mountpoint / rels[0], "rb", buffering=0)
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
        result: dict = {}

        def probe() -> None:
            try:
                os.stat(m.mountpoint / rels[1])
                result["ok"] = True
            except OSError as exc:
                result["errno"] = exc.errno

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "an access to the dead mount hangs"
        assert result.get("errno") in (errno.ENOTCONN, errno.ECONNABORTED) or result.get("ok"), result
        f.close()
        force_unmount(m.mountpoint)
        assert not os.path.ismount(m.mountpoint)
        out = subprocess.run(["grep", "-c", str(m.mountpoint), "/proc/self/mounts"], capture_output=True, text=True)
        assert out.stdout.strip() == "0"
    finally:
        m.stop()
    # The cache survived the crash: a new mount serves every item correctly.
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw") as m2:
        read_epoch(m2.mountpoint, ds, seed=3)


def test_fuse_backend_flag_is_validated(tmp_path):
    from dataplane_helpers import silod_cmd

    (tmp_path / "mnt").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x").write_bytes(b"x")
    r = subprocess.run([*silod_cmd(), "mount", str(tmp_path / "mnt"), "--source", str(tmp_path / "src"), "--dataset", "d",
                        "--job", "j", "--cache-dir", str(tmp_path / "c"), "--fuse-backend", "kernel"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--fuse-backend 'kernel'" in r.stderr + r.stdout and "auto" in r.stderr + r.stdout


def test_an_interrupted_miss_open_returns_eintr_at_once_and_the_mount_keeps_serving(tmp_path):
    require_raw()
    import sys

    ds = make_dataset(tmp_path / "remote", n_files=3, seed=7)
    rels = sorted(ds.sizes)
    # --io-rate 1B/s: a miss waits for tokens (hours for these items), until the opener is interrupted.
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw",
                 "--io-rate", "1B/s") as m:
        code = (
            "import os, signal, sys\n"
            "class Stop(Exception): pass\n"
            "def h(*a): raise Stop()\n"
            "signal.signal(signal.SIGUSR1, h)\n"
            "print('opening', flush=True)\n"
            "try:\n"
            f"    os.open({str(m.mountpoint / rels[0])!r}, os.O_RDONLY)\n"
            "except Stop:\n"
            "    print('interrupted', flush=True); sys.exit(0)\n"
            "sys.exit(3)\n"
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "opening"
        time.sleep(0.5)
        t0 = time.monotonic()
        child.send_signal(signal.SIGUSR1)
        assert child.wait(5) == 0 and child.stdout.read().strip() == "interrupted"
        assert time.monotonic() - t0 < 2.0
        s = _stats_after(m, lambda s: s["fuse_interrupted_opens"] >= 1)
        assert s["fuse_interrupted_opens"] == 1
        assert os.listdir(m.mountpoint / rels[1].split("/")[0])  # still serving


def test_kept_backing_files_of_items_this_mount_evicts_are_closed_at_eviction(tmp_path):
    """Issue 19.5: when this mount shrinks the cache (an allocation pulled from the data
    manager), the descriptors it keeps of the evicted items are closed as each item is unlinked,
    not by the next sweep: sampled all along, the process never holds more than one deleted
    item (the one being evicted), so disk use stays within the allocation plus one item."""
    require_passthrough()
    from dataplane_helpers import start_datamanager
    from datamanager.client import DataManagerClient

    ds = make_dataset(tmp_path / "remote", n_files=60, min_size=200_000, max_size=400_000, seed=9)
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as sched, \
             mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--fuse-backend", "raw",
                     "--manager", dm.url) as m:
            sched.allocate_cache_size("ds", ds.total * 2)
            wait_until(lambda: m.stats()["cache_allocation_bytes"] == ds.total * 2, 3.0, message="allocation pulled")
            read_epoch(m.mountpoint, ds, seed=1)
            read_epoch(m.mountpoint, ds, seed=2)
            _stats_after(m, lambda s: s["fuse_backing_files_kept_idle"] == 60)
            samples: list[int] = []
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    samples.append(_deleted_fds(m.proc.pid))
                    time.sleep(0.005)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                sched.allocate_cache_size("ds", ds.total // 3)
                s = wait_until(lambda: (st := m.stats())["cached_bytes"] <= ds.total // 3 and st, 5.0,
                               message="eviction after the shrink")
                time.sleep(0.5)  # keep sampling a while after the eviction (the sweep runs every 2 s)
            finally:
                stop.set()
                sampler.join(5)
            assert len(samples) > 50
            assert max(samples) <= 1, f"up to {max(samples)} evicted items held open after this mount's eviction"
            assert _deleted_fds(m.proc.pid) == 0
            s = m.fresh_stats()
            assert s["fuse_kept_closed_at_eviction"] == 60 - s["items_cached"]
            read_epoch(m.mountpoint, ds, seed=3)  # still every byte right
    finally:
        dm.kill()
