"""The input pipeline's CPU stage as a fourth resource (Plumber, Cachew), pure and numpy-vectorised.

SiloD's Eq. 4 bounds a job by its GPUs and its IO. The preprocessing stage (decode, augment)
runs on CPU cores and is a third bound; Plumber's operational analysis bounds a pipeline by its
slowest stage, each stage giving (resource x rate per unit of resource). With k cores and a
per-core rate r (source bytes/s one core turns into training input):

    PipelinePerf = min(f*, k r, b / (1 - h))                       (source caching, h = c/d)

Autocaching (Cachew): a job may cache the output of the deterministic part of its pipeline
instead of the source bytes. That output is `expansion` (e) bytes per source byte, so a cache of
c bytes holds a fraction h = c / (e d) of the items; a cached item skips the deterministic part
and costs only what remains (rate p per core, `post_cpu_rate`), an uncached one costs the whole
pipeline (rate r). The CPU time per source byte is h/p + (1-h)/r, so

    PipelinePerf = min(f*, k / (h/p + (1-h)/r), b / (1 - h))       (preprocessed, h = c/(e d))

Source caching is the special case e = 1, p = r, which is how every function here takes it:
`expansion=1` and `post_cpu_rate=None` (= cpu_rate) unless the job caches preprocessed data.

A job that is not CPU-bound has cpu_rate = inf (an empty `cpu_rate` column); then the CPU bound
is +inf whatever the cores. A cluster whose CPU is not modelled gives every job cores = inf.
Inputs are in bytes, bytes/s and cores; invalid input raises ValueError naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from estimator.errors import UserError
from estimator.model import Number, _as_array, _hit_k, _io_k, _out, hit_ratio
from estimator.units import parse_rate

#: Preprocessed data per source byte accepted at an autocache point: decoded images are ~6x
#: their JPEGs (Plumber §5.4); 1000x is a typo, not a pipeline.
MAX_EXPANSION = 1000.0

#: The names of the trace columns and REST fields (ARCHITECTURE §4), in one place.
PIPELINE_FIELDS = ("cpu_rate", "autocache_expansion", "post_cpu_rate")

#: The resources a job can be bound by, in the order `bottleneck` reports ties.
RESOURCES = ("gpu", "cpu", "cache", "remote_io")


@dataclass(frozen=True, slots=True)
class InputPipeline:
    """A job's CPU preprocessing stage (None on a job = not CPU-bound).

    cpu_rate: source bytes/s one core turns into training input (the whole pipeline).
    autocache_expansion, post_cpu_rate: the optional autocache point (Cachew) -- bytes of
    preprocessed data per source byte there, and the per-core rate of what remains after it
    (e.g. random augmentation), in source bytes/s. Both or neither.
    """

    cpu_rate: float
    autocache_expansion: float | None = None
    post_cpu_rate: float | None = None

    def __post_init__(self) -> None:
        if not (self.cpu_rate > 0 and np.isfinite(self.cpu_rate)):
            raise UserError(f"cpu_rate {self.cpu_rate!r} must be a positive rate per core, e.g. 35MB/s; leave it empty for a job that is not CPU-bound")
        if (self.autocache_expansion is None) != (self.post_cpu_rate is None):
            raise UserError("autocache_expansion and post_cpu_rate come together (the autocache point's data expansion and the "
                            "per-core rate after it); give both or neither")
        if self.autocache_expansion is not None:
            if not (0 < self.autocache_expansion <= MAX_EXPANSION):
                raise UserError(f"autocache_expansion {self.autocache_expansion!r} must be in (0, {MAX_EXPANSION:g}]: preprocessed bytes "
                                "per source byte at the autocache point, e.g. 6 for decoded images")
            if not (self.post_cpu_rate >= self.cpu_rate and np.isfinite(self.post_cpu_rate)):
                raise UserError(f"post_cpu_rate {self.post_cpu_rate!r} must be >= cpu_rate {self.cpu_rate!r}: what remains after the "
                                "autocache point cannot cost more per byte than the whole pipeline")

    @property
    def autocaches(self) -> bool:
        return self.autocache_expansion is not None


def parse_pipeline(cpu_rate: object, autocache_expansion: object = None, post_cpu_rate: object = None) -> InputPipeline | None:
    """The three optional fields as text or numbers (empty or None = absent) -> InputPipeline or
    None. Every error message starts with the field's name (the trace reader names the column)."""

    def blank(v: object) -> bool:
        return v is None or (isinstance(v, str) and not v.strip())

    if blank(cpu_rate):
        if not (blank(autocache_expansion) and blank(post_cpu_rate)):
            raise UserError("cpu_rate is empty but an autocache point is given; an autocache point needs the job's cpu_rate (per core, e.g. 35MB/s)")
        return None
    rates = []
    for name, value in (("cpu_rate", cpu_rate), ("post_cpu_rate", post_cpu_rate)):
        if blank(value):
            rates.append(None)
            continue
        rate = parse_rate(value, name)  # its UnitError names the field first
        if rate <= 0:
            raise UserError(f"{name} must be > 0 bytes/s per core (e.g. 35MB/s); leave cpu_rate empty for a job that is not CPU-bound")
        rates.append(rate)
    expansion = None
    if not blank(autocache_expansion):
        try:
            expansion = float(str(autocache_expansion))
        except ValueError:
            raise UserError(f"autocache_expansion {autocache_expansion!r} is not a number; give preprocessed bytes per source byte, e.g. 6") from None
        if not np.isfinite(expansion) or not 0 < expansion <= MAX_EXPANSION:
            raise UserError(f"autocache_expansion {expansion!r} must be in (0, {MAX_EXPANSION:g}]: preprocessed bytes per source byte, e.g. 6")
    if (expansion is None) != (rates[1] is None):
        missing = "post_cpu_rate" if rates[1] is None else "autocache_expansion"
        raise UserError(f"{missing} is empty; autocache_expansion and post_cpu_rate come together: give both or neither")
    try:
        return InputPipeline(rates[0], expansion, rates[1])
    except UserError as exc:
        text = str(exc)
        raise UserError(text if text.startswith(PIPELINE_FIELDS) else f"cpu_rate: {text}") from None


