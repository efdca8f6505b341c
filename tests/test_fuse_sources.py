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


# -- HTTP sources with JSON directory indexes (nginx `autoindex_format json`) --------------------


def _serve(handler_cls, root) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler_cls, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def test_json_index_lists_like_the_html_index_with_one_request_per_directory(tmp_path):
    from fuse_client.remote import RemoteStore
    from json_index_server import json_index_handler

    ds = make_dataset(tmp_path / "www", n_files=30, seed=5, subdirs=3)
    (ds.root / "class1" / "deeper").mkdir()
    (ds.root / "class1" / "deeper" / "x y#1.bin").write_bytes(b"z" * 777)  # a name URLs must encode
    os.mkfifo(ds.root / "class2" / "a-fifo")  # nginx lists it as type "other": not an item
    html_handler = type("Counting", (http.server.SimpleHTTPRequestHandler,), {})
    html_handler.log_message = lambda *a, **k: None
    json_handler = json_index_handler()
    html_server, html_url = _serve(html_handler, ds.root)
    json_server, json_url = _serve(json_handler, ds.root)
    try:
        from_json = RemoteStore(json_url).list()
        (ds.root / "class2" / "a-fifo").unlink()  # the HTML path would HEAD it, and the server hang opening it
        from_html = RemoteStore(html_url).list()
    finally:
        html_server.shutdown()
        json_server.shutdown()
    want = {**ds.sizes, "class1/deeper/x%20y%231.bin": 777}
    assert {rel: e.size for rel, e in from_json.files.items()} == want
    assert {rel: e.size for rel, e in from_html.files.items()} == want
    # root, class0..2, class1/deeper: five directories, five GETs, and no HEAD per item.
    assert json_handler.requests == {"GET": 5}


@pytest.mark.parametrize("body, problem", [
    (b'{"name": "a"}', "is not an array"),
    (b'[1]', "not an object"),
    (b'[{"name": "..", "type": "directory"}]', "unusable name"),
    (b'[{"name": "a/b", "type": "file", "size": 1}]', "unusable name"),
    (b'[{"name": "a", "type": "file", "size": -1}]', "size -1"),
    (b'[{"name": "a", "type": "file", "size": true}]', "size True"),
    (b'[{"name": "a", "type": "file"}]', "size None"),
    (b'[{"name": "a", "type": "link", "size": 1}]', "unknown type"),
    (b'[{"name": "a", "type": "file", "size": 1}, {"name": "a", "type": "file", "size": 1}]', "twice"),
    (b'[{"name": "a", "type": "file", "size": 1}', "not valid JSON"),
])
def test_a_malformed_json_index_is_a_clear_error_and_no_partial_listing(tmp_path, body, problem):
    from estimator.errors import UserError
    from fuse_client.remote import RemoteStore

    class Crafted(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Crafted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/data/"
    try:
        with pytest.raises(UserError) as e:
            RemoteStore(url).list()
    finally:
        server.shutdown()
    assert problem in str(e.value) and url in str(e.value)


def test_mount_over_a_json_index_server_reads_every_item(tmp_path):
    from json_index_server import json_index_handler

    ds = make_dataset(tmp_path / "www", n_files=40, seed=6)
    handler = json_index_handler()
    server, url = _serve(handler, ds.root)
    try:
        with mounted(tmp_path / "mnt", url, "jsonds", "job1", tmp_path / "cache") as m:
            read_epoch(m.mountpoint, ds, seed=1)
            read_epoch(m.mountpoint, ds, seed=2)
            s = m.fresh_stats()
            assert s["remote_bytes"] == ds.total and s["hit_bytes"] == ds.total
        assert handler.requests["HEAD"] == 0  # sizes came from the indexes
    finally:
        server.shutdown()
