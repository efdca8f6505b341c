"""The cache-aware staggering paper's setting (HiPC'23, §IV and §VI-A), simulated item by item.

Two jobs on one node read the same dataset in the same order (one shuffling seed, as the paper
fixes it) through the node's page cache, which holds the whole dataset and starts cold. An item
is one mini-batch. Each job's loader keeps up to `prefetch` items loaded or in flight ahead of
its GPU (DALI's prefetch queue); an item in the cache is loaded at once, any other is fetched
from the remote repository. The repository link is shared by the fetches in flight (fluid
processor sharing); a fetch costs the job's own I/O time per iteration of link time (the
paper's Table I measures it per model), and a fetch the other job has in flight is not shared:
the loader does not wait for it and fetches the item itself (what makes a simultaneous start
slow: both jobs fetch the same items, each at half the link). A fetched item enters the cache.
The GPU trains on the items in order, `iteration` seconds each.

Everything is in seconds; nothing here is fitted to the paper's Fig. 3: the figure's shape
comes out of the mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from estimator.stagger import StaggerJob


@dataclass(frozen=True, slots=True)
class PagecacheJob:
    name: str
    iteration: float  # training time per mini-batch, s (Table I)
    io: float  # link time to fetch one mini-batch alone, s (Table I: "I/O duration per iteration")
    epochs: float


@dataclass
class _State:
    job: PagecacheJob
    start: float
    total: int
    requested: int = 0  # items (over all epochs) looked up or fetched so far
    consumed: int = 0  # items trained on
    gpu_until: float | None = None
    finish: float | None = None

    def __post_init__(self) -> None:
        self.loaded: set[int] = set()
        self.inflight: dict[int, float] = {}  # item index (over all epochs) -> link seconds left


def simulate_pair(a: PagecacheJob, b: PagecacheJob | None, items: int, stagger: float = 0.0, prefetch: int = 2,
                  warm: bool = False, stop_after: int | None = None) -> dict[str, float]:
    """Finish time (from its own start) of each job; `b` None: A alone. `warm`: the cache holds
    the whole dataset from the start. `stop_after`: stop when every job trained that many items
    (the micro-benchmarks of `calibrate`)."""
    if items < 1 or prefetch < 1 or stagger < 0:
        raise ValueError("items and prefetch must be >= 1 and stagger >= 0")
    cached = [warm] * items
    states = [_State(a, 0.0, max(1, round(a.epochs * items)))]
    if b is not None:
        states.append(_State(b, stagger, max(1, round(b.epochs * items))))
    limit = stop_after
    now = 0.0
    while True:
        active = [s for s in states if s.start <= now + 1e-12 and s.finish is None]
        for s in active:
            # Loader: look items up in order while the prefetch queue has room.
            while s.requested < s.total and s.requested - s.consumed < prefetch:
                k = s.requested
                if cached[k % items]:
                    s.loaded.add(k)
                else:
                    s.inflight[k] = s.job.io  # not shared with the other job's fetch of the item
                s.requested += 1
            if s.gpu_until is None and s.consumed in s.loaded:
                s.loaded.discard(s.consumed)
                s.gpu_until = now + s.job.iteration
        fetches = sum(len(s.inflight) for s in active)
        events = [s.gpu_until for s in active if s.gpu_until is not None]
        if fetches:
            events.append(now + min(left for s in active for left in s.inflight.values()) * fetches)
        events += [s.start for s in states if s.start > now + 1e-12]
        if not events:
            break
        t = min(events)
        dt = t - now
        for s in active:
            for k in list(s.inflight):
                s.inflight[k] -= dt / fetches
                if s.inflight[k] <= 1e-12:
                    del s.inflight[k]
                    cached[k % items] = True
                    s.loaded.add(k)
            if s.gpu_until is not None and s.gpu_until <= t + 1e-12:
                s.gpu_until = None
                s.consumed += 1
                if s.consumed >= s.total or (limit is not None and s.consumed >= limit):
                    s.finish = t
        now = t
        if all(s.finish is not None for s in states):
            break
    return {s.job.name: (s.finish - s.start) if s.finish is not None else math.inf for s in states}


def calibrate(a: PagecacheJob, b: PagecacheJob, items: int, iterations: int = 100, prefetch: int = 2) -> tuple[StaggerJob, StaggerJob]:
    """The paper's calibration (§V-B, §VI-B: 100 iterations of the first epoch in each state):
    W alone on a cold cache, W|cached on a warm one, W|conc with both jobs started together on a
    cold cache; W = (time per iteration) - I."""
    out = []
    for job, other in ((a, b), (b, a)):
        def per_iteration(**kw) -> float:
            return kw.pop("t")[job.name] / iterations

        alone = per_iteration(t=simulate_pair(job, None, items, prefetch=prefetch, stop_after=iterations))
        warm = per_iteration(t=simulate_pair(job, None, items, prefetch=prefetch, warm=True, stop_after=iterations))
        both = simulate_pair(job, other, items, prefetch=prefetch, stop_after=iterations)[job.name] / iterations
        out.append(StaggerJob(job.iteration, max(alone - job.iteration, 0.0), max(warm - job.iteration, 0.0),
                              max(both - job.iteration, 0.0), job.epochs))
    return out[0], out[1]


#: The paper's Table I, set 2 (ResNet-50 then EfficientNet-B0 on TinyImageNet, batch 64): 1,560
#: iterations per epoch; I/O and training time per iteration, ms.
PAPER_ITEMS = 1560
PAPER_PAIR = (PagecacheJob("ResNet-50", 0.3036, 0.4493, 2.0), PagecacheJob("EfficientNet-B0", 0.2047, 0.5433, 2.0))

__all__ = ["PAPER_ITEMS", "PAPER_PAIR", "PagecacheJob", "calibrate", "simulate_pair"]
