"""The data plane under stress, on real mounts: concurrent misses of one item, hits while
misses stall, a dead S3 remote (deadline, circuit breaker, recovery), clean and crash remounts."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from dataplane_helpers import free_port, make_dataset, mounted, read_epoch, start_mount, wait_until

pytestmark = pytest.mark.fuse

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _read_in_thread(path: Path, out: dict, name: str) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        try:
            out[name] = path.read_bytes()
        except OSError as exc:
            out[name] = exc
        out[name + "_s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_concurrent_misses_of_one_item_in_one_mount_fetch_it_once(tmp_path):
    ds = make_dataset(tmp_path / "remote", n_files=1, min_size=500_000, max_size=500_000, seed=11)
    rel = next(iter(ds.sizes))
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--io-rate", "1MB/s") as m:
        out: dict = {}
        threads = [_read_in_thread(m.mountpoint / rel, out, f"r{i}") for i in range(8)]
        for t in threads:
            t.join(20)
        want = (ds.root / rel).read_bytes()
        assert all(out[f"r{i}"] == want for i in range(8))
        s = m.fresh_stats()
        assert s["remote_bytes"] == ds.total  # one fetch for eight concurrent opens
        assert s["misses"] + s["hits"] == 8 and s["items_cached"] == 1


@pytest.mark.parametrize("backend, fuse_threads", [
    ("libfuse", 128),
    # Fewer libfuse workers than stalled misses: before issue 19 the hit waited behind them (every
    # worker sat in a miss); now misses beyond the waiting cap fail with EAGAIN at once and the
    # reserved workers serve the hit.
    ("libfuse", 4),
    ("raw", 4),  # the raw front end answers hits on its reader thread, misses in its open pool
])
def test_hits_are_served_while_misses_stall(tmp_path, backend, fuse_threads):
    ds = make_dataset(tmp_path / "remote", n_files=40, seed=12)
    rels = sorted(ds.sizes)
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        for rel in rels[:5]:
            (m.mountpoint / rel).read_bytes()  # cached
    # --io-rate 1B/s: every miss waits for tokens (hours for these items) until unmount. (A rate
    # of 0 is refused since issue 19: it would block every miss forever.)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache, "--io-rate", "1B/s", "--fuse-backend", backend,
                 "--fuse-threads", str(fuse_threads), "--no-kernel-cache") as m:
        stalled: dict = {}
        for rel in rels[10:30]:
            _read_in_thread(m.mountpoint / rel, stalled, rel)
        time.sleep(1.0)
        waiting = [k for k in rels[10:30] if k not in stalled]
        assert waiting  # the misses really stall (those not refused at once by the waiting cap)
        refused = [stalled[k] for k in rels[10:30] if k in stalled]
        assert all(isinstance(e, OSError) and e.errno == errno.EAGAIN for e in refused), refused
        hit: dict = {}
        t = _read_in_thread(m.mountpoint / rels[0], hit, "hit")
        t.join(3.0)
        assert hit.get("hit") == (ds.root / rels[0]).read_bytes() and hit["hit_s"] < 1.0


def _moto(port: int):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def test_dead_s3_remote_fails_fast_opens_the_breaker_serves_cached_items_and_recovers(tmp_path):
    import boto3

    port = free_port()
    server = _moto(port)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        ds = make_dataset(tmp_path / "local-copy", n_files=40, seed=13)
        s3 = boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in S3_ENV.items() if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
        s3.create_bucket(Bucket="silod-dead")
        for rel in ds.sizes:
            s3.put_object(Bucket="silod-dead", Key=f"train/{rel}", Body=(ds.root / rel).read_bytes())
        rels = sorted(ds.sizes)
        env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        m = start_mount(tmp_path / "mnt", "s3://silod-dead/train", "s3ds", "job1", tmp_path / "cache",
                        "--open-deadline", "2", "--breaker-threshold", "3", "--probe-interval", "0.5",
                        "--log-level", "INFO", env=env)
        try:
            for rel in rels[:10]:
                assert (m.mountpoint / rel).read_bytes() == (ds.root / rel).read_bytes()
            server.stop()  # the remote dies
            durations = []
            for rel in rels[10:13]:
                t0 = time.monotonic()
                with pytest.raises(OSError) as info:
                    (m.mountpoint / rel).read_bytes()
                durations.append(time.monotonic() - t0)
                assert info.value.errno == errno.EIO
            assert max(durations) <= 2.0 + 1.0, durations  # within the deadline (+ scheduling slack)
            s = m.fresh_stats()
            assert s["remote_breaker_state"] == "open" and s["remote_breaker_opened_total"] == 1
            assert s["remote_errors"] >= 3 and s["failed_opens"] == 3
            assert "circuit breaker open" in m.log() and "s3://silod-dead/train" in m.log()
            # Breaker open: opens of uncached items fail at once; cached items are served.
            t0 = time.monotonic()
            with pytest.raises(OSError) as info:
                (m.mountpoint / rels[20]).read_bytes()
            assert info.value.errno == errno.EIO and time.monotonic() - t0 < 0.2
            for rel in rels[:10]:
                assert (m.mountpoint / rel).read_bytes() == (ds.root / rel).read_bytes()
            assert m.fresh_stats()["remote_breaker_rejected_opens"] >= 1
            # The remote comes back (moto keeps its objects in-process): within a probe interval
            # (+ the probe itself) the breaker closes and misses are fetched again.
            server = _moto(port)
            back = time.monotonic()
            wait_until(lambda: m.stats()["remote_breaker_state"] == "closed", 3.0, message="breaker closed")
            assert time.monotonic() - back <= 0.5 + 1.5
            for rel in rels[10:]:
                assert (m.mountpoint / rel).read_bytes() == (ds.root / rel).read_bytes()
            assert "answers again" in m.log()
        finally:
            m.stop()
    finally:
        server.stop()


def test_clean_remount_trusts_the_index_and_a_crash_remount_verifies_in_the_background(tmp_path):
    ds = make_dataset(tmp_path / "remote", n_files=300, min_size=2_000, max_size=6_000, seed=14)
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        read_epoch(m.mountpoint, ds, seed=1)
    # Clean unmount (SIGTERM) -> the next mount trusts the index: nothing is re-read.
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        s = m.fresh_stats()
        assert s["recovery_clean"] is True and s["cache_verify_pending"] is False
        assert s["items_cached"] == 300 and s["recovery_seconds"] < 0.5
        read_epoch(m.mountpoint, ds, seed=2)
        assert m.fresh_stats()["remote_bytes"] == 0
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
    # After kill -9 the next mount checks the items lazily and in the background.
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        s = wait_until(lambda: (st := m.stats()) and st["cache_verify_pending"] is False and st, 10.0,
                       message="background verification done")
        assert s["recovery_clean"] is False and s["cache_verified_items"] == 300
        read_epoch(m.mountpoint, ds, seed=3)
        assert m.fresh_stats()["remote_bytes"] == 0
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        assert m.fresh_stats()["recovery_clean"] is True


def test_bad_tuning_flags_exit_2(tmp_path):
    import subprocess

    from dataplane_helpers import silod_cmd

    ds = make_dataset(tmp_path / "remote", n_files=2)
    (tmp_path / "mnt").mkdir()
    for flag, value in (("--fuse-threads", "0"), ("--open-deadline", "-1"), ("--breaker-threshold", "0"), ("--fetch-workers", "0")):
        r = subprocess.run([*silod_cmd(), "mount", str(tmp_path / "mnt"), "--source", str(ds.root), "--dataset", "d",
                            "--job", "j", "--cache-dir", str(tmp_path / "cache"), flag, value],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, (flag, r.stderr)
    assert not (tmp_path / "cache").exists()


def test_remount_starts_from_the_listing_snapshot_and_notices_a_changed_source(tmp_path):
    ds = make_dataset(tmp_path / "remote", n_files=30, seed=15)
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        read_epoch(m.mountpoint, ds, seed=1)
        wait_until(lambda: (cache / "ds" / "listing.bin").exists(), 5.0, message="snapshot saved")
    (ds.root / "class0" / "new-item.bin").write_bytes(b"n" * 1000)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache, "--log-level", "INFO") as m:
        # Started from the snapshot: the new file is not there for this mount; the change is logged.
        assert not (m.mountpoint / "class0" / "new-item.bin").exists()
        assert m.fresh_stats()["items_total"] == 30
        wait_until(lambda: "changed since the last mount" in m.log(), 5.0, message="change noticed")
        read_epoch(m.mountpoint, ds, seed=2)
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        assert (m.mountpoint / "class0" / "new-item.bin").read_bytes() == b"n" * 1000
        assert m.fresh_stats()["items_total"] == 31


def test_a_snapshot_does_not_let_a_mount_skip_reaching_the_source(tmp_path):
    import shutil
    import subprocess

    from dataplane_helpers import silod_cmd

    ds = make_dataset(tmp_path / "remote", n_files=5, seed=16)
    cache = tmp_path / "cache"
    with mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", cache) as m:
        read_epoch(m.mountpoint, ds, seed=1)
        wait_until(lambda: (cache / "ds" / "listing.bin").exists(), 5.0, message="snapshot saved")
    shutil.rmtree(ds.root)  # the source is gone (or no longer readable with these credentials)
    r = subprocess.run([*silod_cmd(), "mount", str(tmp_path / "mnt"), "--source", str(ds.root), "--dataset", "ds",
                        "--job", "j", "--cache-dir", str(cache)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and str(ds.root) in r.stderr and "Traceback" not in r.stderr
