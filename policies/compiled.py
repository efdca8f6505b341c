"""How the project's kernels are compiled (numba): `kernel(signature)` for the ones Python
calls, `kernel()` for the helpers they call. The simulator's (scheduler/sim/*_kernel.py),
Gavel's (policies/gavel_kernel.py) and the round planner's (scheduler/core/planner_kernel.py)
use it, and the helpers every kernel shares are here: numpy's min and max on floats, and
numpy's summation order (`pairwise_sum`), which keeps a compiled sum bit-identical to the numpy
one it replaces.

A kernel is compiled once and kept in numba's cache, so later processes load it in milliseconds.
numba decides whether a cached kernel is still valid by its own source file only, but the kernels
inline helpers (`np_min`) and constants (position.py, reader_rows.py) from other modules: an
edit there left every cached kernel silently stale. So the cache lives in a directory named
after a digest of all the sources of the packages that hold kernels (`_cache_dir`, under
NUMBA_CACHE_DIR or the user's cache directory; an older source's directory can be deleted), and
any edit compiles afresh. Inside that directory a kernel is found by its package and name, not
by the checkout's path (`_PortableLocator`), so another clone or venv of the same sources loads
it instead of compiling again. Where no cache can be written (a read-only install and no writable
home), numba refuses to cache at all; the kernel is then compiled in memory in every process (a
few seconds at import) rather than failing.
"""

from __future__ import annotations

from collections.abc import Callable
import hashlib
import os
from pathlib import Path
from typing import Any

import numba
import numpy as np


_ROOT = Path(__file__).resolve().parent.parent
#: The packages whose modules hold kernels or what kernels inline (by path: the scheduler's
#: packages are layers above this one and are not imported here).
KERNEL_PACKAGES = ("policies", "scheduler/core", "scheduler/sim")


def kernel_sources() -> list[Path]:
    """Every source a cached kernel may depend on, in a fixed order."""
    return sorted(p for package in KERNEL_PACKAGES for p in (_ROOT / package).glob("*.py"))


def _cache_dir() -> str | None:
    """numba's cache directory for this version of the kernels' sources (None: no home to
    put it in; numba then caches next to the modules)."""
    base = os.environ.get("NUMBA_CACHE_DIR")
    if not base:
        home = os.path.expanduser("~")
        if home == "~":
            return None
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "silod", "numba")
    digest = hashlib.sha256()
    for path in kernel_sources():
        digest.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes())
    return os.path.join(base, digest.hexdigest()[:16])


numba.config.CACHE_DIR = _cache_dir() or ""


from numba.core import caching as _caching

#: numba's list of cache locators (`CacheImpl` since 0.61, `_CacheImpl` before); without it, numba's
#: own locators are used (a cache keyed by the checkout's path).
_CacheImpl = getattr(_caching, "CacheImpl", None) or getattr(_caching, "_CacheImpl", None)
_CacheLocator = getattr(_caching, "_CacheLocator", None) if _CacheImpl is not None else None


if _CacheLocator is not None:

    class _PortableLocator(_CacheLocator):
        """Where numba keeps this project's kernels: `CACHE_DIR/<package>` (e.g. `.../policies`),
        whatever the checkout's path. numba's own locator names the directory after a hash of the
        source file's absolute path, so every new clone or venv compiled everything again (about
        20 CPU s for Gavel's kernels, a minute at nice +10 on a busy node); CACHE_DIR is already
        named after a digest of the sources, so equal sources share one cache. The stamp is the
        file's content hash, so copies with other modification times are still valid."""

        def __init__(self, py_func: Callable, py_file: str) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            package = Path(py_file).resolve().parent.relative_to(_ROOT)
            self._cache_path = os.path.join(numba.config.CACHE_DIR, *package.parts)

        def get_cache_path(self) -> str:
            return self._cache_path

        def get_source_stamp(self) -> str:
            return hashlib.sha256(Path(self._py_file).read_bytes()).hexdigest()

        def get_disambiguator(self) -> str:
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func: Callable, py_file: str) -> _PortableLocator | None:
            if not numba.config.CACHE_DIR or not Path(py_file).resolve().is_relative_to(_ROOT):
                return None  # not ours, or no cache directory: numba's own locators decide
            self = cls(py_func, py_file)
            try:
                self.ensure_cache_path()
            except OSError:
                return None
            return self

    if _PortableLocator not in _CacheImpl._locator_classes:
        _CacheImpl._locator_classes.insert(0, _PortableLocator)


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


#: numpy's block of its pairwise summation (loops_utils.h: `pairwise_sum`).
_PAIRWISE_BLOCK = 128


@kernel()
def _block_sum(a: np.ndarray, lo: int, n: int) -> float:
    """numpy's sum of a[lo:lo+n] for n <= 128: below 8 in order; else eight running sums over
    strides of 8, added as ((0+1)+(2+3))+((4+5)+(6+7)), then the rest in order."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    end = n - n % 8
    while i < end:
        k = lo + i
        r0 += a[k]
        r1 += a[k + 1]
        r2 += a[k + 2]
        r3 += a[k + 3]
        r4 += a[k + 4]
        r5 += a[k + 5]
        r6 += a[k + 6]
        r7 += a[k + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@kernel()
def pairwise_sum(a: np.ndarray, n: int) -> float:
    """a[:n].sum() as numpy computes it for a contiguous float64 array (0.0 plus its pairwise
    sum: blocks of at most 128, a longer range split at half its length rounded down to a
    multiple of 8), so a kernel's sums are bit-identical to the numpy code it replaces
    (tests/test_gavel_kernel.py checks that on random arrays). Without recursion: numba's cache
    mishandles recursive kernels (a cached one crashed the process that loaded it)."""
    if n <= _PAIRWISE_BLOCK:
        return 0.0 + _block_sum(a, 0, n)
    # Post-order walk of numpy's split tree: (start, length, children visited) per open range.
    start = np.empty(64, dtype=np.int64)
    length = np.empty(64, dtype=np.int64)
    visited = np.zeros(64, dtype=np.int64)
    partial = np.empty(64)
    top, done = 0, 0
    start[0], length[0] = 0, n
    while top >= 0:
        lo, k = start[top], length[top]
        if k <= _PAIRWISE_BLOCK:
            partial[done] = _block_sum(a, lo, k)
            done += 1
            top -= 1
            continue
        half = k // 2
        half -= half % 8
        if visited[top] == 0:
            visited[top] = 1
            top += 1
            start[top], length[top], visited[top] = lo, half, 0
        elif visited[top] == 1:
            visited[top] = 2
            top += 1
            start[top], length[top], visited[top] = lo + half, k - half, 0
        else:
            done -= 1
            partial[done - 1] = partial[done - 1] + partial[done]
            top -= 1
    return 0.0 + partial[0]
