"""The allow-list holds for every byte fetched from S3 too (issue 19, part 4, S3 sources).

A real S3-compatible server (moto in server mode) on 127.0.0.1 holds the dataset. In front of it
a small misbehaving "endpoint" forwards S3 requests to moto, except that it answers some object
GETs with `307 TemporaryRedirect` whose `Location` is an internal service (another loopback
port, standing for cloud metadata or a pod-local port). The internal service counts every
request and connection: a refused attack must not even reach it. Before: aiobotocore's HTTP
session followed the 307, and the internal body (same size as the object) was cached and served
as the object's content.
"""

from __future__ import annotations

import collections
import errno
import http.client
import http.server
import os
import socket
import subprocess
import threading

import pytest

from dataplane_helpers import free_port, mounted, silod_cmd

SIZE = 5000
GOOD = bytes(range(256)) * 19 + b"g" * (SIZE - 256 * 19)
SECRET = b"S" * SIZE  # same size as the listed object, so a length check cannot save the day
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
REDIRECT_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>TemporaryRedirect</Code>'
                 b"<Message>Please re-send this request to the specified temporary endpoint.</Message></Error>")


class _Counting:
    """An HTTP server on 127.0.0.1 that counts connections and answers every GET with SECRET."""

    def __init__(self) -> None:
        self.hits: collections.Counter = collections.Counter()
        self.connections = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def do_GET(self) -> None:
                outer.hits[self.path] += 1
                self.send_response(200)
                self.send_header("Content-Length", str(SIZE))
                self.end_headers()
                self.wfile.write(SECRET)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _MisbehavingEndpoint:
    """Forwards S3 requests to moto; GETs of keys in `redirects` get a 307 to that URL instead
    (`regional`: keys answered once with S3's own 307 and the bucket's region, as S3 does while
    a new bucket's DNS propagates, with a Location on this same endpoint)."""

    def __init__(self, moto_port: int, redirects: dict[str, str], regional: set[str] = frozenset()) -> None:
        self.redirects = redirects
        self.regional = set(regional)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _redirect(self, location: str, region: bool) -> None:
                self.send_response(307)
                self.send_header("Location", location)
                if region:
                    self.send_header("x-amz-bucket-region", "us-east-1")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(REDIRECT_BODY)))
                self.end_headers()
                self.wfile.write(REDIRECT_BODY)

            def _forward(self) -> None:
                key = self.path.split("?", 1)[0]
                if self.command == "GET":
                    for suffix, target in outer.redirects.items():
                        if key.endswith(suffix):
                            return self._redirect(target, False)
                    for suffix in list(outer.regional):
                        if key.endswith(suffix):
                            outer.regional.discard(suffix)
                            return self._redirect(f"http://127.0.0.1:{outer.port}{self.path}", True)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection("127.0.0.1", moto_port, timeout=10)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def moto_port():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield port
    server.stop()


@pytest.fixture
def bucket(moto_port, tmp_path):
    import boto3

    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto_port}", aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    name = f"silod-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    s3.create_bucket(Bucket=name)
    for key in ("good.bin", "evil.bin", "moved.bin"):
        s3.put_object(Bucket=name, Key=f"ds/{key}", Body=GOOD)
    return name


@pytest.fixture
def internal():
    srv = _Counting()
    yield srv
    srv.close()


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["raw", "libfuse"])
@pytest.mark.parametrize("operator_list", [True, False], ids=["SILOD_ALLOWED_URIS", "no-allow-list"])
def test_an_s3_endpoint_answering_307_to_an_internal_address_is_never_followed(
        tmp_path, moto_port, bucket, internal, operator_list, backend):
    if backend == "raw" and os.geteuid() != 0:
        pytest.skip("the raw front end mounts with mount(2): run as root")
    endpoint = _MisbehavingEndpoint(moto_port, {"/evil.bin": f"{internal.url}/latest/meta-data/"}, {"/moved.bin"})
    env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint.url}
    if operator_list:
        env["SILOD_ALLOWED_URIS"] = f"s3,{endpoint.url}/"
    try:
        with mounted(tmp_path / "mnt", f"s3://{bucket}/ds", "ds", "job1", tmp_path / "cache", "--fuse-backend", backend,
                     "--open-deadline", "2", env=env) as m:
            assert (m.mountpoint / "good.bin").read_bytes() == GOOD
            # S3's own 307 (the bucket's region, same endpoint) still works: botocore re-sends it.
            assert (m.mountpoint / "moved.bin").read_bytes() == GOOD
            with pytest.raises(OSError) as e:
                (m.mountpoint / "evil.bin").read_bytes()
            assert e.value.errno == errno.EIO
            assert internal.connections == 0, internal.hits  # not even a connection to the internal service
            s = m.fresh_stats()
            assert s["cached_bytes"] == 2 * SIZE  # nothing of the refused object was cached
    finally:
        endpoint.close()


