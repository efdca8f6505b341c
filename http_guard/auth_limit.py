"""A bound on failed token guesses per client network (issue 47: 64 anonymous clients guessed 431
tokens/s against one API worker).

Each client network (the IPv4 address, or the IPv6 /64: one host holds a whole /64) has a token
bucket of failures: `burst` failures at once, then `rate` per second. Once it is empty, a request
from there that carries a token is answered 429 with Retry-After *without* checking the token, so
a guess made then learns nothing, however right it was. Requests with a valid token never draw
from the bucket; a caller that mistyped a token a few times is not locked out.

Per process (each API worker keeps its own table), bounded to `max_clients` networks (the least
recently failed are forgotten: forgetting only gives a network a full bucket back). Behind a
proxy every client shares the proxy's address: that is then one bucket for all.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable


def client_network(host: str | None) -> str:
    """The key a client's failures are counted under."""
    if not host:
        return "-"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # a unix socket path or a test client's name
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class FailedAuthLimiter:
    def __init__(self, burst: float = 20.0, rate: float = 2.0, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (burst >= 1 and rate > 0 and max_clients >= 1):
            raise ValueError("burst >= 1, rate > 0 and max_clients >= 1")
        self.burst, self.rate, self.max_clients, self.clock = float(burst), float(rate), max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # network -> (tokens, at)

    def _level(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def retry_after(self, host: str | None) -> float:
        """Seconds until a request carrying a token from `host` may be checked (0: now)."""
        key = client_network(host)
        if key not in self._buckets:
            return 0.0
        level = self._level(key, self.clock())
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

    def failed(self, host: str | None) -> None:
        """Count one failed token check from `host`."""
        key, now = client_network(host), self.clock()
        self._buckets[key] = (max(self._level(key, now) - 1.0, 0.0), now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)


def retry_after_header(seconds: float) -> list[tuple[bytes, bytes]]:
    return [(b"retry-after", str(max(1, math.ceil(seconds))).encode())]


__all__ = ["FailedAuthLimiter", "client_network", "retry_after_header"]
