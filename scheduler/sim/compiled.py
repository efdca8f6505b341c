"""How the simulator's kernels are compiled (numba): `kernel(signature)` for the ones Python
calls, `kernel()` for the helpers they call.

A kernel is compiled once and kept in numba's cache, so later processes load it in milliseconds.
numba decides whether a cached kernel is still valid by its own source file only, but the kernels
inline helpers (`np_min`) and constants (position.py, reader_rows.py) from other modules: an
edit there left every cached kernel silently stale. So the cache lives in a directory named
after a digest of all of the simulator's sources (`_cache_dir`, under NUMBA_CACHE_DIR or the
user's cache directory; an older source's directory can be deleted), and any edit compiles
afresh. Where no cache can be written (a read-only install and no writable home), numba refuses
to cache at all; the kernel is then compiled in memory in every process (a few seconds at
import) rather than failing.
"""

from __future__ import annotations

from collections.abc import Callable
import hashlib
import os
from pathlib import Path
from typing import Any

import numba


def _cache_dir() -> str | None:
    """numba's cache directory for this version of the simulator's sources (None: no home to
    put it in; numba then caches next to the modules)."""
    base = os.environ.get("NUMBA_CACHE_DIR")
    if not base:
        home = os.path.expanduser("~")
        if home == "~":
            return None
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "silod", "numba")
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return os.path.join(base, digest.hexdigest()[:16])


numba.config.CACHE_DIR = _cache_dir() or ""


def kernel(signature: Any = None, **options: Any) -> Callable[[Callable], Callable]:
    """numba.njit with numpy's float semantics (x/0 is inf or NaN, as in the numpy code the
    kernels replace, not an exception) and a cache where one can be written. With a signature
    the kernel compiles (or loads) at import, not in a run's first step."""

    def compile_(fn: Callable) -> Callable:
        args = () if signature is None else (signature,)
        try:
            return numba.njit(*args, cache=True, error_model="numpy", **options)(fn)
        except RuntimeError as err:
            if "no locator available" not in str(err):
                raise
            return numba.njit(*args, cache=False, error_model="numpy", **options)(fn)

    return compile_


@kernel(inline="always")
def np_min(a: float, b: float) -> float:
    """np.minimum on two floats, inside a kernel: a NaN wins (Python's min would not say), and
    of two equal values the second is taken, as numpy does (np.minimum(0.0, -0.0) is -0.0)."""
    if a != a:
        return a
    if b != b:
        return b
    return a if a < b else b


@kernel(inline="always")
def np_max(a: float, b: float) -> float:
    """np.maximum on two floats, inside a kernel, with np_min's rules (a NaN wins; of two equal
    values the second)."""
    if a != a:
        return a
    if b != b:
        return b
    return a if a > b else b