def _rates(cpu_rate: ArrayLike, post_cpu_rate: ArrayLike | None) -> tuple[np.ndarray, np.ndarray]:
    r = _as_array(cpu_rate, "cpu_rate")
    if (r <= 0).any():
        raise ValueError(f"cpu_rate must be > 0 (got {r[r <= 0].flat[0]!r}); leave it empty (inf) for a job that is not CPU-bound")
    if post_cpu_rate is None:
        return r, r
    p = _as_array(post_cpu_rate, "post_cpu_rate")
    if (p <= 0).any():
        raise ValueError(f"post_cpu_rate must be > 0 (got {p[p <= 0].flat[0]!r})")
    return r, p


def pipeline_hit_ratio(cache: ArrayLike, dataset_size: ArrayLike, expansion: ArrayLike = 1.0) -> Number:
    """Share of items served from cache: c / (e d), clipped to [0, 1] (e = 1: source caching)."""
    d = _as_array(dataset_size, "dataset_size", positive=True)
    e = _as_array(expansion, "expansion", positive=True)
    return hit_ratio(cache, e * d)  # the cache holds the preprocessed dataset, e d bytes


def _cost_k(r: np.ndarray, p: np.ndarray, h: np.ndarray) -> np.ndarray:
    """h/p + (1-h)/r on checked inputs (estimator/model.py's kernels)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(np.where(h > 0, h / p, 0.0) + np.where(h < 1, (1.0 - h) / r, 0.0), dtype=float)


def _cpu_k(k: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """k / cost, +inf where a byte costs no CPU."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(np.where(cost <= 0, np.inf, k / np.where(cost <= 0, 1.0, cost)), dtype=float)


def _perf_k(f: np.ndarray, b: np.ndarray, h: np.ndarray, k: np.ndarray, r: np.ndarray, p: np.ndarray) -> np.ndarray:
    """pipeline_perf on checked inputs, at hit ratio h (p: post_cpu_rate, r where the job
    caches source bytes)."""
    return np.minimum(np.minimum(f, _cpu_k(k, _cost_k(r, p, h))), _io_k(b, h))


