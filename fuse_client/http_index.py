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

import itertools
import json
import re
from collections.abc import Iterator
from typing import NamedTuple
from urllib.parse import quote, urlparse

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
    i = _WS_BYTES.match(body).end()
    return body[i:i + 1] in (b"[", b"{")


#: The largest size stat can report (st_size is a signed 64-bit integer).
MAX_FILE_SIZE = 2**63 - 1


# fsspec's HTTP file system's link patterns (fsspec/implementations/http.py, simple_links on), so
# an HTML index lists the same names as before it was read here with a size cap.
_LINK = re.compile(r"""<(a|A)\s+(?:[^>]*?\s+)?(href|HREF)=["'](?P<url>[^"']+)""")
_SIMPLE_LINK = re.compile(r"""(?P<url>http[s]?://[-a-zA-Z0-9@:%_+.~#?&/=]+)""")
_WS = re.compile(r"[ \t\n\r]*")
_WS_BYTES = re.compile(rb"[ \t\n\r]*")


def html_links(body: bytes, content_type: str | None, url: str) -> Iterator[str]:
    """The absolute URLs an HTML index page of directory `url` links to (as fsspec's `ls`
    finds them: links under `url`, relative ones joined to it, `..` left out), one at a time:
    a page of short links holds millions (the caller drops the ones it has seen)."""
    mimetype = content_type.partition(";")[0] if content_type else None
    if mimetype not in ("text/html", None):
        return
    text = body.decode("utf-8", errors="ignore")
    del body
    parts = urlparse(url)
    prefix = url.rstrip("/") + "/"
    last = None
    for link in itertools.chain((m.group("url") for m in _SIMPLE_LINK.finditer(text)),
                                (m.group("url") for m in _LINK.finditer(text))):
        if link.startswith("/") and len(link) > 1:
            link = f"{parts.scheme}://{parts.netloc}{link}"
        if link.startswith("http"):
            if not link.replace("https", "http").startswith(prefix.replace("https", "http")):
                continue
        elif link in ("..", "../"):
            continue
        else:
            link = "/".join([url.rstrip("/"), link.lstrip("/")])
        if link != last:
            last = link
            yield link


def _array_items(text: str, bad):
    """The elements of the JSON array `text`, one at a time: an index page is checked (and its
    entry count capped) while it is parsed, never held as a list of dicts as well."""
    decoder = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if text[i:i + 1] != "[":
        if text[i:i + 1] == "{":
            raise bad("is not an array")
        raise bad("is not valid JSON (expected an array)")
    i = _WS.match(text, i + 1).end()
    if text[i:i + 1] == "]":
        i += 1
    else:
        while True:
            try:
                item, i = decoder.raw_decode(text, i)
            except ValueError as exc:
                raise bad(f"is not valid JSON ({exc})") from None
            yield item
            i = _WS.match(text, i).end()
            c = text[i:i + 1]
            if c == ",":
                i = _WS.match(text, i + 1).end()
            elif c == "]":
                i += 1
                break
            else:
                raise bad(f"is not valid JSON (expected ',' or ']' at character {i})")
    if _WS.match(text, i).end() != len(text):
        raise bad(f"is not valid JSON (extra data at character {i})")


def bad_index(source: str, url: str, problem: str) -> UserError:
    return UserError(f"--source {source!r}: the JSON directory index of {url!r} {problem}; serve it as nginx's "
                     "`autoindex_format json` does (an array of {\"name\", \"type\", \"size\"} objects)")


def parse_json_index(body: bytes, url: str, source: str, max_entries: int | None = None) -> list[IndexEntry]:
    """The entries of the JSON index `body` of directory `url`, as a list (iter_json_index's)."""
    entries = list(iter_json_index(body, url, source, max_entries))
    names = set()
    for e in entries:
        if e.name in names:
            raise bad_index(source, url, f"lists {e.name!r} twice")
        names.add(e.name)
    return entries


def iter_json_index(body: bytes, url: str, source: str, max_entries: int | None = None) -> Iterator[IndexEntry]:
    """The entries of the JSON index `body` of directory `url`, one at a time; "other" entries
    (sockets, FIFOs) are left out. Raises UserError naming `source`, `url` and what is wrong,
    also when it has more than `max_entries` entries (what is left of the listing's
    --max-listing-entries). A name listed twice is the caller's to catch (it keeps the names)."""

    def bad(problem: str) -> UserError:
        return bad_index(source, url, problem)

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"is not valid JSON ({exc})") from None
    del body
    for i, item in enumerate(_array_items(text, bad)):
        if max_entries is not None and i >= max_entries:
            raise UserError(f"--source {source!r} lists more entries than --max-listing-entries allows (the "
                            f"directory index of {url!r} goes beyond it); the listing is kept in memory, so a "
                            "larger one needs a higher limit")
        if not isinstance(item, dict):
            raise bad(f"has entry {i} that is not an object")
        name, kind = item.get("name"), item.get("type")
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            raise bad(f"has entry {i} with an unusable name {name!r} (one path component, not '.' or '..')")
        if kind not in TYPES:
            raise bad(f"has entry {name!r} of unknown type {kind!r} (expected one of {', '.join(TYPES)})")
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
        yield IndexEntry(name, kind == "directory", size)
