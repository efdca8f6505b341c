"""Reference solver for SiloD-Gavel max-min fairness (Eq. 9), written as linear programs in cvxpy.

`policies.gavel.solve_max_min` solves the problem in closed form (knapsack argument, O(n log n)).
This module solves the *same* problem directly with an LP solver, so that tests can check the
closed form against an independent formulation. It is slow and only meant for tests and
benchmarks; the scheduler never calls it.

The problem (index j over jobs, k over datasets, k(j) the dataset job j reads):

    maximise   t
    subject to min(x_j f*_j, B_j / (1 - c_k(j)/d_k(j)))  >=  t ref_j     for every job j
               sum_j g_j x_j <= G,   0 <= x_j <= 1                       (GPU time)
               sum_j B_j <= B,       B_j >= 0                            (time-averaged remote IO)
               sum_k c_k <= C,       0 <= c_k <= d_k                     (cache per dataset)

where ref_j = SiloDPerf(j, R_equal). Asking for throughput *at least* t ref_j is the same as
asking for exactly t ref_j: a lower throughput never needs more of any resource. The first
constraint is two constraints, x_j f*_j >= t ref_j and B_j >= t ref_j (1 - c_k/d_k). The second is
bilinear in (t, c). Two exact ways around it are implemented:

* method="lp" (default): the perspective substitution u_k = t c_k (t > 0). Then
      B_j >= t ref_j - ref_j u_k / d_k,   0 <= u_k <= t d_k,   sum_k u_k <= t C
  are all linear in (t, x, B, u), and the problem is one LP; c_k = u_k / t afterwards. The map
  (t, c) -> (t, u) is a bijection for t > 0, so the LP has exactly the optimum of the original
  problem (t = 0 is always feasible and never better than t > 0 when any t > 0 is feasible).
* method="bisection": for a fixed t the constraint is linear in c, so "is t feasible?" is an LP
  (minimise sum_j B_j over c and B, compare with the link capacity; the GPU constraints do not
  involve c and are checked directly). Feasibility is monotone in t, so bisection converges to t*.
  Slower (one LP per step) but uses nothing but the definition.

CPU cores (when the cluster models them): variables k_j, job j's time-averaged cores, with
    k_j r_j >= t ref_j   (its pipeline preprocesses what it reads; only where r_j is finite)
    k_j <= x_j cap_j      (while it runs, at most the cores of its nodes)
    sum_j k_j <= K        (the cluster's cores; dropped for GPU-proportional CPU, where cap_j
                           is the job's GPU-proportional cores)
and ref_j is computed with the estimator's pipeline_perf at the equal share (1/n of the cores,
at most x_eq cap_j). Only method="lp" models CPU.

Units: bytes and bytes/s are rescaled to O(1) before they reach the solver (LP solvers work to an
absolute tolerance of ~1e-8) and scaled back afterwards.

Jobs whose equal-share throughput ref_j is 0 (no remote IO and an uncached dataset) put no
constraint on t (any throughput is >= 0 ref_j); when every ref_j is 0 the ratio is +inf.
"""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from estimator import pipeline_perf, silod_perf
from policies.gavel import GavelProblem, GavelSolution

#: LP solvers tried in order; the first one installed is used.
PREFERRED_SOLVERS = ("HIGHS", "CLARABEL", "SCS")


def _solver(name: str | None) -> str:
    installed = set(cp.installed_solvers())
    if name is not None:
        if name not in installed:
            raise ValueError(f"LP solver {name!r} is not installed; installed: {sorted(installed)}")
        return name
    for candidate in PREFERRED_SOLVERS:
        if candidate in installed:
            return candidate
    raise RuntimeError(f"no LP solver installed (wanted one of {PREFERRED_SOLVERS}); got {sorted(installed)}")


