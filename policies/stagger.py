"""Staggered starts for jobs sharing a dataset (cache-aware staggering, HiPC'23), an option of
the scheduling core, off by default.

When the allocation would start a job B on a dataset that a running job A is still reading for
the first time (its cache not full), the paper's model (estimator/stagger.py) predicts the
pair's makespan for starting B now or later, and its halving search finds the best start
between now and A's end; if that is later than now by more than MIN_DELAY_S, B is held (GPU
share 0) this decision, and the core asks to be asked again at the predicted start.

The model's parameters come from rates (estimator.stagger.jobs_from_rates): f* of each job, the
cluster's remote IO as the link one job reading alone gets, and A's progress through its first
epoch as the share of the dataset cached. The paper's setting -- both jobs read in the same
order, the second fetches items the first has in flight again -- is what makes a simultaneous
start cost (W|conc > W); `duplicate_fetches=False` models a data path that shares fetches in
flight, where the model never holds a job. Results are batch-size invariant (iteration counts
cancel), so the dataset is taken as STAGGER_ITEMS iterations.
"""

from __future__ import annotations

from estimator.stagger import jobs_from_rates, makespan, optimal_stagger
from policies.types import Allocation, Snapshot

#: A predicted start less than this far off is "now" (a round is 6 minutes in the simulator).
MIN_DELAY_S = 60.0
STAGGER_ITEMS = 1000


def stagger_holds(snapshot: Snapshot, allocation: Allocation, duplicate_fetches: bool = True) -> dict[str, float]:
    """Jobs the allocation would start now that the model says to start later -> seconds to wait."""
    by_dataset: dict[str, list] = {}
    for job in snapshot.jobs:
        by_dataset.setdefault(job.dataset, []).append(job)
    holds: dict[str, float] = {}
    link = snapshot.capacity.remote_io
    if link <= 0:
        return holds
    for name, jobs in by_dataset.items():
        ds = snapshot.datasets[name]
        leaders = [j for j in jobs if j.running]
        starting = [j for j in jobs if not j.running and allocation.gpu_share.get(j.job_id, 0.0) > 0]
        if not leaders or not starting:
            continue
        cached = 0.0 if ds.cached is None else min(ds.cached / ds.size, 1.0)
        if cached >= 1.0:
            continue  # nothing left to gain: the whole dataset is cached
        a = min(leaders, key=lambda j: (j.submit_time, j.job_id))
        for b in starting:
            # A has read `cached` of its first epoch; its epochs = what it has left + that.
            ja, jb = jobs_from_rates(ds.size / STAGGER_ITEMS, a.ideal_throughput, b.ideal_throughput, link,
                                     a.remaining_bytes / ds.size + cached, b.remaining_bytes / ds.size, duplicate_fetches)
            elapsed = cached * STAGGER_ITEMS * (ja.wait + ja.iteration)  # A's time into its first epoch
            best, m = optimal_stagger(ja, jb, STAGGER_ITEMS, low=elapsed)
            if best - elapsed > MIN_DELAY_S and m < makespan(ja, jb, STAGGER_ITEMS, elapsed):
                holds[b.job_id] = best - elapsed
    return holds


__all__ = ["MIN_DELAY_S", "STAGGER_ITEMS", "stagger_holds"]
