"""`silod mount` over real remote stores on 127.0.0.1: S3 (moto server mode) and HTTP."""

from __future__ import annotations

import functools
import os
import http.server
import subprocess
import threading

import pytest

from dataplane_helpers import free_port, make_dataset, mounted, read_epoch, silod_cmd

pytestmark = pytest.mark.fuse

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A real S3-compatible HTTP server (moto in server mode) on a free local port."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_dataset(tmp_path, s3_endpoint):
    import boto3

    ds = make_dataset(tmp_path / "local-copy", n_files=60, seed=3)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    bucket = f"silod-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    s3.create_bucket(Bucket=bucket)
    for rel in ds.sizes:
        s3.put_object(Bucket=bucket, Key=f"datasets/train/{rel}", Body=(ds.root / rel).read_bytes())
    return ds, f"s3://{bucket}/datasets/train"


def test_s3_source_reads_caches_and_verifies(tmp_path, s3_endpoint, s3_dataset):
    ds, url = s3_dataset
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    alloc = int(0.5 * ds.total)
    with mounted(tmp_path / "mnt", url, "s3ds", "job1", tmp_path / "cache", "--cache-size", str(alloc), env=env) as m:
        read_epoch(m.mountpoint, ds, seed=1)
        s1 = m.fresh_stats()
        assert s1["remote_bytes"] == ds.total
        read_epoch(m.mountpoint, ds, seed=2)
        s2 = m.fresh_stats()
        assert abs((s2["remote_bytes"] - s1["remote_bytes"]) - (ds.total - alloc)) <= 0.02 * ds.total
        assert s2["hit_bytes"] == s1["cached_bytes"]


def test_s3_source_that_does_not_exist_is_a_clear_error(tmp_path, s3_endpoint):
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    (tmp_path / "mnt").mkdir()
    r = subprocess.run(
        [*silod_cmd(), "mount", str(tmp_path / "mnt"), "--source", "s3://no-such-bucket-silod/x", "--dataset", "d",
         "--job", "j", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )
    assert r.returncode == 2 and "s3://no-such-bucket-silod/x" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture
def http_dataset(tmp_path):
    ds = make_dataset(tmp_path / "www", n_files=40, seed=4)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(ds.root))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield ds, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_http_source_lists_directories_and_reads(tmp_path, http_dataset):
    ds, url = http_dataset
    with mounted(tmp_path / "mnt", url, "webds", "job1", tmp_path / "cache") as m:
        read_epoch(m.mountpoint, ds, seed=1)
        read_epoch(m.mountpoint, ds, seed=2)
        s = m.fresh_stats()
        assert s["remote_bytes"] == ds.total and s["hit_bytes"] == ds.total
        assert s["items_cached"] == len(ds.sizes)
