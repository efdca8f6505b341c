"""Validation of dataset names and job ids, shared by `silod mount` and the data manager API.

Names become directory names in the cache and path segments in URLs, so anything that could
escape a directory (`/`, `..`) or confuse a URL is rejected with a message naming the input.
"""

from __future__ import annotations

import re

from estimator.errors import UserError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
NAME_HELP = "use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit (no '/' and no '..')"


def validate_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise UserError(f"{what} {value!r} is not a valid name; {NAME_HELP}")
    return value
