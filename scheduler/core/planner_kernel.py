"""The round planner's per-round choice compiled (numba): priorities from the seconds each job
received and was active, the order (full shares first, then by lag, then by the allocation's
tie order) and the greedy fit of whole gangs. A Gavel simulation chooses ~10,000 times on
~300 candidates, and in numpy each choice was a dozen small calls (a tenth of a Gavel run).

The planner imports it on first use, only on the column path (the simulator's), so the
service's scheduler does not load numba for its choices.
"""

from __future__ import annotations

import numpy as np

from policies.compiled import kernel


@kernel()
def choose_in_tie_order(got: np.ndarray, seen: np.ndarray, cand: np.ndarray, share: np.ndarray, not_full: np.ndarray,
                        need: np.ndarray, least: float, free: float) -> np.ndarray:
    """The candidates that hold GPUs this round, as positions in `cand`, in the order taken.

    `cand`: the candidates' positions in `got` and `seen`, in the allocation's tie order (by
    share, then age, then id); `share`, `not_full` and `need` (GPUs) are per candidate in that
    order. priority = share / (got / seen), infinite for a job that has not run; the order is
    not_full, then -priority, then the tie order (a stable sort keeps it among equal
    priorities); a gang is taken if it fits, until no candidate fits (`least`: the smallest
    gang). The same floats and order as RoundPlanner's numpy form."""
    m = cand.size
    key = np.empty(m)
    for k in range(m):
        j = cand[k]
        fraction = got[j] / seen[j] if seen[j] > 0 else 0.0
        key[k] = -(np.inf if fraction <= 0 else share[k] / fraction)
    order = np.argsort(key, kind="mergesort")
    taken = np.empty(m, dtype=np.int64)
    n = 0
    for short in (False, True):  # full shares first
        for k in order:
            if not_full[k] != short:
                continue
            if need[k] <= free:
                taken[n] = k
                n += 1
                free -= need[k]
                if free < least:
                    return taken[:n]  # no candidate fits any more
    return taken[:n]
