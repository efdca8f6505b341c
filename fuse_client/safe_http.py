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

S3 sources (s3fs over aiobotocore, also aiohttp) get the same two checks through their HTTP
session class (`s3_session_cls`), and more: an S3 client never follows an HTTP redirect (botocore
itself does not; aiobotocore's session would, so an allowed endpoint answering `307` with a
`Location` of an internal address would have that body served as the object). S3's own
`301/307 PermanentRedirect/TemporaryRedirect` answers still work: botocore handles them by
re-resolving the endpoint for the bucket's region, and that request is checked like any other.
Every S3 request must go to the source's endpoint (its host, or a bucket subdomain of it, virtual
hosted style) or, without a custom endpoint, to AWS over https.

A refusal is an OSError naming the URL or address; the fetch fails with EIO and nothing is cached.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from contract.uri_policy import UriPolicy, UriRejected, forbidden_address, forbidden_host, parse_address

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
    # S3 only: the origin (scheme, host, port) every request must go to; None: AWS itself.
    s3_endpoint: tuple[str, str, int] | None = None
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

    @classmethod
    def for_s3(cls, endpoint: str | None, policy: UriPolicy | None) -> "HttpGuard":
        """The guard of an S3 source whose requests go to `endpoint` (None: AWS's own endpoints).

        With an operator's `policy` the endpoint must pass it, as at credential registration,
        and its addresses are trusted only if an operator's prefix names the host. A mount started
        by hand without one trusts the endpoint it was given (whoever started it named it)."""
        if endpoint is None:
            return cls(policy or UriPolicy())
        parts = urlsplit(endpoint)
        scheme = parts.scheme.lower()
        try:
            host, port = (parts.hostname or "").rstrip(".").lower(), parts.port
        except ValueError:
            host, port = "", None
        if scheme not in _DEFAULT_PORTS or not host or parts.query or parts.fragment:
            raise UriRejected(f"S3 endpoint {endpoint!r} is not an http(s) URL with a host")
        origin = f"{scheme}://{parts.netloc}/"
        if policy is None:
            policy = UriPolicy((origin,))
        else:
            policy.check(origin)  # UriRejected names the rule
        return cls(policy, s3_endpoint=(scheme, host, port or _DEFAULT_PORTS[scheme]))

    # -- URLs --------------------------------------------------------------------------------

    def check_s3_url(self, url: str) -> None:
        """An S3 request goes to the endpoint (or a bucket subdomain of it), or to AWS over https."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        try:
            host, port = (parts.hostname or "").rstrip(".").lower(), parts.port or _DEFAULT_PORTS.get(scheme)
        except ValueError:
            host, port = "", None
        if self.s3_endpoint is None:
            ok = scheme == "https" and bool(host) and forbidden_host(host) is None
        else:
            e_scheme, e_host, e_port = self.s3_endpoint
            ok = scheme == e_scheme and port == e_port and (host == e_host or host.endswith("." + e_host))
        if not ok:
            where = "the endpoint " + "%s://%s:%d" % self.s3_endpoint if self.s3_endpoint else "AWS over https"
            log.warning("S3 request to %s refused: not %s", url, where)
            raise DestinationRefused(13, f"S3 request to {url!r} refused: requests go to {where} only")

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
        named = port in self._named.get(h, ())
        if not named and self.s3_endpoint is not None:  # a bucket subdomain of a trusted endpoint
            e_scheme, e_host, e_port = self.s3_endpoint
            named = port == e_port and h.endswith("." + e_host) and port in self._named.get(e_host, ())
        if named:
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

    def resolver(self):
        """An aiohttp resolver (build it inside the event loop) that tells this guard which
        addresses the hosts named by an operator's prefix resolve to."""
        import aiohttp

        guard = self

        class _Resolver(aiohttp.ThreadedResolver):
            async def resolve(self, host, port=0, family=socket.AF_INET):
                results = await super().resolve(host, port, family)
                guard.note_resolved(host, port, [r["host"] for r in results])
                return results

        return _Resolver()

    def get_client(self):
        """An fsspec `get_client`: builds each session with the checks above."""
        guard = self

        async def get_client(loop=None, **kwargs):
            import aiohttp
            from yarl import URL

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
            connector = aiohttp.TCPConnector(resolver=guard.resolver(), socket_factory=guard.socket_factory)
            return aiohttp.ClientSession(connector=connector, trace_configs=[trace], **kwargs)

        return get_client

    def s3_session_cls(self):
        """An aiobotocore HTTP session class (AioConfig's `http_session_cls`) whose connections
        are checked by address, whose requests must go to the endpoint, and that never follows
        an HTTP redirect (botocore's own clients do not either)."""
        from aiobotocore.httpsession import AIOHTTPSession

        guard = self

        class _NoRedirects:
            """The aiohttp session as aiobotocore's `send` uses it (only `request`)."""

            def __init__(self, session) -> None:
                self._session = session

            def request(self, method, url, **kwargs):
                guard.check_s3_url(str(url))
                kwargs["allow_redirects"] = False
                return self._session.request(method, url, **kwargs)

        class GuardedAIOHTTPSession(AIOHTTPSession):
            async def _create_connector(self, proxy_url):
                self._connector_args = {**self._connector_args, "resolver": guard.resolver(),
                                        "socket_factory": guard.socket_factory}
                return await super()._create_connector(proxy_url)

            async def _get_session(self, proxy_url):
                return _NoRedirects(await super()._get_session(proxy_url))

        return GuardedAIOHTTPSession
