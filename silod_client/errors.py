"""Errors the client raises. Every answer of the API outside 2xx becomes an `ApiError` carrying
the status, the API's message (`detail`) and the field it names; a server that cannot be reached
(or does not answer in time) is a `TransportError`."""

from __future__ import annotations

from typing import Any


class SilodError(Exception):
    """Base of every error this package raises."""


class TransportError(SilodError):
    """No answer: the server cannot be reached, the connection broke, or it timed out."""

    def __init__(self, message: str, *, method: str, url: str):
        super().__init__(message)
        self.method, self.url = method, url


class ApiError(SilodError):
    """An HTTP error answer. `detail` is the API's message (for a validation error, one line per
    problem naming its field); `field` the input it concerns, when the API names one."""

    def __init__(self, status: int, detail: str, *, field: str | None = None, method: str = "", path: str = "",
                 body: Any = None, retry_after: float | None = None):
        where = f"{method} {path}: " if method else ""
        super().__init__(f"{where}HTTP {status}: {detail}")
        self.status, self.detail, self.field = status, detail, field
        self.method, self.path, self.body, self.retry_after = method, path, body, retry_after


class BadRequest(ApiError):
    """400/422: the request is wrong (the message names the input and the fix)."""


class Unauthorized(ApiError):
    """401: missing, invalid, revoked or expired token."""


class Forbidden(ApiError):
    """403: not allowed for this token (admin only, beyond a quota)."""


class NotFound(ApiError):
    """404: no such object (or another tenant's)."""


class Conflict(ApiError):
    """409: conflicts with the current state (a job that already ended, an Idempotency-Key reused
    with another body, a re-registration with other fields)."""


class TooLarge(ApiError):
    """413: the request body is above the server's cap."""


class ServerError(ApiError):
    """5xx: the server failed; 503 is a database outage (see `retry_after`)."""


_BY_STATUS: dict[int, type[ApiError]] = {400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound,
                                         409: Conflict, 413: TooLarge, 422: BadRequest}


def error_for(status: int) -> type[ApiError]:
    if status >= 500:
        return ServerError
    return _BY_STATUS.get(status, ApiError)


class WaitTimeout(SilodError):
    """`jobs.wait` gave up before the job reached one of the states it waited for."""

    def __init__(self, message: str, last: Any):
        super().__init__(message)
        self.last = last
