"""HTTP(S) sessions for the mount that never leave the allow-list, whatever a server answers.

The policy (contract/uri_policy.py) is checked once for the registered URI; without this module
a server that is allowed could still send the mount elsewhere: a `302` to an internal address
(cloud metadata, a pod-local port) would be followed, and its body cached and served to every
job of the dataset; and a name that resolved to a public address at the check could resolve to
an internal one at the fetch (DNS rebinding). So every session of the mount's HTTP file system
(fsspec over aiohttp) gets:

- a trace hook that checks each request URL and, before it is followed, each redirect target
  against the same policy (scheme, prefix or scheme rule, literal addresses in any spelling);
- a socket factory that refuses to connect to a loopback, link-local, private, unspecified or
  multicast address unless an operator's prefix names that host and port. It runs on the very
  address the connection is made to (after aiohttp's own resolution), so nothing can change
  between the check and the connect.

A refusal is an OSError naming the URL or address; the fetch fails with EIO and nothing is cached.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from contract.uri_policy import UriPolicy, UriRejected, forbidden_address, parse_address

log = logging.getLogger(__name__)

_DEFAULT_PORTS = {"http": 80, "https": 443}


class DestinationRefused(OSError):
    """A request or connection the allow-list does not allow."""


@dataclass
class HttpGuard:
    """The allow-list as the mount's HTTP client applies it.

    `policy`: the operator's (SILOD_ALLOWED_URIS), or for a mount started by hand without one,
    a policy whose only entry is the source's own prefix (the operator named exactly that)."""

    policy: UriPolicy
    _trusted: set[tuple[str, int]] = field(default_factory=set)  # (address, port) named hosts resolve to
    _named: dict[str, set[int]] = field(default_factory=dict)  # host -> ports named by a prefix
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for entry in self.policy.allowed:
            if "://" not in entry:
                continue
            parts = urlsplit(entry)
            scheme = parts.scheme.lower()
            if scheme not in _DEFAULT_PORTS or not parts.hostname:
                continue
            host = parts.hostname.rstrip(".").lower()
            port = parts.port or _DEFAULT_PORTS[scheme]
            self._named.setdefault(host, set()).add(port)
            ip = parse_address(host)
            if ip is not None:
                self._trusted.add((str(ip), port))

    @classmethod
    def for_source(cls, source: str, policy: UriPolicy | None) -> "HttpGuard":
        if policy is None:
            policy = UriPolicy((source.rstrip("/") + "/",))
        return cls(policy)

    # -- URLs --------------------------------------------------------------------------------

    def check_url(self, url: str, why: str = "request") -> None:
        scheme = urlsplit(url).scheme.lower()
        if scheme not in _DEFAULT_PORTS:
            raise DestinationRefused(13, f"{why} to {url!r} refused: only http(s) is fetched")
        try:
            self.policy.check(url)
        except UriRejected as exc:
            log.warning("%s to %s refused by the allow-list: %s", why, url, exc)
            raise DestinationRefused(13, f"{why} to {url!r} refused by the allow-list: {exc}") from None

    # -- addresses ---------------------------------------------------------------------------

    def note_resolved(self, host: str, port: int, addresses: list[str]) -> None:
        """Addresses a host named by an operator's prefix resolved to: connections to them are
        allowed (the operator named the host, so an internal address is what they meant)."""
        h = host.rstrip(".").lower()
        if port in self._named.get(h, ()):
            with self._lock:
                self._trusted.update((str(parse_address(a) or a), port) for a in addresses)

    def check_address(self, address: str, port: int) -> None:
        kind = forbidden_address(address)
        if kind is None:
            return
        ip = parse_address(address)
        with self._lock:
            trusted = (str(ip), port) in self._trusted
        if not trusted:
            log.warning("connection to %s port %d refused: a %s address no allowed prefix names", address, port, kind)
            raise DestinationRefused(13, f"connection to {address} port {port} refused: a {kind} address that no "
                                         "allowed prefix names")

    def socket_factory(self, addr_info) -> socket.socket:
        family, type_, proto, _canon, sockaddr = addr_info
        self.check_address(str(sockaddr[0]), int(sockaddr[1]))
        return socket.socket(family=family, type=type_, proto=proto)

    # -- aiohttp -----------------------------------------------------------------------------

    def get_client(self):
        """An fsspec `get_client`: builds each session with the checks above."""
        guard = self

        async def get_client(loop=None, **kwargs):
            import aiohttp
            from yarl import URL

            class _Resolver(aiohttp.ThreadedResolver):
                async def resolve(self, host, port=0, family=socket.AF_INET):
                    results = await super().resolve(host, port, family)
                    guard.note_resolved(host, port, [r["host"] for r in results])
                    return results

            async def on_start(session, ctx, params) -> None:
                guard.check_url(str(params.url))

            async def on_redirect(session, ctx, params) -> None:
                location = params.response.headers.get("Location") or params.response.headers.get("URI")
                if location:
                    target = params.response.url.join(URL(location))
                    guard.check_url(str(target), why=f"redirect from {params.response.url}")

            trace = aiohttp.TraceConfig()
            trace.on_request_start.append(on_start)
            trace.on_request_redirect.append(on_redirect)
            connector = aiohttp.TCPConnector(resolver=_Resolver(), socket_factory=guard.socket_factory)
            return aiohttp.ClientSession(connector=connector, trace_configs=[trace], **kwargs)

        return get_client
