"""The Policy interface every scheduling policy, built-in or plug-in, implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from policies.estimators import Estimator
from policies.types import Allocation, Snapshot


class Policy(ABC):
    """Decides GPUs per job and, when the estimator manages storage, cache per dataset and
    remote IO per job.

    Implementations must be pure: no I/O, no clocks, no randomness that is not seeded from the
    snapshot. The scheduling core validates every Allocation they return.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: True when the policy returns fractional GPU shares that the round planner time-shares.
    time_sharing: ClassVar[bool] = False

    @abstractmethod
    def allocate(self, snapshot: Snapshot, estimator: Estimator) -> Allocation:
        """Return the allocation for the jobs in `snapshot`."""