def _checked_hit(c: np.ndarray, e: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e d, c / (e d) clipped): the cache holds the preprocessed dataset, e d bytes. Refuses an
    e d that underflows to 0 and a NaN ratio (an infinite cache over an infinite dataset)."""
    ed = _as_array(e * d, "dataset_size", positive=True)
    return ed, _as_array(_hit_k(c, ed), "hit")


def cpu_seconds_per_byte(cpu_rate: ArrayLike, hit: ArrayLike = 0.0, post_cpu_rate: ArrayLike | None = None) -> Number:
    """Core-seconds one source byte of training input costs: h/p + (1-h)/r (0 when not CPU-bound)."""
    r, p = _rates(cpu_rate, post_cpu_rate)
    h = np.clip(_as_array(hit, "hit"), 0.0, 1.0)
    return _out(_cost_k(r, p, h))


def cpu_perf(cores: ArrayLike, cpu_rate: ArrayLike, hit: ArrayLike = 0.0, post_cpu_rate: ArrayLike | None = None) -> Number:
    """Throughput the CPU stage allows with `cores`: k / (h/p + (1-h)/r); +inf when not CPU-bound
    (cost 0) or when cores are unconstrained (inf)."""
    k = _as_array(cores, "cores")
    return _out(_cpu_k(k, np.asarray(cpu_seconds_per_byte(cpu_rate, hit, post_cpu_rate), dtype=float)))


def cores_needed(throughput: ArrayLike, cpu_rate: ArrayLike, hit: ArrayLike = 0.0, post_cpu_rate: ArrayLike | None = None) -> Number:
    """Cores a job needs to preprocess at `throughput`: X (h/p + (1-h)/r). 0 when not CPU-bound."""
    x = _as_array(throughput, "throughput")
    cost = np.asarray(cpu_seconds_per_byte(cpu_rate, hit, post_cpu_rate), dtype=float)
    return _out(np.where(cost <= 0, 0.0, x * cost))


def pipeline_perf(
    ideal: ArrayLike,
    remote_io: ArrayLike,
    cache: ArrayLike,
    dataset_size: ArrayLike,
    cores: ArrayLike = np.inf,
    cpu_rate: ArrayLike = np.inf,
    expansion: ArrayLike = 1.0,
    post_cpu_rate: ArrayLike | None = None,
) -> Number:
    """min(f*, CPU bound, b / (1 - h)): SiloDPerf with the input pipeline's CPU stage.

    With the defaults (unconstrained cores, not CPU-bound, source caching) this is exactly
    `silod_perf` (Eq. 4)."""
    f = _as_array(ideal, "ideal")
    d = _as_array(dataset_size, "dataset_size", positive=True)
    e = _as_array(expansion, "expansion", positive=True)
    _, h = _checked_hit(_as_array(cache, "cache"), e, d)
    b = _as_array(remote_io, "remote_io")
    k = _as_array(cores, "cores")
    r, p = _rates(cpu_rate, post_cpu_rate)
    return _out(_perf_k(f, b, h, k, r, p))


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Per job: the resource that bounds it now and what one more unit of each would buy.

    speedup_* are predicted throughput ratios (new / now, >= 1): one more GPU (f* linear in the
    GPU count, as the catalog assumes), one more core, 10% more cache for its dataset, 10% more
    remote IO. `bound` is one of RESOURCES per job. When IO binds, it names the one of cache and
    remote_io whose 10% buys more (cache wins from a hit ratio of about 0.48 on; a job with no
    cache is remote_io-bound).
    """

    throughput: np.ndarray
    bound: np.ndarray  # dtype object: 'gpu' | 'cpu' | 'cache' | 'remote_io'
    speedup_gpu: np.ndarray
    speedup_cpu: np.ndarray
    speedup_cache: np.ndarray
    speedup_remote_io: np.ndarray


def diagnose(
    ideal: ArrayLike,
    gpus: ArrayLike,
    remote_io: ArrayLike,
    cache: ArrayLike,
    dataset_size: ArrayLike,
    cores: ArrayLike = np.inf,
    cpu_rate: ArrayLike = np.inf,
    expansion: ArrayLike = 1.0,
    post_cpu_rate: ArrayLike | None = None,
    miss_rate: ArrayLike = np.inf,
) -> Diagnosis:
    """Plumber's question for every job at once: which resource bounds it, and the speed-up of
    one more unit of each (a GPU, a core, +10% cache, +10% remote IO).

    `miss_rate`: the loader's miss term m (estimator.loader_miss_rate; inf: none, the paper's
    model): the GPU stage then runs at loader_perf(f*, h, m) = 1 / (1/f* + (1-h)/m). A job held
    there below f* is labelled by what relieves it, cache (fewer misses) or remote_io, as an
    IO-bound one is: "gpu" stays the label of a job at f*."""
    # Checked once here; the five evaluations below run the model's kernels on checked arrays
    # (checking them every time was 4/5 of a one-job diagnosis: 0.8 ms per GET /v1/jobs/{id}).
    f = _as_array(ideal, "ideal")
    g = _as_array(gpus, "gpus", positive=True)
    if not np.isfinite(g).all():
        raise ValueError(f"gpus = {float(g[~np.isfinite(g)].flat[0])!r} is not a GPU count; give a whole number of GPUs")
    k = _as_array(cores, "cores")
    c = _as_array(cache, "cache")
    b = _as_array(remote_io, "remote_io")
    d = _as_array(dataset_size, "dataset_size", positive=True)
    e = _as_array(expansion, "expansion", positive=True)
    m = _as_array(miss_rate, "miss_rate", positive=True)
    rate, post = _rates(cpu_rate, post_cpu_rate)
    f, g, b, c, d, k, r, e, p, m = np.broadcast_arrays(f, g, b, c, d, k, rate, e, post, m)
    ed, h = _checked_hit(c, e, d)
    loaders = bool(np.isfinite(m).any())

    def perf(f_=f, b_=b, c_=c, k_=k):
        h_ = h if c_ is c else _hit_k(c_, ed)
        if loaders:  # the loader's miss term on the GPU stage (estimator.model.loader_perf)
            f_ = 1.0 / (1.0 / f_ + (1.0 - h_) / m)
        return _perf_k(f_, b_, h_, k_, r, p)

    now = perf()
    with np.errstate(divide="ignore", invalid="ignore"):
        def ratio(x: np.ndarray) -> np.ndarray:
            return np.where(now > 0, x / np.where(now > 0, now, 1.0), np.where(x > 0, np.inf, 1.0))

        s_gpu = ratio(perf(f_=f * (g + 1.0) / g))
        s_cpu = ratio(perf(k_=k + 1.0))
        # +10% of what the job has: relative, so a job with no cache allocation gains nothing
        # from "10% more" of it and is labelled remote_io when IO binds (and a job with no link
        # cap but no cache is labelled remote_io too: +10% of its f* of link, the most it could use).
        s_cache = ratio(perf(c_=c * 1.1))
        s_io = ratio(perf(b_=np.where(b > 0, b * 1.1, 0.1 * f)))
    cpu_bound = _cpu_k(k, _cost_k(r, p, h))
    tol = 1e-9
    io_side = np.where(s_cache > s_io * (1 + tol), "cache", "remote_io")
    if loaders:
        # Held by the loader's misses, not by the link: a larger hit ratio is what relieves it
        # (also for a job with no cache yet, whose +10% of nothing buys nothing).
        held = (now < f * (1 - tol)) & (_io_k(b, h) > now * (1 + tol))
        io_side = np.where(held, "cache", io_side)
    bound = np.where(now >= f * (1 - tol), "gpu", np.where(now >= cpu_bound * (1 - tol), "cpu", io_side)).astype(object)
    return Diagnosis(now, bound, s_gpu, s_cpu, s_cache, s_io)


