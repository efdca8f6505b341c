"""The round planner's per-round choice compiled (numba): Gavel's priorities from the time each
job ran since the last allocation change, the order (priority, then deficit, then the
allocation's tie order) and the greedy fit of whole gangs. A Gavel simulation chooses ~10,000
times on ~300 candidates, and in numpy each choice was a dozen small calls (a tenth of a run).

The planner imports it on first use, so the service's scheduler loads numba only when it
plans rounds.
"""

from __future__ import annotations

import numpy as np

from policies.compiled import kernel

#: Gavel's priority for a job while no job has run since the allocation changed: its share
#: times this ("don't use inf so 2*new_priority > new_priority", scheduler.py).
UNRUN_PRIORITY = 1e9


@kernel()
def choose_gavel(since: np.ndarray, deficit: np.ndarray, share: np.ndarray, cand: np.ndarray, need: np.ndarray, least: float,
                 worker_time: float, free: float) -> np.ndarray:
    """The candidates that hold GPUs this round, as positions in `cand`, in the order taken.

    `cand`: the candidates' rows in `since`, `deficit` and `share`, in the allocation's tie
    order (share descending, then arrival); `need` their GPUs in that order. priority = share /
    (since / worker_time), share x UNRUN_PRIORITY while worker_time is 0. The order is priority
    descending, then deficit descending, then the tie order (stable sorts keep it among equal
    keys); a gang is taken if it fits, until none fits (`least`: the smallest gang)."""
    m = cand.size
    prio = np.empty(m)
    neg_deficit = np.empty(m)
    for k in range(m):
        j = cand[k]
        fraction = since[j] / worker_time if worker_time > 0 else 0.0
        prio[k] = -(share[j] / fraction if fraction > 0 else share[j] * UNRUN_PRIORITY)
        neg_deficit[k] = -deficit[j]
    by_deficit = np.argsort(neg_deficit, kind="mergesort")
    order = by_deficit[np.argsort(prio[by_deficit], kind="mergesort")]
    taken = np.empty(m, dtype=np.int64)
    n = 0
    for k in order:
        if need[k] <= free:
            taken[n] = k
            n += 1
            free -= need[k]
            if free < least:
                break  # no candidate fits any more
    return taken[:n]
