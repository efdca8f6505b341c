"""Measured, self-correcting f* (Cachew's lesson: declared profiles are starting points).

A user declares f*; what the job really reads is measured by the data plane (bytes read per
job, trusted: the node agents count them, the job cannot). Each interval a job runs, silod knows
its observed rate X and what the model says its IO and CPU allowed (b / (1 - h), k r):

- X clearly below both bounds: neither IO nor CPU held it back, so its GPUs did: X is a sample
  of f* itself;
- X at an IO or CPU bound: f* is at least X, nothing more is known.

The estimate is the time-weighted mean of the samples, with evidence older than `horizon_s`
fading (so a job that changes phase is followed), and always within
[declared / floor_factor, declared x bound_factor] (floor_factor defaults to bound_factor): a
measurement can correct a wrong declaration, but a job that stalls on purpose cannot talk the
scheduler into believing an arbitrarily small (or large) f*. Before any sample the estimate is
the declared value.

The service's f* has no floor (`JobMeasurement.start`: floor_factor = inf; issue 47): a floor
at declared / 4 protected the declarer, so a 100x overstatement stayed a 25x one after any
evidence. Without it, the measurement replaces an overstated declaration and a tenant can only
lose by lying (a lower f* never earns a job more under any policy: SJF ranks it longer, Gavel
and the cache rule give it less). The per-core CPU rate keeps its floor: a lower per-core rate
*would* earn a job more cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

#: Observed below this share of the tightest non-GPU bound counts as GPU-bound.
NOT_BOUND_SLACK = 0.97


@dataclass(frozen=True, slots=True)
class FStarEstimate:
    declared: float  # bytes/s, what the user said
    estimate: float  # bytes/s, what silod uses now
    evidence_s: float = 0.0  # seconds of GPU-bound samples behind `estimate`
    bound_factor: float = 4.0
    horizon_s: float = 1800.0
    floor_factor: float | None = None  # None: bound_factor; inf: no floor


    def __post_init__(self) -> None:
        if not (self.declared > 0 and math.isfinite(self.declared)):
            raise ValueError(f"declared f* {self.declared!r} must be a positive rate")
        if not self.bound_factor >= 1:
            raise ValueError(f"bound_factor {self.bound_factor!r} must be >= 1")
        if self.floor_factor is not None and not self.floor_factor >= 1:
            raise ValueError(f"floor_factor {self.floor_factor!r} must be >= 1 (inf: no floor)")

    @classmethod
    def start(cls, declared: float, **kw) -> FStarEstimate:
        return cls(declared, declared, **kw)

    def clip(self, value: float) -> float:
        floor = self.declared / (self.bound_factor if self.floor_factor is None else self.floor_factor)
        return min(max(value, floor), self.declared * self.bound_factor)


def observe(state: FStarEstimate, observed: float, seconds: float, io_bound: float = math.inf, cpu_bound: float = math.inf) -> FStarEstimate:
    """The estimate after `seconds` of running at `observed` bytes/s with the model's IO and CPU
    bounds for the interval (inf: not bounded)."""
    if seconds <= 0 or not math.isfinite(observed) or observed < 0:
        return state
    if observed < NOT_BOUND_SLACK * min(io_bound, cpu_bound):
        # A GPU-bound sample: fold it in, older evidence capped at the horizon.
        prior = min(state.evidence_s, state.horizon_s)
        mean = (state.estimate * prior + observed * seconds) / (prior + seconds) if state.evidence_s > 0 else observed
        return replace(state, estimate=state.clip(mean), evidence_s=prior + seconds)
    if observed > state.estimate:
        # Bound by IO or CPU and still faster than believed: f* is at least this.
        return replace(state, estimate=state.clip(observed))
    return state


__all__ = ["FStarEstimate", "NOT_BOUND_SLACK", "observe"]


# --- both parameters, with the data plane's and the client's evidence (the service; issue 22) ---

#: The service's measured f* has no floor under the declaration (see the module's docstring).
SERVICE_FSTAR_FLOOR = math.inf

#: A client's step time says the GPUs could go faster than the job reads when the read rate is
#: below this share of the client's f* (wider than NOT_BOUND_SLACK: client reports are noisier).
CLIENT_SLACK = 0.9


def _sample(state: FStarEstimate, value: float, seconds: float) -> FStarEstimate:
    """Fold `seconds` of a direct sample `value` in, older evidence capped at the horizon."""
    prior = min(state.evidence_s, state.horizon_s)
    mean = (state.estimate * prior + value * seconds) / (prior + seconds) if state.evidence_s > 0 else value
    return replace(state, estimate=state.clip(mean), evidence_s=prior + seconds)


def _at_least(state: FStarEstimate, value: float) -> FStarEstimate:
    return replace(state, estimate=state.clip(value)) if value > state.estimate else state


@dataclass(frozen=True, slots=True)
class JobMeasurement:
    """A running job's measured parameters: f* and (for a job with a declared CPU stage) the
    per-core preprocessing rate, each a declared starting point corrected by evidence.

    `max_observed` is the highest read rate the data plane measured for the job: what a client
    report may claim is capped there. `best_per_core` is the highest read rate per held core:
    samples never take the per-core rate below it (a job that is really GPU-bound but says it
    waits on its pipeline reads no faster with more cores, so its rate per core would fall with
    every core it is given; the floor stops that from earning it more). `bound` is what held the job back in the last interval
    ('gpu', 'cpu', 'remote_io', or 'unknown' when the evidence cannot tell)."""

    fstar: FStarEstimate
    cpu: FStarEstimate | None = None
    max_observed: float = 0.0
    bound: str = ""
    best_per_core: float = 0.0  # highest read rate per held core the data plane measured

    @classmethod
    def start(cls, declared_fstar: float, declared_cpu_rate: float | None = None) -> JobMeasurement:
        cpu = None if declared_cpu_rate is None else FStarEstimate.start(declared_cpu_rate)
        return cls(FStarEstimate.start(declared_fstar, floor_factor=SERVICE_FSTAR_FLOOR), cpu)

    def used_fstar(self, client_fstar: float | None = None, observed: float | None = None) -> float:
        """The f* planning uses: the data plane's estimate, lowered (never raised) by the client's
        word: a client can only make its own job look slower than measured, which gains it
        nothing (it gets fewer resources). No floor at declared / 4; but not below `observed`,
        the rate the data plane measured it reading at in its last interval: a job consumes at
        least what it reads, so a lower word is contradicted (a step-time report taken over a
        slow second of a loaded machine dragged a real job's planned f* to half its speed)."""
        return used_fstar(self.fstar, client_fstar, observed)


def used_fstar(fstar: FStarEstimate, client_fstar: float | None, observed: float | None = None) -> float:
    """JobMeasurement.used_fstar on an estimate (the service's round path has no JobMeasurement)."""
    if client_fstar is None or not math.isfinite(client_fstar) or client_fstar <= 0:
        return fstar.estimate
    if observed is not None and math.isfinite(observed) and observed > client_fstar:
        client_fstar = observed
    return min(fstar.estimate, fstar.clip(client_fstar))


def compute_rate(observed: float, loader_cost: float) -> float:
    """f* from a rate the GPU stage read at with the loader's miss term: observed = 1 / (1/f* +
    loader_cost) (estimator.loader_perf, loader_cost = (1 - h)/m seconds per byte), so f* =
    1 / (1/observed - loader_cost); inf when the term alone would be slower than what was read
    (the measured miss time overstates what the misses cost: nothing to learn but f* >= observed)."""
    if loader_cost <= 0 or not math.isfinite(loader_cost):
        return observed
    left = 1.0 / observed - loader_cost
    return 1.0 / left if left > 0 else math.inf


def observe_job(m: JobMeasurement, observed: float, seconds: float, io_bound: float = math.inf,
                cores: float = math.inf, client_fstar: float | None = None, loader_cost: float = 0.0) -> JobMeasurement:
    """The measurement after `seconds` of reading at `observed` bytes/s (the data plane's figure)
    with the model's IO bound b / (1 - h) and `cores` for the interval; `client_fstar` is the
    rate the job's own step time says its GPUs consume (batch bytes / step seconds), if reported.

    Operational analysis, one interval at a time (Plumber's rule: a pipeline runs at its
    slowest stage):
    - read at the IO bound: IO held it; f* and the CPU rate are at least what was read;
    - read at the CPU bound (cores x rate): the CPU held it; f* at least the read rate, and the
      per-core rate at least read / cores;
    - below both, and below the client's f* (capped at the highest rate the data plane ever
      measured): the GPUs could go faster and IO could deliver more, so the CPU held it: the
      read rate over the cores is a sample of the per-core rate;
    - below both, no client report, and the job has a CPU stage on limited cores: a slow GPU
      and a slow pipeline look the same; nothing is learnt (a guess would feed on itself: a
      lower f* gets fewer cores, which reads slower again);
    - otherwise (no CPU stage, or cores unlimited): only the GPUs held it: a sample of f*.

    `loader_cost`: the seconds per byte the job's loader spent on this interval's misses, (1 - h)/m
    (a job that declared its loader; 0: the paper's model). A GPU-held interval's rate is then
    1 / (1/f* + loader_cost), and its sample of f* is `compute_rate` of it: the diagnosis adds the
    term back at whatever hit ratio the job has, so f* must not carry it twice.
    """
    if seconds <= 0 or not math.isfinite(observed) or observed < 0:
        return m
    max_observed = max(m.max_observed, observed)
    has_cpu = m.cpu is not None and math.isfinite(cores) and cores > 0
    best = max(m.best_per_core, observed / cores) if has_cpu else m.best_per_core
    cpu_bound = cores * m.cpu.estimate if has_cpu else math.inf
    fs, cpu = m.fstar, m.cpu
    if observed >= NOT_BOUND_SLACK * io_bound:
        bound = "remote_io"
        fs = _at_least(fs, observed)
        if has_cpu:
            cpu = _at_least(cpu, observed / cores)
    elif observed >= NOT_BOUND_SLACK * cpu_bound:
        bound = "cpu"
        fs = _at_least(fs, observed)
        cpu = _at_least(cpu, observed / cores)
    elif has_cpu and client_fstar is not None and observed < CLIENT_SLACK * min(client_fstar, max_observed):
        bound = "cpu"
        cpu = _sample(cpu, observed / cores, seconds)
        if cpu.estimate < best:
            cpu = replace(cpu, estimate=cpu.clip(best))
    elif has_cpu and client_fstar is not None:
        bound = "gpu"  # the client's step time says the GPUs run at about this rate
        fs = _gpu_sample(fs, observed, seconds, loader_cost)
    elif has_cpu:
        bound = "unknown"
    else:
        bound = "gpu"
        fs = _gpu_sample(fs, observed, seconds, loader_cost)
    return JobMeasurement(fs, cpu, max_observed, bound, best)


def _gpu_sample(fs: FStarEstimate, observed: float, seconds: float, loader_cost: float) -> FStarEstimate:
    rate = compute_rate(observed, loader_cost) if observed > 0 else observed
    return _sample(fs, rate, seconds) if math.isfinite(rate) else _at_least(fs, observed)


__all__ += ["CLIENT_SLACK", "SERVICE_FSTAR_FLOOR", "JobMeasurement", "compute_rate", "observe_job", "used_fstar"]
