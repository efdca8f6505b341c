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
`..` or `.` segments (also percent-encoded), credentials inside the URI, `::` (an fsspec chain
of file systems), invisible or control characters (U+202E and its kind), a `file://` path that
resolves through a symlink outside its prefix (where the path exists); and unless an
operator's explicit prefix matches, an http(s) host that is not a public address: loopback,
link-local, private (10/8, 172.16/12, 192.168/16, fc00::/7: the in-cluster network),
carrier-grade NAT, unspecified, reserved or multicast - as a literal address in any spelling the
C library accepts (`127.1`, `2130706433`, `0x7f000001`, `0`, `::ffff:127.0.0.1`), `localhost`, or,
with `resolve=True` as the mount does, any address the name resolves to.

`parse_address` and `forbidden_address` are the one address parser: registration (here), the
mount's check before it lists, and the mount's connections (fuse_client/safe_http.py: every
redirect target and every address a name resolves to, at connect time) all use them.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import unicodedata
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from estimator.errors import UserError

DEFAULT_ALLOWED = ("s3", "https")
ENV = "SILOD_ALLOWED_URIS"  # comma-separated entries, for the mount and the data manager
_SCHEME_ONLY_FORBIDDEN = frozenset({"file", "http"})


class UriRejected(UserError):
    """A dataset URI the allow-list refuses; the message names the rule and the fix."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LEGACY_V4 = frozenset("0123456789abcdefx.")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and routes to: mapped (::ffff:a.b.c.d),
    compatible (::a.b.c.d), 6to4 (2002:ab:cd::) and NAT64 (64:ff9b::a.b.c.d)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or (ip.packed[:12] == bytes(12) and int(ip) > 1):
        return ipaddress.IPv4Address(ip.packed[12:])
    return None


def parse_address(host: str) -> IPAddress | None:
    """`host` as an IP address if it is one in any spelling a resolver or the C library takes
    (None for a name): dotted quads, the short and numeric IPv4 forms inet_aton accepts (`127.1`,
    `2130706433`, `0x7f000001`, `0177.0.0.1`, `0`), bracketed IPv6 with or without a zone; an IPv6
    address that embeds an IPv4 one is returned as that IPv4 address."""
    h = host.strip().rstrip(".").lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    h = h.split("%", 1)[0]
    if not h:
        return None
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        if not set(h) <= _LEGACY_V4 or not h[0].isdigit():
            return None
        try:
            return ipaddress.IPv4Address(socket.inet_aton(h))  # what getaddrinfo/connect would use
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address):
        return _embedded_v4(ip) or ip
    return ip


def address_kind(ip: IPAddress) -> str | None:
    """Why the data path may not connect to `ip` on its own authority (None: a public address)."""
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private or not ip.is_global:  # 10/8, 172.16/12, 192.168/16, fc00::/7, 100.64/10, reserved
        return "private"
    return None


def forbidden_address(addr: str) -> str | None:
    """The kind of forbidden address `addr` is (see address_kind), None if it is not one."""
    ip = parse_address(addr)
    return None if ip is None else address_kind(ip)


def forbidden_host(host: str) -> str | None:
    """Like forbidden_address, for a URL's host: also `localhost` and its subdomains."""
    h = host.strip().rstrip(".").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return "loopback"
    return forbidden_address(h)


_forbidden_address = forbidden_address

#: Unicode categories no URI needs: format (bidi overrides, zero-width), control, separators,
#: private use, unassigned, surrogates.
_INVISIBLE = frozenset({"Cf", "Cc", "Co", "Cn", "Cs", "Zl", "Zp", "Zs"})


def _check_beneath(uri: str, path: str, prefix: str) -> None:
    """A file:// dataset under an operator's prefix must stay beneath it once symlinks are
    followed, as the mount opens it (fuse_client/beneath.py). Checked where the path exists
    (the API on the nodes' shared file system, the mount always); elsewhere the mount checks."""
    if not os.path.lexists(path):
        return
    real, root = os.path.realpath(path), os.path.realpath(prefix)
    if real != root and not real.startswith(root.rstrip("/") + "/"):
        raise UriRejected(f"dataset uri {uri!r} resolves (through a symbolic link) to {real}, outside the allowed"
                          f" prefix file://{prefix}")


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

    def explicit_prefix(self, uri: str) -> str | None:
        """The operator's prefix entry that `uri` lies under (on a path boundary), if any."""
        for entry in self.allowed:
            if "://" in entry and (uri.startswith(entry) or uri + "/" == entry):
                return entry
        return None

    def named_hosts(self) -> frozenset[str]:
        """Hosts (lower case, with port if given) that an operator's prefix names explicitly:
        the data path may connect to them whatever they resolve to."""
        hosts = set()
        for entry in self.allowed:
            if "://" in entry:
                parts = urlsplit(entry)
                if parts.hostname:
                    hosts.add(parts.hostname.rstrip(".").lower())
        return frozenset(hosts)

    def check(self, uri: str, resolve: bool = False) -> str:
        """`uri` if allowed, else UriRejected naming the rule. resolve=True also looks the host
        up and refuses it if any of its addresses is loopback/link-local (the mount, at read time,
        where a DNS answer could have changed since registration)."""
        allowed = ", ".join(self.allowed)
        if not isinstance(uri, str) or not uri or len(uri) > 2048 or any(c.isspace() or ord(c) < 32 for c in uri):
            raise UriRejected("dataset uri must be a non-empty URI of at most 2048 characters without spaces")
        odd = next((c for c in uri if unicodedata.category(c) in _INVISIBLE), None)
        if odd is not None:
            # U+202E (right-to-left override) and its kind make a URI display as another one.
            raise UriRejected(f"dataset uri contains the invisible or control character U+{ord(odd):04X}; type the URI"
                              " without it")
        if "::" in re.sub(r"\[[0-9A-Fa-f:.%]*\]", "", uri, count=1):  # an IPv6 host's :: is not a chain
            # fsspec reads `a::b` as a chain of file systems (the mount's client would open b
            # through a): one URI names one store.
            raise UriRejected(f"dataset uri {uri!r} contains '::' (a chain of file systems); give one store's URI")
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
        prefix = self.explicit_prefix(uri)
        if prefix is not None:
            # A prefix the operator wrote out is trusted as written (e.g. a MinIO on 127.0.0.1).
            if scheme == "file":
                _check_beneath(uri, unquote(parts.path), unquote(urlsplit(prefix).path))
            return uri
        if scheme in ("http", "https"):
            host = (parts.hostname or "").rstrip(".").lower()
            if not host:
                raise UriRejected(f"dataset uri {uri!r} has no host")
            kind = forbidden_host(host)
            if kind is not None:
                raise UriRejected(
                    f"dataset uri {uri!r}: host {host} is a {kind} address; loopback, link-local, private, unspecified "
                    "and multicast hosts are only allowed when an operator's allowed prefix names them"
                )
            if resolve:
                try:
                    infos = socket.getaddrinfo(host, parts.port or 443, proto=socket.IPPROTO_TCP)
                except OSError:
                    infos = []  # unreachable hosts fail later, with the fetch's own error
                for info in infos:
                    kind = forbidden_address(str(info[4][0]))
                    if kind is not None:
                        raise UriRejected(f"dataset uri {uri!r}: host {host} resolves to a {kind} address ({info[4][0]})")
        if any("://" not in entry and scheme == entry.lower() for entry in self.allowed):
            return uri
        raise UriRejected(
            f"dataset uri {uri!r} is not allowed: the operator allows {allowed} "
            "(change it with silod serve --allow-uri)"
        )
