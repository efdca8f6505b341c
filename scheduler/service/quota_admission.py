"""Per-tenant quotas inside the scheduling round (pure: no I/O).

Before the policy runs, each tenant's active jobs are admitted in order (jobs already running
first, so a round does not preempt a tenant to admit its own newer job; then higher `priority`
first; then submission order) while the tenant's admitted GPUs stay within `gpus` and their
number within `running_jobs`. Only admitted jobs reach the policy, so whatever it decides, a
tenant never holds more than its quota; the others wait (and, if the quota was lowered while
they ran, are preempted).

After the policy, the cache of each tenant's datasets (a dataset is charged to its owner, also
when it is shared) is scaled down to the tenant's `cache_bytes` if it exceeds it.

This is also what `priority` means: it orders a tenant's own jobs for admission under its
quota. It never moves a job ahead of another tenant's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.types import JobView
from scheduler.service.types import TenantQuota


@dataclass(frozen=True, slots=True)
class TenantJob:
    view: JobView
    owner: str


def admit(jobs: Sequence[TenantJob], quotas: Mapping[str, TenantQuota], default: TenantQuota
          ) -> tuple[list[JobView], list[JobView]]:
    """(admitted, held back), each in the input order.

    A tenant's admissions depend only on its own jobs, so each tenant's jobs are ordered on their
    own (the same order as one sort of all jobs would give them), and a tenant without a GPU or
    running-jobs limit has every job admitted without ordering any (30,000 jobs each round)."""
    by_owner: dict[str, list[int]] = {}
    for i, job in enumerate(jobs):
        by_owner.setdefault(job.owner, []).append(i)
    held: set[int] = set()
    for owner, mine in by_owner.items():
        q = quotas.get(owner, default)
        if q.gpus is None and q.running_jobs is None:
            continue
        mine.sort(key=lambda i: (not jobs[i].view.running, -jobs[i].view.priority, jobs[i].view.submit_time, i))
        gpus = count = 0
        for i in mine:
            g, n = gpus + jobs[i].view.gpus, count + 1
            if (q.gpus is not None and g > q.gpus) or (q.running_jobs is not None and n > q.running_jobs):
                held.add(i)
                continue
            gpus, count = g, n
    if not held:
        return [j.view for j in jobs], []
    admitted = [j.view for i, j in enumerate(jobs) if i not in held]
    return admitted, [j.view for i, j in enumerate(jobs) if i in held]


def clamp_cache(cache: Mapping[str, float], dataset_owner: Mapping[str, str], quotas: Mapping[str, TenantQuota],
                default: TenantQuota) -> dict[str, float]:
    """Cache per dataset with each owner's total scaled down to its `cache_bytes`."""
    totals: dict[str, float] = {}
    for key, nbytes in cache.items():
        owner = dataset_owner.get(key, "")
        totals[owner] = totals.get(owner, 0.0) + float(nbytes)
    out = {}
    for key, nbytes in cache.items():
        owner = dataset_owner.get(key, "")
        limit = quotas.get(owner, default).cache_bytes
        total = totals[owner]
        out[key] = float(nbytes) * (limit / total) if (limit is not None and total > limit) else float(nbytes)
    return out
