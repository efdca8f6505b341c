"""The allow-list holds for every byte the mount reads (issue 19, part 4).

Each attack is run for real: HTTP servers on 127.0.0.1 (one plays the allowed host, another the
internal service it points at), real `file://` trees with symlinks, real mounts. The internal
service counts its requests: a refused attack must not even reach it.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import http.server
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from dataplane_helpers import force_unmount, mounted

SIZE = 5000
GOOD = bytes(range(256)) * 19 + b"g" * (SIZE - 256 * 19)
SECRET = b"S" * SIZE  # same size as the listed item, so a length check cannot save the day


class _Server:
    """A ThreadingHTTPServer on 127.0.0.1 answering from `routes` (path -> (status, headers, body))."""

    def __init__(self, routes: dict[str, tuple[int, dict, bytes]]) -> None:
        self.routes = routes
        self.hits: collections.Counter = collections.Counter()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, body_too: bool) -> None:
                path = self.path.split("?", 1)[0]
                outer.hits[path] += 1
                status, headers, body = outer.routes.get(path, (404, {}, b"no"))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body_too:
                    self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer(True)

            def do_HEAD(self) -> None:
                self._answer(False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def total(self) -> int:
        return sum(self.hits.values())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _json_index(*names: str) -> tuple[int, dict, bytes]:
    body = json.dumps([{"name": n, "type": "file", "size": SIZE} for n in names]).encode()
    return 200, {"Content-Type": "application/json"}, body


@pytest.fixture
def internal():
    srv = _Server({"/secret": (200, {}, SECRET), "/latest/meta-data/": (200, {}, SECRET)})
    yield srv
    srv.close()


def _redirecting_source(internal: _Server) -> _Server:
    return _Server({
        "/ds/": _json_index("evil.bin", "moved.bin", "good.bin"),
        "/ds/good.bin": (200, {}, GOOD),
        # To the internal service: a different port of loopback (a pod-local port), absolute.
        "/ds/evil.bin": (302, {"Location": f"{internal.url}/secret"}, b""),
        # Inside the dataset's own prefix: a legitimate redirect, followed.
        "/ds/moved.bin": (302, {"Location": "/ds/objects/moved"}, b""),
        "/ds/objects/moved": (200, {}, GOOD),
    })


@pytest.mark.fuse
@pytest.mark.parametrize("operator_list", [True, False], ids=["SILOD_ALLOWED_URIS", "no-allow-list"])
def test_a_redirect_out_of_the_allow_list_is_never_followed(tmp_path, internal, operator_list):
    src = _redirecting_source(internal)
    env = {"SILOD_ALLOWED_URIS": f"{src.url}/"} if operator_list else {}
    try:
        with mounted(tmp_path / "mnt", f"{src.url}/ds/", "ds", "job1", tmp_path / "cache", "--fuse-backend", "libfuse",
                     "--open-deadline", "2", env=env) as m:
            assert (m.mountpoint / "good.bin").read_bytes() == GOOD
            assert (m.mountpoint / "moved.bin").read_bytes() == GOOD  # a redirect within the prefix is fine
            with pytest.raises(OSError) as e:
                (m.mountpoint / "evil.bin").read_bytes()
            assert e.value.errno == errno.EIO
            assert internal.total() == 0, internal.hits  # not one request reached the internal service
            assert "refused by the allow-list" in m.log()
            s = m.fresh_stats()
            assert s["cached_bytes"] == 2 * SIZE  # nothing of the refused item was cached
    finally:
        src.close()


def test_a_redirect_to_the_metadata_address_in_another_spelling_is_refused(internal):
    """Whatever the spelling of the target (127.1, decimal, hex, IPv4-mapped IPv6), the redirect
    is checked by the one address parser and refused before a connection is made."""
    from fuse_client.remote import FileEntry, RemoteStore, RemoteFetchError
    from fuse_client.token_bucket import Throttle

    targets = [f"http://127.1:{internal.port}/secret", f"http://2130706433:{internal.port}/secret",
               f"http://0x7f000001:{internal.port}/secret", f"http://[::ffff:127.0.0.1]:{internal.port}/secret",
               f"http://0:{internal.port}/secret"]
    routes = {f"/ds/t{i}": (302, {"Location": t}, b"") for i, t in enumerate(targets)}
    src = _Server(routes)
    try:
        store = RemoteStore(f"{src.url}/ds/")
        for i, target in enumerate(targets):
            got = bytearray()
            with pytest.raises(RemoteFetchError):
                store.fetch(FileEntry(i, f"t{i}", SIZE), lambda data, off: got.extend(data), Throttle(float("inf")),
                            lambda n: None, got.clear, sleep=lambda s: None)
            assert not got, target
        assert internal.total() == 0, internal.hits
    finally:
        src.close()


def test_an_html_index_link_with_encoded_dot_segments_is_not_part_of_the_dataset(tmp_path, internal):
    from fuse_client.remote import RemoteStore

    links = ["good.bin", "%2e%2e/secret", "%2E%2E/%2e%2e/secret", "sub/%2e%2e/%2e%2e/secret", ".%2e/secret"]
    page = "<html><body>" + "".join(f'<a href="{href}">{href}</a>' for href in links) + "</body></html>"
    src = _Server({"/ds/": (200, {"Content-Type": "text/html"}, page.encode()), "/ds/good.bin": (200, {}, GOOD),
                   "/secret": (200, {}, SECRET)})
    try:
        listing = RemoteStore(f"{src.url}/ds/").list()
        assert sorted(listing.files) == ["good.bin"]
        assert src.hits["/secret"] == 0
    finally:
        src.close()


def test_a_request_url_with_encoded_dot_segments_is_refused_at_fetch_time(internal):
    """Even with a listing that has one (an old snapshot, a crafted index), the fetch itself
    refuses a URL that leaves the prefix once decoded."""
    from fuse_client.remote import FileEntry, RemoteFetchError, RemoteStore
    from fuse_client.token_bucket import Throttle

    src = _Server({"/secret": (200, {}, SECRET)})
    try:
        store = RemoteStore(f"{src.url}/ds/")
        with pytest.raises(RemoteFetchError):
            store.fetch(FileEntry(0, "%2e%2e/secret", SIZE), lambda d, o: None, Throttle(float("inf")),
                        lambda n: None, lambda: None, sleep=lambda s: None)
        assert src.total() == 0
    finally:
        src.close()


def test_a_name_that_resolves_to_an_internal_address_is_refused_at_connect_time(monkeypatch, internal):
    """DNS rebinding: the URL passes the check (a public-looking https name), the name then
    resolves to loopback. The connection is refused on the address it would be made to."""
    from fuse_client.remote import RemoteStore

    real = socket.getaddrinfo

    def fake_getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host == "rebind.example.com":
            return real("127.0.0.1", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    from contract.uri_policy import UriPolicy
    from estimator.errors import UserError

    policy = UriPolicy()  # s3 and https: the name passes, it is not an address
    url = f"https://rebind.example.com:{internal.port}/latest/meta-data/"
    assert policy.check(url) == url
    connections = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    threading.Thread(target=lambda: connections.append(listener.accept()), daemon=True).start()
    try:
        with pytest.raises(UserError, match="refused"):
            RemoteStore(f"https://rebind.example.com:{port}/ds/", allow=policy).list()
        assert connections == []  # not even a TCP connection was made
    finally:
        listener.close()


# -- file:// sources ---------------------------------------------------------------------------


def _file_tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    prefix = tmp_path / "srv" / "datasets"
    ds = prefix / "ds"
    (ds / "sub").mkdir(parents=True)
    (ds / "good.bin").write_bytes(GOOD)
    (ds / "sub" / "inside.bin").write_bytes(GOOD)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "shadow").write_bytes(SECRET)
    os.symlink(outside / "shadow", ds / "leak.bin")  # absolute symlink out
    os.symlink(ds / "good.bin", ds / "abs-alias.bin")  # absolute, but stays beneath: allowed
    os.symlink("../../../outside/shadow", ds / "leak2.bin")  # relative symlink out
    os.symlink(outside, ds / "leakdir")  # a directory out
    os.symlink("sub/inside.bin", ds / "alias.bin")  # stays beneath: allowed
    return prefix, ds, outside


def test_file_source_symlinks_out_of_the_prefix_are_not_listed_nor_opened(tmp_path):
    from fuse_client.remote import FileEntry, RemoteFetchError, RemoteStore
    from fuse_client.token_bucket import Throttle
    from contract.uri_policy import UriPolicy

    prefix, ds, outside = _file_tree(tmp_path)
    store = RemoteStore(ds.as_uri(), allow=UriPolicy((prefix.as_uri() + "/",)))
    listing = store.list()
    assert sorted(listing.files) == ["abs-alias.bin", "alias.bin", "good.bin", "sub/inside.bin"]
    for rel in ("leak.bin", "leak2.bin", "leakdir/shadow"):
        got = bytearray()
        with pytest.raises(RemoteFetchError):
            store.fetch(FileEntry(0, rel, SIZE), lambda d, o: got.extend(d), Throttle(float("inf")),
                        lambda n: None, got.clear, sleep=lambda s: None)
        assert not got


@pytest.mark.fuse
def test_a_symlink_swapped_in_after_the_listing_is_refused_through_the_mount(tmp_path):
    prefix, ds, outside = _file_tree(tmp_path)
    env = {"SILOD_ALLOWED_URIS": prefix.as_uri() + "/"}
    with mounted(tmp_path / "mnt", ds.as_uri(), "ds", "job1", tmp_path / "cache", "--fuse-backend", "libfuse",
                 "--open-deadline", "1", env=env) as m:
        assert sorted(os.listdir(m.mountpoint)) == ["abs-alias.bin", "alias.bin", "good.bin", "sub"]
        assert (m.mountpoint / "alias.bin").read_bytes() == GOOD
        (ds / "sub" / "inside.bin").unlink()
        os.symlink(outside / "shadow", ds / "sub" / "inside.bin")  # listed as a file, now a link out
        with pytest.raises(OSError) as e:
            (m.mountpoint / "sub" / "inside.bin").read_bytes()
        assert e.value.errno == errno.EIO


def test_a_dataset_root_that_is_a_symlink_out_of_the_prefix_is_refused_before_mounting(tmp_path):
    import subprocess

    from dataplane_helpers import silod_cmd

    prefix, ds, outside = _file_tree(tmp_path)
    os.symlink(outside, prefix / "evil")
    (tmp_path / "mnt").mkdir()
    proc = subprocess.Popen([*silod_cmd(), "mount", str(tmp_path / "mnt"), "--source", (prefix / "evil").as_uri(),
                             "--dataset", "ds", "--job", "j", "--cache-dir", str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SILOD_ALLOWED_URIS": prefix.as_uri() + "/"})
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it mounted the symlinked root: the bug
        proc.terminate()
        out, err = proc.communicate(timeout=15)
    finally:
        force_unmount(tmp_path / "mnt")
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 2, r.stderr
    assert "outside the allowed prefix" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.ismount(tmp_path / "mnt")


# -- one address parser, at registration -------------------------------------------------------


@pytest.mark.parametrize("host, kind", [
    ("127.1", "loopback"), ("2130706433", "loopback"), ("0x7f000001", "loopback"), ("0177.0.0.1", "loopback"),
    ("0", "unspecified"), ("[::ffff:127.0.0.1]", "loopback"), ("[::ffff:7f00:1]", "loopback"), ("[::1]", "loopback"),
    ("10.0.0.1", "private"), ("172.16.3.4", "private"), ("192.168.1.1", "private"), ("[fd00::1]", "private"),
    ("100.64.0.1", "private"), ("169.254.169.254", "link-local"), ("[fe80::1]", "link-local"),
    ("[::ffff:169.254.169.254]", "link-local"), ("[64:ff9b::a9fe:a9fe]", "link-local"), ("224.0.0.1", "multicast"),
])
def test_every_spelling_of_an_internal_address_is_refused_at_registration(host, kind):
    from contract.uri_policy import UriPolicy, UriRejected

    with pytest.raises(UriRejected, match=kind):
        UriPolicy().check(f"https://{host}/data/")


def test_an_operator_prefix_that_names_a_private_host_allows_it_and_only_it():
    from contract.uri_policy import UriPolicy, UriRejected

    policy = UriPolicy(("s3", "https", "https://10.0.0.5:9000/datasets/"))
    assert policy.check("https://10.0.0.5:9000/datasets/imagenet/")
    assert policy.check("https://data.example.com/x/")
    for uri in ("https://10.0.0.5:9000/other/", "https://10.0.0.6:9000/datasets/", "https://10.0.0.5/datasets/x/"):
        with pytest.raises(UriRejected, match="private"):
            policy.check(uri)
