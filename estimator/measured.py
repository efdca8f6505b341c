"""Measured, self-correcting f* (Cachew's lesson: declared profiles are starting points).

A user declares f*; what the job really reads is measured by the data plane (bytes read per
job, trusted: the node agents count them, the job cannot). Each interval a job runs, silod knows
its observed rate X and what the model says its IO and CPU allowed (b / (1 - h), k r):

- X clearly below both bounds: neither IO nor CPU held it back, so its GPUs did: X is a sample
  of f* itself;
- X at an IO or CPU bound: f* is at least X, nothing more is known.

The estimate is the time-weighted mean of the samples, with evidence older than `horizon_s`
fading (so a job that changes phase is followed), and always within
[declared / bound_factor, declared x bound_factor]: a measurement can correct a wrong
declaration, but a job that stalls on purpose cannot talk the scheduler into believing an
arbitrarily small (or large) f*. Before any sample the estimate is the declared value.
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

    def __post_init__(self) -> None:
        if not (self.declared > 0 and math.isfinite(self.declared)):
            raise ValueError(f"declared f* {self.declared!r} must be a positive rate")
        if not self.bound_factor >= 1:
            raise ValueError(f"bound_factor {self.bound_factor!r} must be >= 1")

    @classmethod
    def start(cls, declared: float, **kw) -> FStarEstimate:
        return cls(declared, declared, **kw)

    def clip(self, value: float) -> float:
        return min(max(value, self.declared / self.bound_factor), self.declared * self.bound_factor)


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
