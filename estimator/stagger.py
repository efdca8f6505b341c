"""Cache-aware staggering (Assogba, Nicolae, Rafique, HiPC'23): the paper's performance model of
two co-located jobs A and B that read one dataset in the same order (one shuffling seed) from a
node cache that starts cold, B started t_B after A; and its search for the stagger that
minimises the makespan. Pure functions on seconds.

Parameters per job (measured by short micro-benchmarks in the paper, §V-B): I, the training time
of an iteration; W, the I/O wait per iteration reading remote data alone; W_cached, reading from
the cache; W_conc, reading remote data while the other job does too. N_E iterations per epoch,
E epochs. A cold iteration of A takes W_A + I_A; B reads what A cached at W_B|cached + I_B.

If B is faster on cached data than A on remote data, it catches up with A at (Eq. 1)

    t_C = t_B / (1 - (W_B|cached + I_B) / (W_A + I_A)),   N = t_C / (W_A + I_A) iterations in,

after which both read remote data concurrently for the rest of the first epoch (Eq. 2):

    T_A1 = t_C + (N_E - N)(W_A|conc + I_A),   T_B1 = t_C - t_B + (N_E - N)(W_B|conc + I_B),

and every later epoch from the cache (Eq. 3): T_X = T_X1 + (E_X - 1) N_E (W_X|cached + I_X).
The makespan is M = max(T_A, t_B + T_B) (Eq. 4). The paper's state machine covers the other
cases, which this module writes out: B never catches up (it is not faster on cached data, or A
finishes its first epoch first): A runs alone, B reads A's cache all along; and t_B at or past
A's first epoch.

Why the optimum lies inside (0, A's runtime): at t_B = 0 both pay W_conc for the whole first
epoch; a small stagger lets B read cached data until it catches up, then both pay W_conc for
less; past the point where B just catches up at the end of A's first epoch, each more second of
stagger adds a second to B's end. W_conc > W (the two jobs competing for the link, and fetching
the same items twice because neither waits for the other's fetch in flight) is what makes a
simultaneous start lose; with W_conc = W it would not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StaggerJob:
    """One job of the pair, in seconds per iteration (see the module docstring)."""

    iteration: float  # I
    wait: float  # W: remote data, alone
    wait_cached: float  # W|cached
    wait_conc: float  # W|conc: remote data, both jobs reading it
    epochs: float  # E

    def __post_init__(self) -> None:
        for name in ("iteration", "wait", "wait_cached", "wait_conc", "epochs"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} = {v!r} must be a finite number >= 0")
        if self.iteration + self.wait_cached <= 0:
            raise ValueError("an iteration must take some time (iteration + wait_cached > 0)")


@dataclass(frozen=True, slots=True)
class PairTimes:
    total_a: float  # T_A, from A's start
    total_b: float  # T_B, from B's start
    stagger: float  # t_B
    caught_up_at: float | None  # t_C, None when B never catches up with A

    @property
    def makespan(self) -> float:
        return max(self.total_a, self.stagger + self.total_b)


def pair_times(a: StaggerJob, b: StaggerJob, iterations: float, stagger: float) -> PairTimes:
    """Eqs. 1-4 with the state machine's cases, for B started `stagger` seconds after A."""
    if not (iterations > 0 and stagger >= 0):
        raise ValueError("iterations must be > 0 and stagger >= 0")
    n = iterations
    cold_a, cached_a = a.wait + a.iteration, a.wait_cached + a.iteration
    cold_b, cached_b = b.wait + b.iteration, b.wait_cached + b.iteration
    alone_a = n * cold_a + (a.epochs - 1) * n * cached_a
    later_b = (b.epochs - 1) * n * cached_b
    first_a = n * cold_a  # A's first epoch alone
    if stagger >= first_a:
        return PairTimes(alone_a, b.epochs * n * cached_b, stagger, None)  # A cached it all first
    if stagger == 0:
        # Simultaneous start: both read remote data together for the whole first epoch.
        t_a1 = n * (a.wait_conc + a.iteration)
        t_b1 = n * (b.wait_conc + b.iteration)
        return PairTimes(t_a1 + (a.epochs - 1) * n * cached_a, t_b1 + later_b, 0.0, 0.0)
    if cached_b >= cold_a:
        return PairTimes(alone_a, b.epochs * n * cached_b, stagger, None)  # B never catches up
    t_c = stagger / (1.0 - cached_b / cold_a)  # Eq. 1
    if t_c >= first_a:
        return PairTimes(alone_a, b.epochs * n * cached_b, stagger, None)  # catches up after A's epoch 1
    done = t_c / cold_a
    t_a1 = t_c + (n - done) * (a.wait_conc + a.iteration)  # Eq. 2
    t_b1 = t_c - stagger + (n - done) * (b.wait_conc + b.iteration)
    return PairTimes(t_a1 + (a.epochs - 1) * n * cached_a, t_b1 + later_b, stagger, t_c)


