"""Which dataset URIs the data path may read: one allow-list, shared by the REST API (at
registration), the data manager (at declaration) and the mount (before the first read).

The data path runs with more rights than a user (root for FUSE, the node's network position),
so a user-supplied URI is a confused-deputy hazard: `file:///etc`, a local path, or
`http://169.254.169.254/` (cloud metadata) would be read on the user's behalf. The operator
lists what is allowed; the default is `s3://` and `https://` only.

Entries are either a scheme (`s3`, `https`) or a prefix (`s3://datasets/`,
`https://data.example.com/public/`, `file:///srv/datasets/`). A prefix matches on a path
boundary. `file://` and `http://` are never allowed by scheme alone, only by a prefix an
operator writes out. Whatever the list says, these are refused: local paths without a scheme,
`..` or `.` segments (also percent-encoded) and credentials inside the URI; and unless an
operator's explicit prefix matches, an http(s) host that is loopback, link-local, unspecified or
multicast (as a literal address, `localhost`, or, with `resolve=True` as the mount does, any
address the name resolves to).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from estimator.errors import UserError

DEFAULT_ALLOWED = ("s3", "https")
ENV = "SILOD_ALLOWED_URIS"  # comma-separated entries, for the mount and the data manager
_SCHEME_ONLY_FORBIDDEN = frozenset({"file", "http"})


class UriRejected(UserError):
    """A dataset URI the allow-list refuses; the message names the rule and the fix."""


def _forbidden_address(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast


@dataclass(frozen=True, slots=True)
class UriPolicy:
    allowed: tuple[str, ...] = DEFAULT_ALLOWED

    def __post_init__(self) -> None:
        for entry in self.allowed:
            if "://" in entry:
                if not entry.endswith("/"):
                    raise UserError(f"allowed URI prefix {entry!r} must end with '/' (a directory), e.g. {entry}/")
            elif entry.lower() in _SCHEME_ONLY_FORBIDDEN:
                raise UserError(
                    f"allowed URI entry {entry!r}: {entry}:// is only allowed as an explicit prefix "
                    f"(e.g. {entry}://host/dir/), never as a whole scheme"
                )
            elif not entry.isalnum():
                raise UserError(f"allowed URI entry {entry!r} is neither a scheme (s3, https) nor a prefix ending in '/'")

    @classmethod
    def parse(cls, entries: list[str] | tuple[str, ...] | str | None) -> UriPolicy:
        if entries is None:
            return cls()
        if isinstance(entries, str):
            entries = [e for e in (x.strip() for x in entries.split(",")) if e]
        return cls(tuple(e.strip() for e in entries if e.strip()) or DEFAULT_ALLOWED)

    @classmethod
    def from_env(cls) -> UriPolicy:
        return cls.parse(os.environ.get(ENV))

    def check(self, uri: str, resolve: bool = False) -> str:
        """`uri` if allowed, else UriRejected naming the rule. resolve=True also looks the host
        up and refuses it if any of its addresses is loopback/link-local (the mount, at read time,
        where a DNS answer could have changed since registration)."""
        allowed = ", ".join(self.allowed)
        if not isinstance(uri, str) or not uri or len(uri) > 2048 or any(c.isspace() or ord(c) < 32 for c in uri):
            raise UriRejected("dataset uri must be a non-empty URI of at most 2048 characters without spaces")
        try:
            parts = urlsplit(uri)
            _ = (parts.hostname, parts.port)  # both parse lazily and may raise
        except ValueError as exc:
            raise UriRejected(f"dataset uri {uri!r} is not a valid URI ({exc})") from None
        scheme = parts.scheme.lower()
        if not scheme or "://" not in uri:
            raise UriRejected(f"dataset uri {uri!r} is a local path; local paths are not allowed (allowed: {allowed})")
        if parts.username is not None or parts.password is not None:
            raise UriRejected("dataset uri must not carry credentials; register a credential and name it in the dataset")
        segments = unquote(parts.path).replace("\\", "/").split("/")
        if any(seg in ("..", ".") for seg in segments):
            raise UriRejected(f"dataset uri {uri!r} contains a '..' or '.' segment")
        for entry in self.allowed:
            # A prefix the operator wrote out is trusted as written (e.g. a MinIO on 127.0.0.1).
            if "://" in entry and (uri.startswith(entry) or uri + "/" == entry):
                return uri
        if scheme in ("http", "https"):
            host = (parts.hostname or "").rstrip(".").lower()
            if not host:
                raise UriRejected(f"dataset uri {uri!r} has no host")
            if host == "localhost" or host.endswith(".localhost") or _forbidden_address(host):
                raise UriRejected(
                    f"dataset uri {uri!r}: loopback, link-local, unspecified and multicast hosts are not allowed"
                )
            if resolve:
                try:
                    infos = socket.getaddrinfo(host, parts.port or 443, proto=socket.IPPROTO_TCP)
                except OSError:
                    infos = []  # unreachable hosts fail later, with the fetch's own error
                if any(_forbidden_address(str(info[4][0])) for info in infos):
                    raise UriRejected(f"dataset uri {uri!r}: host {host} resolves to a loopback or link-local address")
        if any("://" not in entry and scheme == entry.lower() for entry in self.allowed):
            return uri
        raise UriRejected(
            f"dataset uri {uri!r} is not allowed: the operator allows {allowed} "
            "(change it with silod serve --allow-uri)"
        )
