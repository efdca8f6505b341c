"""How a job reads its dataset: the access pattern, as typed data (SiloD §6, §7.4).

SiloDPerf (Eq. 4) assumes every item is read once per epoch in uniform random order. A job says
whether that holds with its access pattern:

- ``epoch`` (the default): the assumption holds; the job is *regular* and SiloDPerf plans it.
- ``curriculum``: items are sorted by difficulty and each iteration samples ``batch`` items
  uniformly from the first g(i) of the N items, with the exponential pacing function (Eq. 10)

      g(i) = min(starting_percent * alpha ** floor(i / step), 1) * N

  There are no epochs: easy items are read more often than hard ones.
- ``irregular``: the job only says that it breaks the assumption (any other pattern).

Jobs that are not ``epoch`` are *irregular*: the scheduling core places them in the second
partition of cache and remote IO (scheduler/core/partition.py), where the storage-unaware estimator
and an LRU cache are used instead of SiloDPerf and uniform caching.

This module is pure (no I/O) and lives in the shared kernel so that traces, policies, the
scheduler and the simulator all import one definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from numpy.typing import ArrayLike

from estimator.errors import UserError

CURRICULUM_FIELDS = ("starting_percent", "alpha", "step", "batch")
MAX_COUNT = 2**53  # step and batch: exact as floats, far beyond any real job


class AccessKind(StrEnum):
    EPOCH = "epoch"
    CURRICULUM = "curriculum"
    IRREGULAR = "irregular"


@dataclass(frozen=True, slots=True)
class CurriculumPacing:
    """The exponential pacing function of curriculum learning (Eq. 10, after Hacohen and
    Weinshall, ICML'19). Construct it through `AccessPattern.curriculum` or `parse_access` to
    get user-facing errors; the constructor checks the same rules."""

    starting_percent: float  # fraction (0, 1] of the items eligible at iteration 0
    alpha: float  # growth factor of the eligible fraction every `step` iterations
    step: int  # iterations between two growths
    batch: int  # items read per iteration

    def __post_init__(self) -> None:
        problem = _curriculum_problem(self.starting_percent, self.alpha, self.step, self.batch)
        if problem:
            raise UserError(problem)

    def fraction(self, iteration: ArrayLike) -> float | np.ndarray:
        """min(starting_percent * alpha^floor(i/step), 1): the eligible fraction of the items."""
        i = np.asarray(iteration, dtype=float)
        if np.isnan(i).any() or (i < 0).any():
            raise ValueError("iteration must be >= 0")
        grown = np.floor(i / self.step)
        # alpha^k overflows to inf for huge k, and min(inf, 1) is 1, which is the right answer.
        with np.errstate(over="ignore"):
            frac = np.minimum(self.starting_percent * np.power(self.alpha, grown), 1.0)
        return float(frac) if frac.ndim == 0 else frac

    def eligible_items(self, iteration: ArrayLike, items: int) -> int | np.ndarray:
        """g(i): how many of the `items` easiest items a batch at iteration i samples from.

        Rounded down (a partly reached item is not eligible yet), and at least 1 so that a batch
        always has something to sample.
        """
        if items < 1:
            raise ValueError(f"items = {items}; a dataset has at least one item")
        frac = np.asarray(self.fraction(iteration), dtype=float)
        # The relative nudge keeps products such as 0.1 * 10 * 1000 from flooring to 999.
        count = np.floor(frac * items * (1.0 + 1e-12))
        out = np.clip(count, 1, items).astype(np.int64)
        return int(out) if out.ndim == 0 else out

    def full_set_iteration(self) -> int:
        """The first iteration at which every item is eligible (g(i) = N)."""
        if self.starting_percent >= 1.0:
            return 0
        growths = math.ceil(math.log(1.0 / self.starting_percent) / math.log(self.alpha) - 1e-12)
        while self.starting_percent * self.alpha**growths < 1.0:  # guard the log's rounding
            growths += 1
        return growths * self.step


@dataclass(frozen=True, slots=True)
class AccessPattern:
    """A job's access pattern. `EPOCH` is the default; `curriculum` carries its pacing."""

    kind: AccessKind = AccessKind.EPOCH
    curriculum: CurriculumPacing | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", AccessKind(self.kind))
        if (self.kind == AccessKind.CURRICULUM) != (self.curriculum is not None):
            raise UserError("access: a curriculum pattern needs its pacing (starting_percent, alpha, step, batch), and only a curriculum pattern has one")

    @property
    def regular(self) -> bool:
        """True when SiloDPerf's assumption (each item once per epoch, uniformly) holds."""
        return self.kind == AccessKind.EPOCH

    @classmethod
    def epoch(cls) -> AccessPattern:
        return EPOCH

    @classmethod
    def irregular(cls) -> AccessPattern:
        return IRREGULAR

    @classmethod
    def curriculum_learning(cls, starting_percent: float, alpha: float, step: int, batch: int) -> AccessPattern:
        return cls(AccessKind.CURRICULUM, CurriculumPacing(starting_percent, alpha, step, batch))

    def fields(self) -> dict[str, float | int | str | None]:
        """Flat form, as in the trace CSV columns: access, starting_percent, alpha, step, batch."""
        c = self.curriculum
        return {
            "access": self.kind.value,
            "starting_percent": None if c is None else c.starting_percent,
            "alpha": None if c is None else c.alpha,
            "step": None if c is None else c.step,
            "batch": None if c is None else c.batch,
        }

    def __str__(self) -> str:
        c = self.curriculum
        if c is None:
            return self.kind.value
        return f"curriculum(starting_percent={c.starting_percent:g}, alpha={c.alpha:g}, step={c.step}, batch={c.batch})"


EPOCH = AccessPattern(AccessKind.EPOCH)
IRREGULAR = AccessPattern(AccessKind.IRREGULAR)


def pacing_items(iteration: ArrayLike, items: int, starting_percent: float, alpha: float, step: int) -> int | np.ndarray:
    """Eq. 10 as a plain function: g(i) = min(starting_percent * alpha^floor(i/step), 1) * N,
    rounded down and at least 1. Vectorised over `iteration`."""
    return CurriculumPacing(starting_percent, alpha, step, 1).eligible_items(iteration, items)


#: Growths of the eligible set before it is the whole dataset (Eq. 10's paces grow a handful of
#: times: 0.04 -> 1 at alpha 1.9 is 6).
MAX_GROWTHS = 1_000


def _curriculum_problem(starting_percent: float, alpha: float, step: float, batch: float) -> str | None:
    """The first rule the curriculum parameters break, as a message naming the field, or None."""
    for name, value in (("starting_percent", starting_percent), ("alpha", alpha), ("step", step), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name} = {value!r} is not a finite number"
    if not 0.0 < starting_percent <= 1.0:
        return f"starting_percent = {starting_percent!r} must be in (0, 1]: the fraction of the items eligible at the start (e.g. 0.04)"
    if alpha <= 0:
        return f"alpha = {alpha!r} must be > 1: the factor by which the eligible set grows every `step` iterations (e.g. 1.9; exactly 1 only with starting_percent = 1)"
    if alpha < 1.0 and starting_percent >= 1.0:
        return f"alpha = {alpha!r} < 1 would shrink the eligible set below the whole dataset; use alpha >= 1"
    if alpha <= 1.0 and starting_percent < 1.0:
        return (f"alpha = {alpha!r} <= 1 with starting_percent = {starting_percent!r} < 1 never reaches the whole dataset; "
                "use alpha > 1 (e.g. 1.9), or starting_percent = 1")
    if starting_percent < 1.0 and math.log(1.0 / starting_percent) / math.log(alpha) > MAX_GROWTHS:
        # The simulator steps through the set's growths one by one: 1.0000001 from 1e-6 made
        # 1.4e8 of them and `silod simulate` ran for hours. Real paces grow a handful of times.
        growths = math.log(1.0 / starting_percent) / math.log(alpha)
        return (f"alpha = {alpha!r} from starting_percent = {starting_percent!r} grows the eligible set {growths:,.0f} times "
                f"before it is the whole dataset; at most {MAX_GROWTHS:,} (raise alpha or starting_percent, e.g. alpha 1.9 from 0.04)")
    for name, value in (("step", step), ("batch", batch)):
        if value != int(value):
            return f"{name} = {value!r} must be a whole number of {'iterations' if name == 'step' else 'items'}"
        if not 1 <= value <= MAX_COUNT:
            return f"{name} = {value!r} must be >= 1 ({'iterations between two growths of the set' if name == 'step' else 'items read per iteration'})"
    return None


def parse_access(
    access: str | None,
    starting_percent: float | str | None = None,
    alpha: float | str | None = None,
    step: int | float | str | None = None,
    batch: int | float | str | None = None,
) -> AccessPattern:
    """The access pattern from its flat fields (trace CSV columns, REST body, Python callers).

    Empty or None `access` means epoch. Curriculum needs all four parameters; the other kinds
    take none. Raises UserError naming the field and the fix.
    """
    raw = {"starting_percent": starting_percent, "alpha": alpha, "step": step, "batch": batch}
    given = {k: v for k, v in raw.items() if v is not None and not (isinstance(v, str) and not v.strip())}
    text = "" if access is None else str(access).strip().lower()
    try:
        kind = AccessKind(text or AccessKind.EPOCH.value)
    except ValueError:
        raise UserError(f"access = {access!r} is not an access pattern; use one of: {', '.join(k.value for k in AccessKind)}") from None
    if kind != AccessKind.CURRICULUM:
        if given:
            raise UserError(f"{', '.join(given)} only apply to access = curriculum (this job's access is {kind.value}); remove them or set access to curriculum")
        return EPOCH if kind == AccessKind.EPOCH else IRREGULAR
    missing = [k for k in CURRICULUM_FIELDS if k not in given]
    if missing:
        raise UserError(f"access = curriculum needs {', '.join(CURRICULUM_FIELDS)}; missing: {', '.join(missing)}")
    values: dict[str, float] = {}
    for name, value in given.items():
        try:
            values[name] = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            raise UserError(f"{name} = {value!r} is not a number") from None
    problem = _curriculum_problem(values["starting_percent"], values["alpha"], values["step"], values["batch"])
    if problem:
        raise UserError(problem)
    return AccessPattern.curriculum_learning(values["starting_percent"], values["alpha"], int(values["step"]), int(values["batch"]))


__all__ = [
    "EPOCH",
    "IRREGULAR",
    "AccessKind",
    "AccessPattern",
    "CurriculumPacing",
    "pacing_items",
    "parse_access",
]
