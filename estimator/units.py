"""Parsing and formatting of sizes (bytes) and rates (bytes/s).

Inside silod every size is a float or int of bytes and every rate bytes per second. On the
command line and in files people write `143GB`, `1.3TB`, `200MB/s`, `1Gbps` or `4GiB`; these
helpers are the single place that turns such text into numbers, so every entry point rejects
the same bad input with the same message.

They are also the one place that bounds what silod accepts (the CLI, the trace reader, the REST
API's schemas and the data manager all parse through here), because a size like 1e30 bytes is a
typo, not a dataset, and letting it through produces nonsense results with exit code 0:

    size (dataset, cache, step)   0 .. 1 EB        (MAX_SIZE_BYTES = 1e18 bytes)
    rate (f*, remote IO, caps)    0 .. 10 TB/s     (MAX_RATE_BYTES_PER_S = 1e13 bytes/s)
    GPU count (cluster, job)      1 .. 1,000,000   (MAX_GPUS)

A value out of range is a UnitError whose message gives the range.

Bytes unless the unit says bits beyond doubt: `B` is bytes, and a bare prefix (`4G`) or number
is bytes too (as `dd` and Kubernetes quantities read them); bits only as `bit`/`bits`
(`10Gbit`, `10Gbit/s`) or a rate's `bps` (`10Gbps`, `100Mbps`). A lower-case `b` on its own
(`10tb`, `10Gb`, `10Gb/s`) reads as bytes to some people and bits to others, an 8x difference
nothing downstream would reveal, so it is refused with both readings spelled out.
"""

from __future__ import annotations

import math
import re

from estimator.errors import UserError

MAX_SIZE_BYTES = 1e18  # 1 EB: every public dataset and cluster cache is orders of magnitude below
MAX_RATE_BYTES_PER_S = 1e13  # 10 TB/s: above any storage link or GPU input pipeline
MAX_GPUS = 1_000_000  # above the largest clusters built

_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50, "EI": 2**60}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_RATE_RE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*?)(ps|/s|/sec)?\s*$", re.IGNORECASE
)

SIZE_HELP = "write bytes as a number or with a unit, e.g. 143GB, 1.3TB, 512MiB"
RATE_HELP = "write a rate as bytes/s or with a unit, e.g. 200MB/s, 1.5GB/s, 100MiB/s, or in bits as 8Gbps or 8Gbit/s"


class UnitError(UserError):
    """A size or rate that cannot be understood; the message says what was wrong and how to fix it."""


def _multiplier(prefix: str, what: str, text: str, help_text: str) -> float:
    p = prefix.upper()
    if p in _DECIMAL:
        return _DECIMAL[p]
    if p in _BINARY:
        return _BINARY[p]
    raise UnitError(f"unknown unit {prefix!r} in {what} {text!r}; {help_text}")


def _split_unit(unit: str, number: str, what: str, text: str, *, rate_suffix: str = "") -> tuple[str, bool]:
    """Return (prefix, is_bits) for a unit such as 'GB', 'GiB', 'Gbit', 'B', ''. `rate_suffix` is
    the rate's `ps`, `/s` or `/sec` (empty for a size): `Gb` + `ps` is bits, `Gb` alone is refused."""
    if unit == "":
        return "", False
    lower = unit.lower()
    for bits_word in ("bits", "bit"):
        if lower.endswith(bits_word):
            return unit[: -len(bits_word)], True
    if unit.endswith("B"):
        return unit[:-1], False
    if unit.endswith("b"):
        if rate_suffix.lower() == "ps":
            return unit[:-1], True  # "Gbps", "Mbps": bits per second, as network links are quoted
        raise _ambiguous_b(unit[:-1], number, what, text, rate_suffix)
    if rate_suffix.lower() == "ps":  # "10Gps": neither bytes nor bits is written
        raise _ambiguous_b(unit, number, what, text, rate_suffix, why="names neither bytes nor bits")
    # A bare prefix ("4G") is read as bytes, as `dd` and Kubernetes quantities do.
    return unit, False


_PREFIX_NAMES = {"": "", "K": "kilo", "M": "mega", "G": "giga", "T": "tera", "P": "peta", "E": "exa",
                 "KI": "kibi", "MI": "mebi", "GI": "gibi", "TI": "tebi", "PI": "pebi", "EI": "exbi"}


def _ambiguous_b(prefix: str, number: str, what: str, text: str, rate_suffix: str,
                 why: str = "has a lower-case 'b', which reads as bytes or as bits (8x less)") -> UnitError:
    """The error for `10tb` / `10Gb/s`: both readings, their byte values, and how to write each."""
    key = prefix.upper()
    if key not in _DECIMAL and key not in _BINARY:
        help_text = RATE_HELP if rate_suffix else SIZE_HELP
        return UnitError(f"unknown unit {prefix!r} in {what} {text!r}; {help_text}")
    shown = key[0] + key[1:].lower() if key else ""  # "tb" -> "T", "gib" -> "Gi"
    scale = _DECIMAL.get(key) or _BINARY[key]
    as_bytes = float(number) * scale
    name = _PREFIX_NAMES[key]
    if rate_suffix:
        per = "/s"
        byte_form, bit_form = f"{number}{shown}B/s", f"{number}{shown}bps"
        bytes_value, bits_value = format_rate(as_bytes), format_rate(as_bytes / 8)
    else:
        per = ""
        byte_form, bit_form = f"{number}{shown}B", f"{number}{shown}bit"
        bytes_value, bits_value = format_size(as_bytes), format_size(as_bytes / 8)
    return UnitError(
        f"{what} {text!r} is ambiguous: it {why}. "
        f"Write {byte_form} for {number} {name}bytes{per} ({bytes_value}) or {bit_form} for {number} "
        f"{name}bits{per} ({bits_value})")


