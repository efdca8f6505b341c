"""Performance estimators a policy is given (Algorithm 1).

`SiloDEstimator` is SiloDPerf = min(f*, b/(1-c/d)) and tells the policy to manage cache and
remote IO as resources. `VanillaEstimator` is the storage-unaware original, perf = f*, used for
the baselines where the cache system (Alluxio, CoorDL, Quiver) decides storage by itself.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from estimator import silod_perf


class Estimator(Protocol):
    name: str
    manages_storage: bool

    def throughput(self, ideal: ArrayLike, remote_io: ArrayLike, cache: ArrayLike, dataset_size: ArrayLike) -> np.ndarray | float:
        """Throughput (bytes/s) of a job running on its GPUs with the given storage allocation."""
        ...


class SiloDEstimator:
    name = "silod"
    manages_storage = True

    def throughput(self, ideal, remote_io, cache, dataset_size):
        return silod_perf(ideal, remote_io, cache, dataset_size)


class VanillaEstimator:
    name = "vanilla"
    manages_storage = False

    def throughput(self, ideal, remote_io, cache, dataset_size):
        return ideal