def makespan(a: StaggerJob, b: StaggerJob, iterations: float, stagger: float) -> float:
    return pair_times(a, b, iterations, stagger).makespan


def optimal_stagger(a: StaggerJob, b: StaggerJob, iterations: float, low: float = 0.0, high: float | None = None,
                    tolerance: float = 1e-3) -> tuple[float, float]:
    """The paper's search (§V-B): halve [low, high] (default: [0, A's standalone runtime]) towards
    the side where the predicted makespan falls, until the interval is `tolerance` of the
    range; `low` > 0 is a pair whose A has already run that long. Returns (stagger, makespan); a
    simultaneous start (low) is returned unless a stagger predicts a shorter makespan."""
    if high is None:
        high = iterations * (a.wait + a.iteration) + (a.epochs - 1) * iterations * (a.wait_cached + a.iteration)
    if not 0 <= low <= high:
        raise ValueError(f"search interval [{low}, {high}] is empty")
    lo, hi = low, high
    eps = max((high - low) * tolerance, 1e-9)
    while hi - lo > eps:
        mid = 0.5 * (lo + hi)
        if makespan(a, b, iterations, mid + eps / 4) < makespan(a, b, iterations, mid):
            lo = mid  # still falling: the optimum is to the right
        else:
            hi = mid
    best = 0.5 * (lo + hi)
    candidates = [(makespan(a, b, iterations, x), x) for x in (low, best, high)]
    m, x = min(candidates, key=lambda c: (c[0], c[1]))
    return x, m


def jobs_from_rates(batch: float, ideal_a: float, ideal_b: float, link: float, epochs_a: float, epochs_b: float,
                    duplicate_fetches: bool = True) -> tuple[StaggerJob, StaggerJob]:
    """The model's parameters from rates (bytes, bytes/s), for a fluid link: an iteration of
    `batch` bytes trains in batch / f*; remote data alone arrives at the link's rate, so W =
    max(0, batch / link - I); cached data has no wait; concurrently the link is shared and, where
    neither job waits for the other's fetch in flight (`duplicate_fetches`, the paper's page-cache
    setting), each job fetches every item itself: W|conc = max(0, 2 batch / link - I). Without
    duplicate fetches the second reader is served by the first one's fetch: W|conc = W."""
    if not (batch > 0 and ideal_a > 0 and ideal_b > 0 and link > 0):
        raise ValueError("batch, f* and link must be > 0")
    out = []
    for f, e in ((ideal_a, epochs_a), (ideal_b, epochs_b)):
        i = batch / f
        w = max(0.0, batch / link - i)
        w_conc = max(0.0, (2.0 if duplicate_fetches else 1.0) * batch / link - i)
        out.append(StaggerJob(i, w, 0.0, w_conc, e))
    return out[0], out[1]


__all__ = ["PairTimes", "StaggerJob", "jobs_from_rates", "makespan", "optimal_stagger", "pair_times"]
