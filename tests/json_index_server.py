"""An HTTP file server whose directory indexes are nginx's JSON autoindex
(`autoindex on; autoindex_format json;`), for the tests and benchmarks/bench_dataplane.py.

nginx itself is not used because it is not on a fresh machine of this kind; the format is
nginx's: an array of {"name", "type": "directory"|"file"|"other", "mtime", "size" (files)}.
Every request is counted by method, so tests can prove how many a listing took."""

from __future__ import annotations

import collections
import email.utils
import http.server
import io
import json
import os
import threading


class JsonIndexHandler(http.server.SimpleHTTPRequestHandler):
    requests: collections.Counter  # set per server by serve_json_index
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def send_head(self):
        with self.lock:
            self.requests[self.command] += 1
        return super().send_head()

    def list_directory(self, path):
        entries = []
        with os.scandir(path) as it:
            for e in sorted(it, key=lambda e: e.name):
                st = e.stat()
                mtime = email.utils.formatdate(st.st_mtime, usegmt=True)
                if e.is_dir():
                    entries.append({"name": e.name, "type": "directory", "mtime": mtime})
                elif e.is_file():
                    entries.append({"name": e.name, "type": "file", "mtime": mtime, "size": st.st_size})
                else:
                    entries.append({"name": e.name, "type": "other", "mtime": mtime})
        body = json.dumps(entries).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)


def json_index_handler(base: type[http.server.SimpleHTTPRequestHandler] = http.server.SimpleHTTPRequestHandler):
    """A handler class that is `base` with JSON directory indexes and its own request counter."""
    return type("JsonIndex" + base.__name__, (JsonIndexHandler, base), {"requests": collections.Counter()})