def test_an_s3_redirect_is_refused_in_every_spelling_of_the_internal_address(moto_port, bucket, internal):
    """Through the store directly: whatever the Location says (absolute, 127.1, decimal, mapped
    IPv6, the endpoint itself on another path), the S3 client never follows it."""
    from contract.credentials import SourceCredential
    from fuse_client.remote import FileEntry, RemoteFetchError, RemoteStore
    from fuse_client.token_bucket import Throttle

    endpoint = _MisbehavingEndpoint(moto_port, {"/evil.bin": ""})
    cred = SourceCredential("testing", "testing", endpoint.url, "us-east-1")
    try:
        store = RemoteStore(f"s3://{bucket}/ds", credential=cred)
        assert sorted(store.list().files) == ["evil.bin", "good.bin", "moved.bin"]
        for target in (f"{internal.url}/secret", f"http://127.1:{internal.port}/secret",
                       f"http://2130706433:{internal.port}/secret", f"http://[::ffff:127.0.0.1]:{internal.port}/s",
                       f"{endpoint.url}/{bucket}/ds/good.bin"):
            endpoint.redirects["/evil.bin"] = target
            got = bytearray()
            with pytest.raises(RemoteFetchError):
                store.fetch(FileEntry(0, "evil.bin", SIZE), lambda data, off: got.extend(data), Throttle(float("inf")),
                            lambda n: None, got.clear, sleep=lambda s: None)
            assert not got, target
        assert internal.connections == 0, internal.hits
    finally:
        endpoint.close()


def test_an_s3_endpoint_name_that_resolves_to_an_internal_address_is_refused_at_connect_time(monkeypatch, caplog):
    """DNS rebinding: the endpoint passes the allow-list (an https name), then resolves to
    loopback. The connection is refused on the address it would be made to."""
    from contract.credentials import SourceCredential
    from contract.uri_policy import UriPolicy
    from estimator.errors import UserError
    from fuse_client.remote import RemoteStore

    real = socket.getaddrinfo

    def fake_getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host in ("rebind.example.com", "bucket.rebind.example.com"):
            return real("127.0.0.1", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    connections = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    threading.Thread(target=lambda: connections.append(listener.accept()), daemon=True).start()
    policy = UriPolicy()  # s3 and https: the endpoint's name passes, it is not an address
    endpoint = f"https://rebind.example.com:{port}"
    assert policy.check(endpoint + "/")
    try:
        with pytest.raises(UserError, match="unreachable"):
            RemoteStore("s3://bucket/ds", credential=SourceCredential("k", "s", endpoint, "us-east-1"), allow=policy).list()
        # botocore words the error as its own; the refusal is the guard's, logged with the address.
        assert any("connection to 127.0.0.1 port" in r.getMessage() and "refused" in r.getMessage()
                   for r in caplog.records), caplog.text
        assert connections == []  # not even a TCP connection was made
    finally:
        listener.close()


@pytest.mark.fuse
def test_an_s3_endpoint_outside_the_operators_allow_list_is_refused_before_mounting(tmp_path, internal):
    """The endpoint is checked at credential registration; one from the mount's environment
    (AWS_ENDPOINT_URL) must pass the same allow-list, or the mount does not start."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": internal.url, "SILOD_ALLOWED_URIS": "s3,https"}
    r = subprocess.run([*silod_cmd(), "mount", str(mnt), "--source", "s3://bucket/ds", "--dataset", "ds", "--job", "j",
                        "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    assert internal.url in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert internal.connections == 0


def test_s3_requests_go_to_the_endpoint_or_to_aws_only():
    from contract.uri_policy import UriPolicy, UriRejected
    from fuse_client.safe_http import DestinationRefused, HttpGuard

    aws = HttpGuard.for_s3(None, UriPolicy())
    aws.check_s3_url("https://bucket.s3.eu-west-1.amazonaws.com/key")  # a region redirect's target
    for url in ("http://bucket.s3.amazonaws.com/key", "https://169.254.169.254/latest/meta-data/",
                "https://127.1/key", "https://localhost/key"):
        with pytest.raises(DestinationRefused):
            aws.check_s3_url(url)
    minio = HttpGuard.for_s3("https://minio.example.com:9000", UriPolicy())
    minio.check_s3_url("https://minio.example.com:9000/bucket/key")
    minio.check_s3_url("https://bucket.minio.example.com:9000/key")  # virtual-hosted style
    for url in ("https://minio.example.com/bucket/key", "http://minio.example.com:9000/bucket/key",
                "https://evil.example.com:9000/key", "https://minio.example.com.evil.example:9000/key"):
        with pytest.raises(DestinationRefused):
            minio.check_s3_url(url)
    # An endpoint the operator's list refuses is refused before any request.
    with pytest.raises(UriRejected):
        HttpGuard.for_s3("http://10.0.0.5:9000", UriPolicy())
    HttpGuard.for_s3("http://10.0.0.5:9000", UriPolicy(("s3", "http://10.0.0.5:9000/")))
