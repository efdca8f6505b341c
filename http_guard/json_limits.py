"""JSON bodies refused for their shape before any model validates them.

A body under the size cap can still be expensive: 1 MB of 60,000 unknown keys made pydantic and
FastAPI build 60,003 errors (4.5-6.1 s of CPU and a 5.4 MB 422 per request, issue 20). Here the
body is parsed once (C json, ~15 ms for 1 MB) and its shape checked against fixed bounds before
any validation: nesting depth, keys per object, items per list and values in all. The walk stops
at the first value past a bound and never visits more than `max_values` values, so a refused
body costs the parse and little more. The services' models then reject unknown fields at the
first one (scheduler/service/api/schemas.py `_Strict`).

The bounds are generic (no route's schema here): each service picks bounds above its largest
legal body (the scheduler API: a consumption report of 1,000 pods of 6 values).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException


@dataclass(frozen=True, slots=True)
class JsonLimits:
    max_depth: int = 8  # nested objects/lists
    max_keys: int = 64  # keys in one object
    max_items: int = 1000  # items in one list
    max_values: int = 16_384  # values (objects, lists, scalars) in the whole body


class BodyShapeError(HTTPException):
    """A body past a bound: 422 naming the bound and where it was passed. An HTTPException so
    FastAPI's body reader lets it through unchanged."""

    def __init__(self, detail: str, where: str):
        super().__init__(status_code=422, detail=f"request body {detail} at {where or 'the top'}")
        self.where = where


class NotJsonBody(BodyShapeError):
    """A body sent with a Content-Type that is not JSON to a route that takes JSON: 415 saying
    which header to send (FastAPI would hand the raw bytes to the model, whose 422 "Input should
    be a valid dictionary" does not say that the header is what is wrong)."""

    def __init__(self, content_type: str):
        HTTPException.__init__(self, status_code=415, detail=(
            f"request body sent as {content_type[:100]!r}; send it as JSON with the header 'Content-Type: application/json'"))
        self.where = ""


def is_json_content_type(value: str) -> bool:
    """application/json or application/<anything>+json, parameters ignored (FastAPI's own rule
    for parsing a body as JSON)."""
    media = value.split(";", 1)[0].strip().lower()
    kind, _, sub = media.partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


#: Python's own bound on int(str) (sys.int_info.default_max_str_digits): json.loads raised a
#: ValueError past it, which FastAPI answered with a 400 naming no field.
MAX_INT_DIGITS = 4300


@dataclass(frozen=True, slots=True)
class _LongInteger:
    """A JSON integer past MAX_INT_DIGITS, kept as its length until check_shape says where it is."""

    digits: int


def _parse_int(text: str) -> int | _LongInteger:
    return int(text) if len(text) <= MAX_INT_DIGITS else _LongInteger(len(text.lstrip("-")))


def check_shape(value: Any, limits: JsonLimits) -> None:
    """Raise BodyShapeError at the first value past a bound. Iterative (a deep body cannot
    exhaust the stack here) and bounded by `limits.max_values` visits."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    seen = 0
    while stack:
        v, depth, where = stack.pop()
        seen += 1
        if seen > limits.max_values:
            raise BodyShapeError(f"has more than {limits.max_values} values", where)
        if isinstance(v, dict):
            if depth > limits.max_depth:
                raise BodyShapeError(f"is nested deeper than {limits.max_depth} levels", where)
            if len(v) > limits.max_keys:
                raise BodyShapeError(f"has an object of {len(v)} keys (at most {limits.max_keys})", where)
            stack.extend((x, depth + 1, f"{where}.{k}"[:200]) for k, x in v.items())
        elif isinstance(v, list):
            if depth > limits.max_depth:
                raise BodyShapeError(f"is nested deeper than {limits.max_depth} levels", where)
            if len(v) > limits.max_items:
                raise BodyShapeError(f"has a list of {len(v)} items (at most {limits.max_items})", where)
            stack.extend((x, depth + 1, f"{where}[{i}]"[:200]) for i, x in enumerate(v))
        elif isinstance(v, _LongInteger):
            raise BodyShapeError(f"has an integer of {v.digits} digits (at most {MAX_INT_DIGITS}; no field takes"
                                 f" one that large)", where)


def loads_limited(body: bytes, limits: JsonLimits) -> Any:
    """json.loads, then check_shape. A body nested past the interpreter's recursion limit
    fails inside the parser at once (RecursionError), answered as too deep. Integers are parsed
    by C json unless one is past MAX_INT_DIGITS (its ValueError, not a JSONDecodeError): only then
    is the body parsed again with `_parse_int`, a Python call per integer (250,000 of them
    doubled the cost of refusing a body that is past a bound anyway)."""
    try:
        try:
            value = json.loads(body)
        except ValueError as error:
            if isinstance(error, json.JSONDecodeError):
                raise
            value = json.loads(body, parse_int=_parse_int)
    except RecursionError:
        raise BodyShapeError(f"is nested deeper than {limits.max_depth} levels", "") from None
    check_shape(value, limits)
    return value


def limited_json_route(limits: JsonLimits) -> type[APIRoute]:
    """A FastAPI route class whose requests parse JSON with `loads_limited` (FastAPI's documented
    custom Request/APIRoute pattern): one parse, checked before the body model validates it.
    Set it as `app.router.route_class` before the routes are declared."""

    class LimitedRequest(Request):
        async def json(self) -> Any:
            if not hasattr(self, "_json"):
                self._json = loads_limited(await self.body(), limits)
            return self._json

    class LimitedJsonRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            takes_body = self.body_field is not None

            async def limited(request: Request) -> Response:
                request = LimitedRequest(request.scope, request.receive)
                content_type = request.headers.get("content-type")
                # FastAPI parses a body as JSON when it has no Content-Type or a JSON one. The
                # body (already bounded by the request guard) is read only for a wrong type, and
                # Starlette keeps it on the request for the handler.
                if takes_body and content_type is not None and not is_json_content_type(content_type) and await request.body():
                    raise NotJsonBody(content_type)
                return await handler(request)

            return limited

    return LimitedJsonRoute
