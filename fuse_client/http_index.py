"""Directory indexes of HTTP(S) sources in nginx's JSON format: names and sizes in one request.

An HTML index page (what fsspec's HTTP file system parses) has links but no sizes, so listing a
dataset through it costs a HEAD request per item: hours for ImageNet-sized datasets. nginx
serves a directory as JSON with `autoindex on; autoindex_format json;`:

    [{"name": "n01440764", "type": "directory", "mtime": "..."},
     {"name": "x.JPEG", "type": "file", "mtime": "...", "size": 110592}, ...]

which lists a directory, sizes included, in one GET. The index comes from a server, so it is
checked strictly: a malformed index fails the mount with a message naming the directory and
the entry, never a partial listing.
"""

from __future__ import annotations

import json
from typing import NamedTuple
from urllib.parse import quote

from estimator.errors import UserError

TYPES = ("file", "directory", "other")  # nginx: "other" is anything but a file or a directory


class IndexEntry(NamedTuple):
    name: str  # as the server's file system has it (not URL-encoded)
    is_dir: bool
    size: int  # 0 for directories

    @property
    def url_name(self) -> str:
        """The name as it appears in a URL (and in an HTML index's links)."""
        return quote(self.name, safe="")


def looks_like_json_index(body: bytes) -> bool:
    """JSON (an index is an array; an object is a malformed one): an HTML page never starts
    with '[' or '{'."""
    return body.lstrip()[:1] in (b"[", b"{")


#: The largest size stat can report (st_size is a signed 64-bit integer).
MAX_FILE_SIZE = 2**63 - 1


def parse_json_index(body: bytes, url: str, source: str) -> list[IndexEntry]:
    """The entries of the JSON index `body` of directory `url`; "other" entries (sockets, FIFOs)
    are left out. Raises UserError naming `source`, `url` and what is wrong."""

    def bad(problem: str) -> UserError:
        return UserError(f"--source {source!r}: the JSON directory index of {url!r} {problem}; serve it as nginx's "
                         "`autoindex_format json` does (an array of {\"name\", \"type\", \"size\"} objects)")

    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"is not valid JSON ({exc})") from None
    if not isinstance(data, list):
        raise bad("is not an array")
    entries: list[IndexEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise bad(f"has entry {i} that is not an object")
        name, kind = item.get("name"), item.get("type")
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            raise bad(f"has entry {i} with an unusable name {name!r} (one path component, not '.' or '..')")
        if kind not in TYPES:
            raise bad(f"has entry {name!r} of unknown type {kind!r} (expected one of {', '.join(TYPES)})")
        if name in seen:
            raise bad(f"lists {name!r} twice")
        seen.add(name)
        if kind == "other":
            continue
        size = 0
        if kind == "file":
            size = item.get("size")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise bad(f"gives file {name!r} the size {size!r} (a byte count >= 0 is required)")
            if size > MAX_FILE_SIZE:
                # stat's st_size is a signed 64-bit count: 2^63 broke `ls` of the mount (issue 47).
                raise bad(f"gives file {name!r} the size {size} (more than {MAX_FILE_SIZE}, the most a file's"
                          " size can be)")
        entries.append(IndexEntry(name, kind == "directory", size))
    return entries
