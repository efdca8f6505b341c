"""LRU mode under real FUSE mounts (`silod mount --cache-mode lru`) reading from a real
S3-compatible server (moto in server mode on 127.0.0.1): evictions keep the cached bytes within
the allocation at every sample, recency decides what stays, the mode survives kill -9 and a
restart with the same crash checks as the uniform mode, and the scheduler -> data manager ->
mount chain sets the mode from the jobs' access pattern."""

from __future__ import annotations

import hashlib
import json
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from estimator.access import AccessPattern
from fuse_client.cache_store import item_key

from dataplane_helpers import free_port, item_files, make_dataset, mounted, read_epoch, start_datamanager, start_mount, wait_until

pytestmark = pytest.mark.fuse

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_dataset(tmp_path, s3_endpoint):
    import boto3

    ds = make_dataset(tmp_path / "local-copy", n_files=160, seed=11)  # ~3.2 MB, 160 items
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    bucket = f"lru-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    s3.create_bucket(Bucket=bucket)
    for rel in ds.sizes:
        s3.put_object(Bucket=bucket, Key=f"train/{rel}", Body=(ds.root / rel).read_bytes())
    return ds, f"s3://{bucket}/train", {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}


class Sampler:
    """Samples, every few milliseconds while the test reads: the bytes of item files on disk,
    the index's sum, and the mount's stats file."""

    def __init__(self, cache: Path, dataset: str, stats_file: Path) -> None:
        self.cache, self.dataset, self.stats_file = cache, dataset, stats_file
        self.samples: list[tuple[int, int, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        db_path = self.cache / self.dataset / "index.sqlite"
        while not self._stop.is_set():
            on_disk = 0
            for p in item_files(self.cache, self.dataset):
                try:
                    on_disk += p.stat().st_size
                except FileNotFoundError:  # evicted between listing and stat
                    pass
            with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5) as db:
                indexed = db.execute("SELECT COALESCE(SUM(size), 0) FROM items").fetchone()[0]
            try:
                stats = json.loads(self.stats_file.read_text())["cached_bytes"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                stats = None
            self.samples.append((on_disk, indexed, stats))
            time.sleep(0.005)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def _read(mnt: Path, ds, rels) -> None:
    for rel in rels:
        data = (mnt / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == ds.digests[rel], f"content of {rel} differs"


def _cached_keys(cache: Path, dataset: str) -> set[str]:
    return {p.name for p in item_files(cache, dataset)}


def test_curriculum_reads_under_lru_never_exceed_the_allocation(tmp_path, s3_dataset):
    ds, url, env = s3_dataset
    d = ds.total
    allocation = int(0.3 * d)
    cache = tmp_path / "cache"
    items = sorted(ds.sizes)  # "difficulty" order: the curriculum's first g(i) items
    pacing = AccessPattern.curriculum_learning(0.125, 2.0, 4, 8).curriculum  # 20, 40, 80, 160 items
    import random

    rng = random.Random(5)
    with mounted(tmp_path / "mnt", url, "s3ds", "job1", cache, "--cache-size", str(allocation), "--cache-mode", "lru", env=env) as m:
        assert m.fresh_stats()["cache_mode"] == "lru"
        with Sampler(cache, "s3ds", m.stats_file) as sampler:
            for i in range(16):  # 16 iterations of 8 items, sampled uniformly from the first g(i)
                window = items[: pacing.eligible_items(i, len(items))]
                _read(m.mountpoint, ds, [rng.choice(window) for _ in range(pacing.batch)])
            read_epoch(m.mountpoint, ds, seed=3)  # then the whole set: the cache turns over
            time.sleep(0.6)  # a last stats rewrite
        s = m.fresh_stats()
    assert len(sampler.samples) > 50
    worst = max(max(on_disk, indexed, stats or 0) for on_disk, indexed, stats in sampler.samples)
    assert worst <= allocation, f"{worst} cached bytes > allocation {allocation}"
    assert s["cached_bytes"] <= allocation and s["cached_bytes"] > allocation - 2 * 32_000
    # The cache turned over: more bytes came in than the allocation holds, so LRU evicted.
    assert s["miss_bytes"] > allocation and s["remote_bytes"] == s["miss_bytes"]
    assert s["hit_bytes"] > 0


def test_lru_keeps_the_recently_read_items_where_uniform_keeps_the_first(tmp_path, s3_dataset):
    ds, url, env = s3_dataset
    items = sorted(ds.sizes)
    first, second = items[:40], items[40:80]
    allocation = sum(ds.sizes[r] for r in second) + 40_000  # `second` fits, with room for the batch slack
    results = {}
    for mode in ("uniform", "lru"):
        cache = tmp_path / f"cache-{mode}"
        with mounted(tmp_path / f"mnt-{mode}", url, "s3ds", "job1", cache, "--cache-size", str(allocation), "--cache-mode", mode, env=env) as m:
            _read(m.mountpoint, ds, first)
            time.sleep(0.05)  # mtime stamps of `second` are strictly later
            _read(m.mountpoint, ds, second)
            before = m.fresh_stats()
            _read(m.mountpoint, ds, second)  # read `second` again: hits only if it stayed
            after = m.fresh_stats()
        results[mode] = (after["hit_bytes"] - before["hit_bytes"], _cached_keys(cache, "s3ds"))
    second_bytes = sum(ds.sizes[r] for r in second)
    lru_hits, lru_keys = results["lru"]
    assert lru_hits == second_bytes  # every re-read was a hit
    assert {item_key(r) for r in second} <= lru_keys
    uniform_hits, uniform_keys = results["uniform"]
    assert uniform_hits < 0.5 * second_bytes  # uniform filled up with `first` and never evicts
    assert len({item_key(r) for r in first} & uniform_keys) > len({item_key(r) for r in first} & lru_keys)


def test_lru_mode_survives_kill9_and_restart_and_drops_corrupt_items(tmp_path, s3_dataset):
    ds, url, env = s3_dataset
    d = ds.total
    allocation = int(0.5 * d)
    cache = tmp_path / "cache"
    m = start_mount(tmp_path / "mnt", url, "s3ds", "job1", cache, "--cache-size", str(allocation), "--cache-mode", "lru", env=env)
    try:
        read_epoch(m.mountpoint, ds, seed=1)
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
    finally:
        m.stop()
    kept = sorted(item_files(cache, "s3ds"))
    assert kept and sum(p.stat().st_size for p in kept) <= allocation
    victim = kept[3]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x55  # bit rot / torn write
    victim.write_bytes(bytes(data))
    (cache / "s3ds" / "staging" / "half-written.tmp").write_bytes(b"partial")
    # Restart without --cache-mode and without --cache-size: the node's mode and allocation stay.
    with mounted(tmp_path / "mnt", url, "s3ds", "job1", cache, env=env) as m2:
        s = m2.fresh_stats()
        assert s["cache_mode"] == "lru" and s["cache_allocation_bytes"] == allocation
        assert s["items_cached"] == len(kept) - 1  # the corrupt item was dropped, never served
        with Sampler(cache, "s3ds", m2.stats_file) as sampler:
            read_epoch(m2.mountpoint, ds, seed=2)  # verifies every byte against the source
            read_epoch(m2.mountpoint, ds, seed=3)
        assert max(max(a, b, c or 0) for a, b, c in sampler.samples) <= allocation
        assert m2.fresh_stats()["cached_bytes"] <= allocation
    assert not (cache / "s3ds" / "staging" / "half-written.tmp").exists()


def test_bad_cache_mode_exits_2(tmp_path, s3_dataset):
    import subprocess

    from dataplane_helpers import silod_cmd

    ds, url, env = s3_dataset
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([*silod_cmd(), "mount", str(tmp_path / "mnt"), "--source", url, "--dataset", "d", "--job", "j",
                        "--cache-dir", str(tmp_path / "c"), "--cache-mode", "mru"], capture_output=True, text=True, timeout=60, env={**__import__("os").environ, **env})
    assert r.returncode == 2 and "--cache-mode 'mru' is not a cache mode; use one of: uniform, lru" in r.stderr
    assert "Traceback" not in r.stderr


def test_scheduler_sets_the_mode_through_the_data_manager(tmp_path, s3_dataset):
    """A curriculum job alone on its dataset: the service pushes `lru` for it (and `uniform` for a
    dataset a regular job reads), the data manager stores it, and the mount switches."""
    from datamanager.client import DataManagerClient
    from scheduler.service.scheduler_process import NewDataset, NewJob, Principal
    from scheduler.service.cli import build_service

    ds, url, env = s3_dataset
    dm = start_datamanager(tmp_path / "dm-state")
    service = build_service(db=f"sqlite:///{tmp_path / 's.db'}", backend="null", policy="fifo", round_s=360, gpus="4",
                            cache="10MB", remote_io="100MB/s", datamanager=dm.url, state_dir=tmp_path / "state")
    try:
        # The datasets and jobs of one tenant; the data manager and the cache name a dataset by
        # its storage key (tenants' equal names never share a cache).
        user = Principal("u")
        lru_key = service.register_dataset(user, NewDataset("s3ds", url, float(ds.total)))[0].key
        plain_key = service.register_dataset(user, NewDataset("plain", "s3://b/plain", 1e6))[0].key
        cl = AccessPattern.curriculum_learning(0.25, 2.0, 10, 8)
        service.submit_job(user, NewJob("cl", 1, "s3ds", epochs=2.0, ideal_throughput=1e6, access=cl))
        service.submit_job(user, NewJob("r", 1, "plain", epochs=2.0, ideal_throughput=1e6))
        result = service.run_round("test")
        assert result.plan.allocation.partition.lru_datasets == {lru_key}
        with DataManagerClient(dm.url) as client:
            status = client.status()
        assert status["datasets"][lru_key]["cache_mode"] == "lru"
        assert status["datasets"][plain_key]["cache_mode"] == "uniform"
        lru_bytes = status["datasets"][lru_key]["allocated_bytes"]
        assert 0 < lru_bytes <= result.plan.allocation.partition.irregular_cache
        with mounted(tmp_path / "mnt", url, lru_key, "job1", tmp_path / "cache", "--manager", dm.url, env=env) as m:
            s = wait_until(lambda: (st := m.stats())["cache_mode"] == "lru" and st, 3.0, message="mode pulled")
            assert s["cache_allocation_bytes"] == lru_bytes
            with Sampler(tmp_path / "cache", lru_key, m.stats_file) as sampler:
                read_epoch(m.mountpoint, ds, seed=4)
            assert max(max(a, b, c or 0) for a, b, c in sampler.samples) <= lru_bytes
    finally:
        service.close()
        dm.kill()
