"""Read timeouts: a client may not hold a connection by sending its request slowly.

uvicorn's h11 server bounds only the idle time between requests (keep-alive); a client that sends
half a request line or header block, or a body one byte at a time, held its connection and a
slot for ever (issue 20: slow-header and slow-body connections were kept with no timeout).

- Headers: `HeaderTimeoutH11Protocol` closes a connection whose request headers are not complete
  HEADER_TIMEOUT_S after it opened or after the previous response (pass it as uvicorn's `http`).
- Body: `timed_receive` answers 408 when the body stalls for `idle_s` or is not complete after
  `total_s` (the services' guards wrap `receive` with it).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from http_guard.body import Receive

HEADER_TIMEOUT_S = 10.0
BODY_IDLE_TIMEOUT_S = 10.0
BODY_TOTAL_TIMEOUT_S = 60.0


class BodyTimeout(HTTPException):
    def __init__(self, detail: str):
        super().__init__(status_code=408, detail=detail, headers={"Connection": "close"})


def timed_receive(receive: Receive, idle_s: float = BODY_IDLE_TIMEOUT_S, total_s: float = BODY_TOTAL_TIMEOUT_S) -> Receive:
    """`receive`, raising BodyTimeout when the next body chunk takes over `idle_s` or the whole
    body over `total_s` (from the first read). Once the body is complete, later calls (waiting
    for a disconnect) pass through untimed."""
    deadline: float | None = None
    complete = False

    async def timed() -> dict[str, Any]:
        nonlocal deadline, complete
        if complete:
            return await receive()
        now = time.monotonic()
        if deadline is None:
            deadline = now + total_s
        budget = min(idle_s, deadline - now)
        if budget <= 0:
            raise BodyTimeout(f"request body not complete within {total_s:g} s")
        try:
            with anyio.fail_after(budget):
                message = await receive()
        except TimeoutError:
            raise BodyTimeout(f"request body stalled for {budget:g} s; send it at once") from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            complete = True
        return message

    return timed


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on an accepted connection. asyncio sets it only on sockets whose `proto` is
    IPPROTO_TCP, and a listening socket made with `socket.socket(AF_INET)` (uvicorn's for
    `--workers N`, ServerThread's) has proto 0, as do the connections it accepts: Nagle stayed
    on, and h11 writes a response's head and body separately, so the body waited for the
    client's delayed ACK (~40 ms on Linux) on every request (issue 20, item 8)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is already gone: nothing to speed up
            pass


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent complete request headers
    within `header_timeout_s` of opening or of its previous response."""

    header_timeout_s = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_headers():
            self._cancel_header_timer()  # a request is being answered: the body has its own timeouts

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._waiting_for_headers():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol with another header timeout (in-process servers and tests; `silod serve`
    uses HeaderTimeoutH11Protocol itself, which its worker processes import by name)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": seconds})
