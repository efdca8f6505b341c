"""The scheduling core shared by every backend (simulator, local cluster, Kubernetes).

One round, as explicit stages (after Blox): the backend hands in an immutable Snapshot; the
policy decides an Allocation with the estimator -- inside the regular and irregular partitions
of cache and remote IO when irregular jobs are active (scheduler/core/partition.py); the validator
checks it; the round planner
turns GPU shares into the set of jobs that hold GPUs this round; the IO stage turns the
allocation into per-job remote-IO caps for the round. The backend then executes the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat

import numpy as np

from policies.autocache import SWITCH_MARGIN, allocation_score, eligible_expansions, plan_autocache, takes_filled_cache
from policies.base import Policy
from policies.stagger import stagger_holds
from policies.estimators import Estimator, VanillaEstimator
from policies.storage import max_min_share
from policies.types import Allocation, Snapshot, id_ranks, values_for
from policies.validation import validate_allocation
from scheduler.core.partition import allocate_partitioned


@dataclass(frozen=True, slots=True)
class RoundPlan:
    time: float
    allocation: Allocation
    running: tuple[str, ...]  # jobs that hold all their GPUs during this round
    cache: Mapping[str, float] | None  # bytes per dataset; None = the cache system decides
    remote_io: Mapping[str, float] | None  # bytes/s cap per running job; None = shared link
    #: CPU cores per running job this round; None = CPU not modelled (cores unconstrained)
    cpu: Mapping[str, float] | None = None

    @property
    def manages_storage(self) -> bool:
        return self.cache is not None


#: Per-job columns of the planner's ledger (see _Seconds).
_COLUMNS = ("got", "seen", "since", "deficit", "share", "got_known", "seen_known")


@dataclass(eq=False)
class _Seconds:
    """Each job's seconds as rows of arrays that persist across decisions: a job keeps its row
    from the first snapshot or round it appears in until it is forgotten, so an arrival or a
    completion costs one look-up per active job (`RoundPlanner._rows_for`), not a rebuild.

    `since` is Gavel's time run since the last allocation change (started at half a round, as
    Gavel's job_time_so_far is), `deficit` the GPU time it was owed and did not get before that,
    `share` its share in the allocation in force since then; `got` and `seen` count its whole
    life (reported as `received` and `active`)."""

    at: dict[str, int] = field(default_factory=dict)  # job id -> its row
    free: list[int] = field(default_factory=list)  # rows forgotten jobs left (zeroed)
    got: np.ndarray = field(default_factory=lambda: np.zeros(64))  # seconds holding GPUs
    seen: np.ndarray = field(default_factory=lambda: np.zeros(64))  # seconds since first seen
    since: np.ndarray = field(default_factory=lambda: np.zeros(64))  # seconds run since the last allocation change (+ offset)
    deficit: np.ndarray = field(default_factory=lambda: np.zeros(64))  # seconds owed before it
    share: np.ndarray = field(default_factory=lambda: np.zeros(64))  # share in the allocation in force
    got_known: np.ndarray = field(default_factory=lambda: np.zeros(64, dtype=bool))  # recorded as running
    seen_known: np.ndarray = field(default_factory=lambda: np.zeros(64, dtype=bool))  # recorded as active
    offset: float = 0.0  # what `since` starts at
    #: every known job's row (`all_rows`), None once a job got or left a row
    _all: np.ndarray | None = field(default=None, repr=False)

    def all_rows(self) -> np.ndarray:
        """The rows of every known job, in `at`'s order (kept until a job gets or leaves one:
        the allocation changes far more often than the jobs, and a trace with thousands of
        queued jobs paid a pass over all of them at each change)."""
        if self._all is None:
            self._all = np.fromiter(self.at.values(), dtype=np.int64, count=len(self.at))
        return self._all

    def set_shares(self, rows: np.ndarray, shares: dict[str, float]) -> None:
        """Every known job's (`rows`: all_rows) share: its value in `shares`, 0 for the others.
        By the allocation's jobs, not by the known ones: a Gavel allocation names the few dozen
        jobs it gives GPU time to, while thousands may be known."""
        self.share[rows] = 0.0
        at = self.at.get
        mine = np.fromiter(map(at, shares, repeat(-1)), dtype=np.int64, count=len(shares))
        values = np.fromiter(shares.values(), dtype=float, count=len(shares))
        known = mine >= 0
        self.share[mine[known]] = values[known]

    def rows(self, ids: Sequence[str]) -> np.ndarray:
        """The rows of `ids` (new ones get a zeroed row, unknown until recorded)."""
        rows = np.fromiter(map(self.at.get, ids, repeat(-1)), dtype=np.int64, count=len(ids))
        for i in (rows < 0).nonzero()[0].tolist():
            rows[i] = self._row_for(ids[i])
        return rows

    def _row_for(self, job_id: str) -> int:
        if self.free:
            row = self.free.pop()
        else:
            row = len(self.at)
            if row >= self.got.size:
                for name in _COLUMNS:
                    old = getattr(self, name)
                    setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
        self.at[job_id] = row
        self._all = None
        self.since[row] = self.offset
        return row

    def forget(self, job_id: str) -> None:
        row = self.at.pop(job_id, None)
        if row is not None:
            self._all = None
            for name in _COLUMNS:
                getattr(self, name)[row] = 0
            self.free.append(row)

    def known(self, values: np.ndarray, known: np.ndarray) -> dict[str, float]:
        """job id -> its value, for the jobs whose `known` flag is set."""
        rows = list(self.at.values())
        return {job_id: v for job_id, v, k in zip(self.at, values[rows].tolist(), known[rows].tolist()) if k}


@dataclass
class RoundPlanner:
    """Gavel's round-based mechanism (Narayanan et al., OSDI'20, §5; its scheduler.py at
    c4fa400): the jobs that hold GPUs in a round are taken greedily, whole gangs that fit, in
    descending priority, where

        priority_j = share_j / (time j ran since the last allocation change / time all jobs ran since)

    (share_j x 1e9 while nothing has run; 0 for a job the allocation leaves out, which does not
    run), ties broken by the deficit (GPU time owed at earlier allocations and not received:
    share_j x the time the allocation was in force - time run, summed over the allocations),
    then by share, then by arrival. An allocation change -- a decision over another set of jobs
    (an arrival or a completion: when Gavel's simulator recomputes its allocation) -- carries
    each job's lag into its deficit and starts its time-since at half a round, as Gavel's
    _reset_time_run_so_far does. A decision over the same jobs with other shares (SiloD's
    storage-driven re-decisions, the service's every round) puts the new shares in force
    without that reset: resetting at each would rank jobs by share alone every round, and a job
    whose share is a hair above another's would run every round.
    A policy that gives 0/1 shares gets exactly the jobs it chose (they fit by construction).
    """

    #: the round length; a job's time since an allocation change starts at half of it (Gavel)
    round_s: float = 360.0
    _seconds: _Seconds = field(default_factory=_Seconds)
    #: seconds all jobs ran since the last allocation change (Gavel's worker_time_so_far)
    _worker_time: float = 0.0
    _last_reset: float | None = None
    #: the allocation in force (its gpu_share, as a plain dict, to tell a change from a repeat)
    _allocation: Allocation | None = None
    _shares: dict[str, float] | None = None
    #: (snapshot, its jobs' ids, their rows) of the last snapshot seen; None after a forget
    _rows: tuple[Snapshot, tuple[str, ...], np.ndarray] | None = None
    #: (running tuple, its rows) last chosen or recorded
    _running: tuple[tuple[str, ...], np.ndarray] | None = None
    #: (snapshot, allocation, what the per-round choice derives from them alone), last chosen on
    _ranked: tuple | None = None

    def __post_init__(self) -> None:
        if not self.round_s > 0:
            raise ValueError(f"round length {self.round_s} s must be > 0")
        self._seconds.offset = self.round_s / 2

    @property
    def received(self) -> dict[str, float]:
        """Seconds each job has held GPUs (the jobs recorded as running since first seen)."""
        return self._seconds.known(self._seconds.got, self._seconds.got_known)

    @property
    def active(self) -> dict[str, float]:
        """Seconds since each job was first seen (the jobs recorded as active)."""
        return self._seconds.known(self._seconds.seen, self._seconds.seen_known)

    @property
    def deficits(self) -> dict[str, float]:
        """Each known job's deficit in GPU-time seconds (Gavel's), as of the last allocation change."""
        store = self._seconds
        return {job_id: float(store.deficit[row]) for job_id, row in store.at.items()}

    def _rows_for(self, snapshot: Snapshot) -> np.ndarray:
        """The rows of the snapshot's jobs, in its order (kept for the same snapshot, and for
        one with the same jobs: a re-decision without arrivals or completions)."""
        last = self._rows
        if last is not None and last[0] is snapshot:
            return last[2]
        cols = snapshot.job_columns()
        ids = cols.ids if cols is not None else tuple(j.job_id for j in snapshot.jobs)
        rows = last[2] if last is not None and (last[1] is ids or last[1] == ids) else self._seconds.rows(ids)
        self._rows = (snapshot, ids, rows)
        return rows

    def _take(self, allocation: Allocation, now: float) -> None:
        """Make `allocation` the one in force: over another set of jobs than the last, each
        known job's lag becomes deficit and its time since restarts (Gavel's reset); over the
        same jobs, its shares replace the last ones."""
        if allocation is self._allocation:
            return
        shares = dict(allocation.gpu_share)
        self._allocation = allocation
        if shares == self._shares:
            return
        store = self._seconds
        rows = store.all_rows()
        same_jobs = self._shares is not None and shares.keys() == self._shares.keys()
        self._shares = shares
        self._ranked = None
        if same_jobs:
            store.set_shares(rows, shares)
            return
        elapsed = now - self._last_reset if self._last_reset is not None else 0.0
        store.deficit[rows] += store.share[rows] * elapsed - (store.since[rows] - store.offset)
        store.since[rows] = store.offset
        self._worker_time = store.offset * rows.size
        store.set_shares(rows, shares)
        self._last_reset = now
        self._ranked = None

    def choose(self, snapshot: Snapshot, allocation: Allocation) -> tuple[str, ...]:
        rows = self._rows_for(snapshot)
        if not rows.size:
            return ()
        store = self._seconds
        self._take(allocation, snapshot.time)
        ranked = self._ranked
        if ranked is None or ranked[0] is not snapshot or ranked[1] is not allocation:
            share = store.share[rows]
            cand = (share > 0.0).nonzero()[0]
            # Gavel's last key is its job ids, given in arrival order: (submit time, id) here
            cols = snapshot.job_columns()
            if cols is not None:
                submit = cols.submit[cand] if cols.submit is not None else np.fromiter((cols.jobs[i].submit_time for i in cand.tolist()),
                                                                                        dtype=float, count=cand.size)
                id_rank = cols.id_rank[cand] if cols.id_rank is not None else id_ranks([cols.ids[i] for i in cand.tolist()])
                gpus = cols.gpus[cand].astype(float)
                ids = cols.ids
            else:
                jobs = snapshot.jobs
                submit = np.fromiter((jobs[i].submit_time for i in cand.tolist()), dtype=float, count=cand.size)
                id_rank = id_ranks([jobs[i].job_id for i in cand.tolist()])
                gpus = np.fromiter((jobs[i].gpus for i in cand.tolist()), dtype=float, count=cand.size)
                ids = tuple(j.job_id for j in jobs)
            # The candidates in the order of the keys below priority and deficit (share, then
            # arrival), which the per-round stable sorts keep among equal keys.
            tie = np.lexsort((id_rank, submit, -share[cand]))
            order = cand[tie]
            need = gpus[tie]
            self._ranked = ranked = (snapshot, allocation, rows[order], need, float(need.min(initial=np.inf)),
                                     list(map(ids.__getitem__, order.tolist())))
        _, _, cand_rows, need, least, ids = ranked
        if not ids:
            return ()
        taken = _kernel().choose_gavel(store.since, store.deficit, store.share, cand_rows, need, least, self._worker_time,
                                       float(snapshot.capacity.gpus))
        chosen = tuple(map(ids.__getitem__, taken.tolist()))
        self._running = (chosen, cand_rows[taken])  # what record will be handed
        return chosen

    def record(self, snapshot: Snapshot, running: tuple[str, ...], seconds: float) -> None:
        rows = self._rows_for(snapshot)
        store = self._seconds
        store.seen[rows] += seconds
        store.seen_known[rows] = True
        last = self._running
        if last is None or last[0] is not running:
            # (a job may run that the snapshot does not hold: it gets a row of its own)
            self._running = last = (running, store.rows(running))
        store.got[last[1]] += seconds
        store.got_known[last[1]] = True
        store.since[last[1]] += seconds
        self._worker_time += seconds * len(running)

    def forget(self, job_id: str) -> None:
        """As if the job had never been seen: 0 s, unknown until recorded again. (The time it
        ran since the last allocation change stays in all jobs' total, as in Gavel.)"""
        self._seconds.forget(job_id)
        self._rows = self._running = self._ranked = None  # (their rows may be given to new jobs)


def _kernel():
    """scheduler.core.planner_kernel, imported on first use (numba loads only where the column
    path runs: the simulator)."""
    from scheduler.core import planner_kernel

    return planner_kernel


def io_caps_for_round(allocation: Allocation, running: tuple[str, ...], total_io: float) -> dict[str, float] | None:
    """Per-job remote-IO caps while running this round.

    Time-shared allocations are averages: the jobs that happen to run together may ask for more
    than the link has, so caps are scaled down to fit.
    """
    if allocation.remote_io is None:
        return None
    caps = np.fromiter(map(allocation.remote_io.get, running, repeat(0.0)), dtype=float, count=len(running))
    total = float(caps.sum())
    if total > total_io > 0:
        caps *= total_io / total
    return dict(zip(running, caps.tolist(), strict=True))


def cpu_for_round(allocation: Allocation, running: tuple[str, ...], total_cpus: float) -> dict[str, float] | None:
    """Per-job cores while running this round, scaled down to fit the cluster when the jobs
    that happen to run together (time sharing) ask for more than it has, as IO caps are."""
    if allocation.cpu is None:
        return None
    cores = np.array([allocation.cpu.get(j, 0.0) for j in running], dtype=float)
    total = float(cores.sum())
    if total > total_cpus > 0:
        cores *= total_cpus / total
    return dict(zip(running, cores.tolist(), strict=True))


def with_default_cpu(snapshot: Snapshot, allocation: Allocation) -> Allocation:
    """A policy (e.g. a plug-in) that leaves CPU unallocated on a cluster that models it gets
    the baseline, GPU-proportional cores for the jobs it gives GPUs."""
    cap = snapshot.capacity
    if not cap.manages_cpu or allocation.cpu is not None:
        return allocation
    cpu = {j.job_id: cap.gpu_proportional_cpu(j.gpus) if allocation.gpu_share.get(j.job_id, 0.0) > 0 else 0.0 for j in snapshot.jobs}
    return replace(allocation, cpu=cpu)


def with_autocache_sizes(snapshot: Snapshot, autocache: Mapping[str, float]) -> Snapshot:
    """The snapshot a policy plans on: datasets cached preprocessed (autocaching) appear with
    the bytes they take in cache, e x their size."""
    grown = {n: replace(d, size=d.size * autocache[n]) for n, d in snapshot.datasets.items() if autocache.get(n, 1.0) != 1.0}
    return replace(snapshot, datasets={**snapshot.datasets, **grown}) if grown else snapshot


def spread_spare_io(caps: Mapping[str, float], demands: Mapping[str, float], total_io: float) -> dict[str, float]:
    """Work conservation: IO the allocation leaves unused goes, max-min fair, to jobs that could
    use more than their cap right now (e.g. while their cache is still warming up)."""
    ids = list(caps)
    base = np.array([caps[j] for j in ids], dtype=float)
    extra_want = np.maximum(np.array([demands.get(j, 0.0) for j in ids], dtype=float) - base, 0.0)
    spare = total_io - float(base.sum())
    if spare <= 0 or not extra_want.any():
        return dict(caps)
    return dict(zip(ids, (base + max_min_share(extra_want, spare)).tolist(), strict=True))


def priority_order(snapshot: Snapshot) -> Snapshot:
    """The priority rule: policies see every job of a higher `priority` as having arrived before
    every job of a lower one (arrival order is kept within a priority). FIFO and greedy hence
    admit by priority, then arrival; SJF and Gavel order by their own objective and use arrival
    to break ties. Running jobs are not preempted for priority by policies that never preempt.
    Without priorities (all equal) the snapshot is returned unchanged."""
    if len({j.priority for j in snapshot.jobs}) <= 1:
        return snapshot
    order = sorted(snapshot.jobs, key=lambda j: (-j.priority, j.submit_time, j.job_id))
    rank = {j.job_id: float(i) for i, j in enumerate(order)}
    jobs = tuple(replace(j, submit_time=rank[j.job_id]) for j in snapshot.jobs)
    return replace(snapshot, jobs=jobs)


class SchedulingCore:
    """Policy + estimators + round planner. Pure: backends own clocks, I/O and state.

    `estimator` plans regular jobs; `irregular_estimator` (default: the storage-unaware one)
    is what the policy gets for irregular jobs inside their partition.
    """

    def __init__(self, policy: Policy, estimator: Estimator, irregular_estimator: Estimator | None = None, stagger: bool = False,
                 round_s: float = 360.0):
        self.policy = policy
        #: staggered starts for jobs sharing a dataset (policies/stagger.py); off by default
        self.stagger = stagger
        #: when a held job's predicted start comes (backends decide again then); None: none held
        self.stagger_recheck_at: float | None = None
        self.stagger_held: dict[str, float] = {}  # job id -> seconds it was told to wait, last decision
        self.estimator = estimator
        self.irregular_estimator = irregular_estimator if irregular_estimator is not None else VanillaEstimator()
        self.planner = RoundPlanner(round_s=round_s)
        #: datasets cached preprocessed (autocaching) -> expansion, as the last decision left them
        self.autocache: dict[str, float] = {}

    def decide(self, snapshot: Snapshot) -> Allocation:
        """Ask the policy (around the partitions, when irregular jobs are active), refuse any
        allocation that breaks a capacity, then choose each dataset's cache mode (autocaching)."""
        # A dataset cached preprocessed takes e x its bytes in cache: the policy plans it at that
        # size (its hit ratio is c / (e d)). Each dataset's readers prefer a mode for the cache
        # they were given (Cachew's comparison, plan_autocache); a change is then planned again
        # at the new sizes and kept only if the whole cluster gains (allocation_score): a dataset
        # whose decoded copy takes cache from other jobs must pay for it.
        # (A dataset a reader without the same autocache point now reads goes back to source.)
        eligible = eligible_expansions(snapshot)
        cols = snapshot.job_columns()
        read = set(cols.datasets) if cols is not None else {j.dataset for j in snapshot.jobs}
        modes = {n: e for n, e in self.autocache.items() if n in snapshot.datasets and (eligible.get(n) == e or n not in read)}
        allocation = self._allocate(snapshot, modes)
        chosen = plan_autocache(snapshot, allocation, modes) if eligible else {}  # (it finds none eligible either)
        active = read
        if (modes or chosen) and any(modes.get(n, 1.0) != chosen.get(n, 1.0) for n in active):
            trial = self._allocate(snapshot, chosen)
            switching = {n for n in active if modes.get(n, 1.0) != chosen.get(n, 1.0)}
            # A change must not take cache other datasets already hold (tolerance: 1 MB of
            # rounding): those bytes are lost at once and refilled over the shared link, while
            # the new copy fills over hours; allocation_score compares filled caches only.
            if (takes_filled_cache(snapshot, allocation, trial, switching) <= 1e6
                    and allocation_score(snapshot, trial, chosen) > allocation_score(snapshot, allocation, modes) + SWITCH_MARGIN):
                allocation = trial
            else:
                chosen = {n: e for n, e in modes.items() if n in active}
        else:
            chosen = {n: e for n, e in chosen.items() if n in active}
        self.autocache = {**{n: e for n, e in self.autocache.items() if n not in read}, **chosen}
        allocation = replace(allocation, autocache=chosen) if chosen else allocation
        if self.stagger:
            allocation = self._hold_staggered(snapshot, allocation)
        return allocation

    def _allocate(self, snapshot: Snapshot, modes: Mapping[str, float]) -> Allocation:
        seen = with_autocache_sizes(snapshot, modes)
        allocation = allocate_partitioned(seen, self.policy, self.estimator, self.irregular_estimator)
        return validate_allocation(seen, with_default_cpu(seen, allocation))

    def _hold_staggered(self, snapshot: Snapshot, allocation: Allocation) -> Allocation:
        """Jobs whose staggered start is still ahead get no GPUs (nor cores, nor IO) now."""
        holds = stagger_holds(snapshot, allocation)
        self.stagger_held = holds
        self.stagger_recheck_at = snapshot.time + min(holds.values()) if holds else None
        if not holds:
            return allocation

        def drop(m):
            return None if m is None else {j: (0.0 if j in holds else v) for j, v in m.items()}

        return replace(allocation, gpu_share=drop(allocation.gpu_share), remote_io=drop(allocation.remote_io), cpu=drop(allocation.cpu))

    def plan_round(self, snapshot: Snapshot, allocation: Allocation) -> RoundPlan:
        """Who holds GPUs this round, and their IO caps, for an allocation already decided."""
        running = self.planner.choose(snapshot, allocation)
        return RoundPlan(
            time=snapshot.time,
            allocation=allocation,
            running=running,
            cache=allocation.cache,  # (read-only: an Allocation holds its own copy behind a proxy)
            remote_io=io_caps_for_round(allocation, running, snapshot.capacity.remote_io),
            cpu=cpu_for_round(allocation, running, snapshot.capacity.cpus),
        )

    def plan(self, snapshot: Snapshot) -> RoundPlan:
        """decide + plan_round, for backends that re-decide every round."""
        snapshot = priority_order(snapshot)
        return self.plan_round(snapshot, self.decide(snapshot))

    def record(self, snapshot: Snapshot, plan: RoundPlan, seconds: float) -> None:
        self.planner.record(snapshot, plan.running, seconds)

    def forget(self, job_id: str) -> None:
        self.planner.forget(job_id)