def autocache_gain(
    dataset_index: ArrayLike,
    n_datasets: int,
    ideal: ArrayLike,
    remote_io: ArrayLike,
    cache: ArrayLike,
    dataset_size: ArrayLike,
    cores: ArrayLike,
    cpu_rate: ArrayLike,
    expansion: ArrayLike,
    post_cpu_rate: ArrayLike,
) -> np.ndarray:
    """Per dataset: what caching the preprocessed output (the autocache point) instead of the
    source bytes gives its readers, as the sum over them of (X_pre - X_src) / f*, for the cache,
    IO and cores they hold now (Cachew's comparison of projected times, with the estimator).

    Per job arrays (index j): dataset_index k(j), f*, b, its cores and rates; per dataset (index
    k): cache c_k and size d_k. Jobs without an autocache point pass expansion 1 and
    post_cpu_rate = cpu_rate (both modes are then the same for them)."""
    k = np.asarray(dataset_index, dtype=np.int64)
    f = _as_array(ideal, "ideal")
    c = _as_array(cache, "cache")[k]
    d = _as_array(dataset_size, "dataset_size", positive=True)[k]
    src = np.asarray(pipeline_perf(f, remote_io, c, d, cores, cpu_rate), dtype=float)
    pre = np.asarray(pipeline_perf(f, remote_io, c, d, cores, cpu_rate, expansion, post_cpu_rate), dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(f > 0, (pre - src) / np.where(f > 0, f, 1.0), 0.0)
    return np.bincount(k, weights=gain, minlength=n_datasets)


def choose_autocache(
    dataset_index: ArrayLike,
    n_datasets: int,
    ideal: ArrayLike,
    remote_io: ArrayLike,
    cache: ArrayLike,
    dataset_size: ArrayLike,
    cores: ArrayLike,
    cpu_rate: ArrayLike,
    expansion: ArrayLike,
    post_cpu_rate: ArrayLike,
) -> np.ndarray:
    """Cachew's autocaching choice per dataset: True where `autocache_gain` is positive (the
    readers' summed normalised throughput is higher with preprocessed data cached); a tie keeps
    source caching (smaller, and it keeps random augmentation random across epochs)."""
    return autocache_gain(dataset_index, n_datasets, ideal, remote_io, cache, dataset_size, cores, cpu_rate,
                          expansion, post_cpu_rate) > 1e-12


__all__ = [
    "autocache_gain",
    "choose_autocache",
    "InputPipeline",
    "MAX_EXPANSION",
    "PIPELINE_FIELDS",
    "parse_pipeline",
    "RESOURCES",
    "Diagnosis",
    "cores_needed",
    "cpu_perf",
    "cpu_seconds_per_byte",
    "diagnose",
    "pipeline_hit_ratio",
    "pipeline_perf",
]
