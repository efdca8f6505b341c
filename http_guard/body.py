"""The request-body cap and the JSON replies of the services' ASGI middlewares."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the cap. An HTTPException, so FastAPI's
    body reader lets it through unchanged and its handler answers 413."""

    def __init__(self, limit: int):
        super().__init__(status_code=413, detail=f"request body larger than {limit} bytes")


def capped_receive(receive: Receive, limit: int) -> Receive:
    """`receive`, raising BodyTooLarge as soon as the body so far passes `limit` bytes: a client
    that sends no Content-Length (chunked) cannot make the server hold more than the cap."""
    received = 0

    async def limited() -> dict[str, Any]:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
        return message

    return limited


async def send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                    *(headers or [])],
    })
    await send({"type": "http.response.body", "body": payload})