def reference_equal_share(p: GavelProblem) -> np.ndarray:
    """ref_j = SiloDPerf(j, R_equal), computed from the estimator rather than re-derived.

    R_equal: each job 1/n of the GPUs (a time share of its g_j GPUs, at most 1), 1/n of the
    remote IO, and each dataset the 1/n cache shares of its readers (at most its size).
    """
    n = p.n
    x_eq = np.minimum(1.0, p.total_gpus / (n * p.gpus))
    if not p.manages_storage:
        if p.cpu_rate is not None:
            cores = np.minimum(p.total_cpus / n, x_eq * p.cpu_cap)
            return np.asarray(pipeline_perf(x_eq * p.ideal, np.inf, 0.0, 1.0, cores, p.cpu_rate), dtype=float)
        return x_eq * p.ideal
    readers = np.bincount(p.dataset_index, minlength=len(p.dataset_names))
    c_eq = np.minimum(p.dataset_size, p.total_cache * readers / n)
    k = p.dataset_index
    if p.cpu_rate is not None:
        cores = np.minimum(p.total_cpus / n, x_eq * p.cpu_cap)
        return np.asarray(pipeline_perf(x_eq * p.ideal, np.full(n, p.total_io / n), c_eq[k], p.dataset_size[k], cores, p.cpu_rate), dtype=float)
    # Time-averaged: x_eq f* from the GPUs, b_eq / (1 - c/d) from the IO (Eq. 4).
    return np.asarray(silod_perf(x_eq * p.ideal, np.full(n, p.total_io / n), c_eq[k], p.dataset_size[k]), dtype=float)


class _Scaled:
    """The problem in O(1) units: rates divided by `rate`, sizes by `size`."""

    def __init__(self, p: GavelProblem, ref: np.ndarray):
        self.rate = float(max(ref.max(initial=0.0), p.total_io, 1e-300))
        self.size = float(max(p.dataset_size.max(initial=0.0), 1e-300))
        self.ref = ref / self.rate
        self.ideal = p.ideal / self.rate
        self.io = p.total_io / self.rate
        self.d = p.dataset_size / self.size
        self.cache = min(p.total_cache, float(p.dataset_size.sum())) / self.size
        # One-hot job -> dataset map (sparse: n x m with n nonzeros).
        self.member = sp.csr_matrix((np.ones(p.n), (np.arange(p.n), p.dataset_index)), shape=(p.n, len(p.dataset_names)))


def _solve(problem: cp.Problem, solver: str) -> None:
    problem.solve(solver=solver)
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
        raise RuntimeError(f"reference LP ended with status {problem.status!r}")


def _solve_lp(p: GavelProblem, s: _Scaled, solver: str) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    n, m = p.n, len(p.dataset_names)
    t = cp.Variable(nonneg=True)
    x = cp.Variable(n, nonneg=True)
    cons = [x <= 1, p.gpus @ x <= p.total_gpus, cp.multiply(s.ideal, x) >= t * s.ref]
    if p.cpu_rate is not None:
        bound = np.isfinite(p.cpu_rate)
        if bound.any():
            k = cp.Variable(int(bound.sum()), nonneg=True)  # time-averaged cores of the CPU-bound jobs
            idx = np.flatnonzero(bound)
            cons += [cp.multiply(p.cpu_rate[idx] / s.rate, k) >= t * s.ref[idx], k <= cp.multiply(p.cpu_cap[idx], x[idx])]
            if np.isfinite(p.total_cpus):
                cons.append(cp.sum(k) <= p.total_cpus)
    if p.manages_storage:
        B = cp.Variable(n, nonneg=True)
        u = cp.Variable(m, nonneg=True)  # u_k = t c_k (scaled)
        cons += [
            B >= t * s.ref - cp.multiply(s.ref / s.d[p.dataset_index], s.member @ u),
            u <= t * s.d,
            cp.sum(u) <= t * s.cache,
            cp.sum(B) <= s.io,
        ]
    _solve(cp.Problem(cp.Maximize(t), cons), solver)
    t_val = float(t.value)
    share = np.clip(np.asarray(x.value, dtype=float), 0.0, 1.0)
    if not p.manages_storage:
        return t_val, share, np.zeros(n), np.zeros(m)
    cache = np.clip(np.asarray(u.value, dtype=float) / t_val, 0.0, s.d) if t_val > 0 else np.zeros(m)
    return t_val, share, np.maximum(np.asarray(B.value, dtype=float), 0.0), cache


