"""How the simulator's kernels are compiled (numba): `kernel(signature)` for the ones Python
calls, `kernel()` for the helpers they call.

A kernel is compiled once and kept in numba's cache next to its module (else in the user's cache
directory), so later processes load it in milliseconds. Where neither can be written (a
read-only install and no writable home), numba refuses to cache at all; the kernel is then
compiled in memory in every process (a few seconds at import) rather than failing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba


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
    """np.minimum on two floats, inside a kernel: a NaN wins (Python's min would not say)."""
    if a != a:
        return a
    if b != b:
        return b
    return a if a <= b else b
