"""Quota admission (scheduler/service/quota_admission.py) orders each tenant's jobs on its own; it
must hold back exactly the jobs that one pass over all jobs in the global admission order would."""

from __future__ import annotations

import random

import pytest

from policies.types import JobView
from scheduler.service.quota_admission import TenantJob, admit
from scheduler.service.types import TenantQuota


def _reference(jobs: list[TenantJob], quotas: dict[str, TenantQuota], default: TenantQuota
               ) -> tuple[list[JobView], list[JobView]]:
    """The rule as the module states it, in one pass over all jobs: running first, then priority, then submission."""
    order = sorted(range(len(jobs)),
                   key=lambda i: (not jobs[i].view.running, -jobs[i].view.priority, jobs[i].view.submit_time, i))
    gpus: dict[str, int] = {}
    count: dict[str, int] = {}
    held: set[int] = set()
    for i in order:
        job = jobs[i]
        q = quotas.get(job.owner, default)
        g, n = gpus.get(job.owner, 0) + job.view.gpus, count.get(job.owner, 0) + 1
        if (q.gpus is not None and g > q.gpus) or (q.running_jobs is not None and n > q.running_jobs):
            held.add(i)
            continue
        gpus[job.owner], count[job.owner] = g, n
    return [j.view for i, j in enumerate(jobs) if i not in held], [j.view for i, j in enumerate(jobs) if i in held]


@pytest.mark.parametrize("seed", range(30))
def test_admission_per_tenant_equals_the_global_order(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [f"t{k}" for k in range(rng.randint(1, 5))]
    jobs = [TenantJob(JobView(str(i), rng.choice([1, 2, 4, 8]), "d", 1e8, 1e9, float(rng.randint(0, 20)),
                              running=rng.random() < 0.3, priority=rng.randint(0, 2)), rng.choice(tenants))
            for i in range(rng.randint(0, 60))]
    limit = [None, 0, 4, 8, 16]
    quotas = {t: TenantQuota(gpus=rng.choice(limit), running_jobs=rng.choice([None, 0, 1, 3]))
              for t in tenants if rng.random() < 0.7}
    default = TenantQuota(gpus=rng.choice(limit), running_jobs=rng.choice([None, 2]))
    assert admit(jobs, quotas, default) == _reference(jobs, quotas, default)