def _min_io_for(t: float, p: GavelProblem, s: _Scaled, solver: str) -> tuple[float, np.ndarray, np.ndarray]:
    """Least total remote IO that gives every job t ref_j, over all cache splits (an LP)."""
    n, m = p.n, len(p.dataset_names)
    B = cp.Variable(n, nonneg=True)
    c = cp.Variable(m, nonneg=True)
    target = t * s.ref
    cons = [
        B >= target - cp.multiply(target / s.d[p.dataset_index], s.member @ c),
        c <= s.d,
        cp.sum(c) <= s.cache,
    ]
    problem = cp.Problem(cp.Minimize(cp.sum(B)), cons)
    _solve(problem, solver)
    return float(problem.value), np.maximum(np.asarray(B.value, dtype=float), 0.0), np.clip(np.asarray(c.value, dtype=float), 0.0, s.d)


def _solve_bisection(p: GavelProblem, s: _Scaled, solver: str, rel_tol: float) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    n, m = p.n, len(p.dataset_names)
    pos = s.ref > 0
    # GPU constraints alone: x_j = t ref_j / f*_j <= 1 and sum_j g_j x_j <= G.
    gpu_time_per_t = float(np.sum(p.gpus[pos] * s.ref[pos] / s.ideal[pos]))
    hi = float(np.min(s.ideal[pos] / s.ref[pos]))
    if gpu_time_per_t > 0:
        hi = min(hi, p.total_gpus / gpu_time_per_t)
    lo = 0.0

    def feasible(t: float) -> bool:
        if not p.manages_storage:
            return t <= hi
        io, _, _ = _min_io_for(t, p, s, solver)
        return io <= s.io * (1 + 1e-9) + 1e-12

    if feasible(hi):
        lo = hi
    while hi - lo > rel_tol * max(hi, 1e-300):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    t_val = lo
    share = np.where(pos, t_val * s.ref / s.ideal, 0.0)
    if not p.manages_storage:
        return t_val, share, np.zeros(n), np.zeros(m)
    _, B, cache = _min_io_for(t_val, p, s, solver)
    return t_val, share, B, cache


def solve_max_min_reference(
    p: GavelProblem,
    *,
    method: str = "lp",
    solver: str | None = None,
    rel_tol: float = 1e-9,
) -> GavelSolution:
    """Max-min fairness ratio and allocation by LP (see the module docstring).

    method: "lp" (one LP after the substitution u = t c) or "bisection" (an LP per step).
    solver: a cvxpy LP solver name; default the first installed of PREFERRED_SOLVERS.
    Returns the same GavelSolution as `policies.gavel.solve_max_min`; `avg_io` is time-averaged
    and `cache` is per dataset in `p.dataset_names` order, in bytes and bytes/s.
    """
    if method not in ("lp", "bisection"):
        raise ValueError(f"unknown method {method!r}; use 'lp' or 'bisection'")
    if method == "bisection" and p.cpu_rate is not None:
        raise ValueError("method='bisection' does not model CPU cores; use method='lp' on a cluster with cpus_per_node")
    m = len(p.dataset_names)
    if p.n == 0:
        return GavelSolution(0.0, np.zeros(0), np.zeros(0), np.zeros(m), np.zeros(0))
    ref = reference_equal_share(p)
    if not (ref > 0).any():
        return GavelSolution(float("inf"), np.zeros(p.n), np.zeros(p.n), np.zeros(m), ref)
    s = _Scaled(p, ref)
    name = _solver(solver)
    if method == "lp":
        t, share, avg_io, cache = _solve_lp(p, s, name)
    else:
        t, share, avg_io, cache = _solve_bisection(p, s, name, rel_tol)
    return GavelSolution(ratio=t, share=share, avg_io=avg_io * s.rate, cache=cache * s.size, reference=ref)


__all__ = ["PREFERRED_SOLVERS", "reference_equal_share", "solve_max_min_reference"]
