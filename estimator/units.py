"""Parsing and formatting of sizes (bytes) and rates (bytes/s).

Inside silod every size is a float or int of bytes and every rate bytes per second. On the
command line and in files people write `143GB`, `1.3TB`, `200MB/s`, `1Gbps` or `4GiB`; these
helpers are the single place that turns such text into numbers, so every entry point rejects
the same bad input with the same message.
"""

from __future__ import annotations

import math
import re

from estimator.errors import UserError

_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50, "EI": 2**60}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_RATE_RE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*?)(ps|/s|/sec)?\s*$", re.IGNORECASE
)

SIZE_HELP = "write bytes as a number or with a unit, e.g. 143GB, 1.3TB, 512MiB"
RATE_HELP = "write a rate as bytes/s or with a unit, e.g. 200MB/s, 1.5GB/s, 8Gbps, 100MiB/s"


class UnitError(UserError):
    """A size or rate that cannot be understood; the message says what was wrong and how to fix it."""


def _multiplier(prefix: str, what: str, text: str, help_text: str) -> float:
    p = prefix.upper()
    if p in _DECIMAL:
        return _DECIMAL[p]
    if p in _BINARY:
        return _BINARY[p]
    raise UnitError(f"unknown unit {prefix!r} in {what} {text!r}; {help_text}")


def _split_unit(unit: str) -> tuple[str, bool]:
    """Return (prefix, is_bits) for a unit such as 'GB', 'GiB', 'Gb', 'B', ''."""
    if unit == "":
        return "", False
    if unit.endswith("B"):
        return unit[:-1], False
    if unit.endswith("b"):
        return unit[:-1], True
    # A bare prefix ("4G") is read as bytes, as `dd` and Kubernetes quantities do.
    return unit, False


def _check_finite(value: float, what: str, text: str) -> float:
    if not math.isfinite(value):
        raise UnitError(f"{what} {text!r} is not a finite number")
    if value < 0:
        raise UnitError(f"{what} {text!r} is negative; it must be >= 0")
    return value


def parse_size(value: str | int | float, what: str = "size") -> float:
    """Bytes from `143GB`, `1.3TB`, `4GiB`, `1e9` or a number. Raises UnitError on bad input."""
    if isinstance(value, bool):
        raise UnitError(f"{what} {value!r} is not a size; {SIZE_HELP}")
    if isinstance(value, (int, float)):
        return _check_finite(float(value), what, str(value))
    text = str(value)
    if text.strip().startswith("-"):
        raise UnitError(f"{what} {text!r} is negative; it must be >= 0")
    if re.search(r"(/s|/sec|ps)\s*$", text.strip(), re.IGNORECASE):
        raise UnitError(f"{what} {text!r} is a rate, not a size; {SIZE_HELP}")
    m = _SIZE_RE.match(text)
    if not m:
        raise UnitError(f"{what} {text!r} is not a size; {SIZE_HELP}")
    number, unit = float(m.group(1)), m.group(2)
    prefix, bits = _split_unit(unit)
    result = number * _multiplier(prefix, what, text, SIZE_HELP) / (8 if bits else 1)
    return _check_finite(result, what, text)


def parse_rate(value: str | int | float, what: str = "rate") -> float:
    """Bytes/s from `200MB/s`, `1Gbps`, `100MiB/s`, `5e8` or a number. Raises UnitError on bad input."""
    if isinstance(value, bool):
        raise UnitError(f"{what} {value!r} is not a rate; {RATE_HELP}")
    if isinstance(value, (int, float)):
        return _check_finite(float(value), what, str(value))
    text = str(value)
    if text.strip().startswith("-"):
        raise UnitError(f"{what} {text!r} is negative; it must be >= 0")
    m = _RATE_RE.match(text)
    if not m:
        raise UnitError(f"{what} {text!r} is not a rate; {RATE_HELP}")
    number, unit, per_second = float(m.group(1)), m.group(2), m.group(3)
    if unit and not per_second:
        raise UnitError(f"{what} {text!r} has no time unit; write it per second, e.g. {text}/s")
    prefix, bits = _split_unit(unit)
    if per_second and per_second.lower() == "ps" and unit and not unit.endswith(("b", "B")):
        bits = True  # "Gps" is not a thing people write; "Gbps" is handled by _split_unit
    result = number * _multiplier(prefix, what, text, RATE_HELP) / (8 if bits else 1)
    return _check_finite(result, what, text)


def format_size(num_bytes: float) -> str:
    """Human-readable decimal size: 1.36TB, 143GB, 512B."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.3g}{unit}"
    return f"{num_bytes:.0f}B"


def format_rate(bytes_per_s: float) -> str:
    """Human-readable decimal rate: 114MB/s."""
    if math.isinf(bytes_per_s):
        return "inf"
    return format_size(bytes_per_s) + "/s"