def _check_finite(value: float, what: str, text: str) -> float:
    if not math.isfinite(value):
        raise UnitError(f"{what} {text!r} is not a finite number")
    if value < 0:
        raise UnitError(f"{what} {text!r} is negative; it must be >= 0")
    return value


def _number(value: int | float, what: str) -> tuple[float, str]:
    """(value as a float, its text for messages). An int beyond a float's range (JSON allows
    300-digit integers) is a UnitError, not an OverflowError; its text is its length, not its digits."""
    try:
        return float(value), str(value)
    except OverflowError:
        digits = int(int(value).bit_length() * math.log10(2)) + 1  # str() of a huge int is slow, or refused
        raise UnitError(f"{what} is an integer of about {digits} digits, beyond any size or rate silod accepts") from None


def check_size(value: float, what: str = "size", text: str | None = None) -> float:
    """`value` bytes if it is finite and within 0 .. MAX_SIZE_BYTES, else a UnitError with the range."""
    text = str(value) if text is None else text
    _check_finite(value, what, text)
    if value > MAX_SIZE_BYTES:
        raise UnitError(f"{what} {text!r} is {value:.3g} bytes, above the limit of 1EB; sizes must be between 0 and 1EB (1e18 bytes)")
    return value


def check_rate(value: float, what: str = "rate", text: str | None = None) -> float:
    """`value` bytes/s if it is finite and within 0 .. MAX_RATE_BYTES_PER_S, else a UnitError with the range."""
    text = str(value) if text is None else text
    _check_finite(value, what, text)
    if value > MAX_RATE_BYTES_PER_S:
        raise UnitError(f"{what} {text!r} is {value:.3g} bytes/s, above the limit of 10TB/s; rates must be between 0 and 10TB/s (1e13 bytes/s)")
    return value


def parse_gpus(value: str | int | float, what: str = "GPU count") -> int:
    """A whole number of GPUs in 1 .. MAX_GPUS, from an int or its text. Raises UnitError otherwise."""
    if isinstance(value, bool):
        raise UnitError(f"{what} {value!r} is not a whole number of GPUs")
    if isinstance(value, float):
        if not value.is_integer():
            raise UnitError(f"{what} {value!r} is not a whole number of GPUs")
        value = int(value)
    try:
        number = int(str(value).strip())
    except ValueError:
        raise UnitError(f"{what} {value!r} is not a whole number of GPUs") from None
    if not 1 <= number <= MAX_GPUS:
        raise UnitError(f"{what} {number} is out of range; GPU counts must be between 1 and {MAX_GPUS:,}")
    return number


def parse_size(value: str | int | float, what: str = "size") -> float:
    """Bytes from `143GB`, `1.3TB`, `4GiB`, `1e9` or a number, at most 1EB. Raises UnitError on bad input."""
    if isinstance(value, bool):
        raise UnitError(f"{what} {value!r} is not a size; {SIZE_HELP}")
    if isinstance(value, (int, float)):
        number, text = _number(value, what)
        return check_size(number, what, text)
    text = str(value)
    if text.strip().startswith("-"):
        raise UnitError(f"{what} {text!r} is negative; it must be >= 0")
    if re.search(r"(/s|/sec|ps)\s*$", text.strip(), re.IGNORECASE):
        raise UnitError(f"{what} {text!r} is a rate, not a size; {SIZE_HELP}")
    m = _SIZE_RE.match(text)
    if not m:
        raise UnitError(f"{what} {text!r} is not a size; {SIZE_HELP}")
    number, unit = float(m.group(1)), m.group(2)
    prefix, bits = _split_unit(unit, m.group(1), what, text)
    result = number * _multiplier(prefix, what, text, SIZE_HELP) / (8 if bits else 1)
    return check_size(result, what, text)


def parse_rate(value: str | int | float, what: str = "rate") -> float:
    """Bytes/s from `200MB/s`, `1Gbps`, `100MiB/s`, `5e8` or a number, at most 10TB/s. Raises UnitError on bad input."""
    if isinstance(value, bool):
        raise UnitError(f"{what} {value!r} is not a rate; {RATE_HELP}")
    if isinstance(value, (int, float)):
        number, text = _number(value, what)
        return check_rate(number, what, text)
    text = str(value)
    if text.strip().startswith("-"):
        raise UnitError(f"{what} {text!r} is negative; it must be >= 0")
    m = _RATE_RE.match(text)
    if not m:
        raise UnitError(f"{what} {text!r} is not a rate; {RATE_HELP}")
    number, unit, per_second = float(m.group(1)), m.group(2), m.group(3)
    if unit and not per_second:
        if unit.endswith(("B", "b", "bit", "bits")) or unit.upper() in ("K", "M", "G", "T", "P", "KI", "MI", "GI", "TI", "PI"):
            raise UnitError(f"{what} {text!r} has no time unit; write it per second, e.g. {text}/s")
        raise UnitError(f"{what} {text!r} is not a rate; {RATE_HELP}")  # "35 cores" is not bytes per second
    prefix, bits = _split_unit(unit, m.group(1), what, text, rate_suffix=per_second or "")
    result = number * _multiplier(prefix, what, text, RATE_HELP) / (8 if bits else 1)
    return check_rate(result, what, text)


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
