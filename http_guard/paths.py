"""Request paths the services refuse before any route or rule sees them."""

from __future__ import annotations

import re

# Percent-decoded control characters (%0A, %00, ...). No silod route has one, and they let a path
# differ from the rules' exact comparisons while still matching a route: Starlette compiles
# routes as `^/metrics$`, and Python's `$` also matches before a trailing newline, so
# "/metrics\n" passed the guard's `path == "/metrics"` check and reached the route.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

BAD_PATH_DETAIL = "the request path holds a control character (such as %0A or %00); no silod route has one"


def has_control_character(path: str) -> bool:
    return _CONTROL.search(path) is not None
