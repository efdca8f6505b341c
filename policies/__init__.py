"""Scheduling policies: the Policy interface, the built-ins and the plug-in registry."""

from policies.base import Policy
from policies.estimators import Estimator, SiloDEstimator, VanillaEstimator
from policies.registry import available_policies, get_policy
from policies.types import Allocation, ClusterCapacity, DatasetView, JobView, Snapshot
from policies.validation import AllocationError, allocation_violations, validate_allocation

__all__ = [
    "Allocation",
    "AllocationError",
    "ClusterCapacity",
    "DatasetView",
    "Estimator",
    "JobView",
    "Policy",
    "SiloDEstimator",
    "Snapshot",
    "VanillaEstimator",
    "allocation_violations",
    "available_policies",
    "get_policy",
    "validate_allocation",
]
