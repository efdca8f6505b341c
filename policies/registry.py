"""Find a policy by name: the built-ins and third-party plug-ins.

A plug-in is any Policy subclass published under the entry-point group `silod.policies`:

    [project.entry-points."silod.policies"]
    my-policy = "my_package.my_module:MyPolicy"
"""

from __future__ import annotations

from importlib.metadata import entry_points

from estimator.errors import UserError, resolve_name
from policies.base import Policy
from policies.estimators import Estimator, SiloDEstimator, VanillaEstimator
from policies.fifo import FifoPolicy, GreedyPolicy, StrictFifoPolicy
from policies.gavel import GavelPolicy
from policies.sjf import SjfPolicy

ENTRY_POINT_GROUP = "silod.policies"

BUILTIN_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FifoPolicy, StrictFifoPolicy, SjfPolicy, GavelPolicy, GreedyPolicy)
}


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_policies() -> list[str]:
    return sorted(set(BUILTIN_POLICIES) | set(_plugins()))


def resolve_policy_name(name: str) -> str:
    """The policy's canonical name: `FIFO` is `fifo` in every command and in the API; a typo is
    a UserError suggesting the closest name and listing them all."""
    return resolve_name("policy", name, available_policies())


def get_policy(name: str) -> Policy:
    """An instance of the policy called `name` (see resolve_policy_name)."""
    name = resolve_policy_name(name)
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]()
    plugins = _plugins()
    try:
        cls = plugins[name].load()  # type: ignore[attr-defined]
    except Exception as exc:  # a broken plug-in must not look like a silod bug
        raise UserError(f"policy plug-in {name!r} failed to load: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise UserError(f"policy plug-in {name!r} is {cls!r}, not a subclass of policies.base.Policy")
    return cls()


def estimator_for(cache_system: str) -> Estimator:
    """SiloDPerf when silod manages storage; the storage-unaware estimator for the baselines."""
    return SiloDEstimator() if cache_system == "silod" else VanillaEstimator()
