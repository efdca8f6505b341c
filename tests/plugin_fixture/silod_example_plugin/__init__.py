"""An example silod policy plug-in: "largest cache efficiency first".

Jobs whose datasets save the most remote IO per byte of cache (f*/d, Eq. 5) get GPUs first;
cache goes by Algorithm 2 and remote IO in the same order. Published through the entry-point
group `silod.policies` (see pyproject.toml next to this package and docs/policies.md).
"""

from policies import Allocation, Estimator, Policy, Snapshot
from policies.fifo import place_in_order, running_allocation


class LargestCacheEfficiencyFirst(Policy):
    name = "largest-efficiency"
    description = "GPUs to jobs in descending cache efficiency f*/d; Algorithm 2 cache"

    def allocate(self, snapshot: Snapshot, estimator: Estimator) -> Allocation:
        def efficiency(job):
            return job.ideal_throughput / snapshot.datasets[job.dataset].size

        ranked = sorted(snapshot.jobs, key=lambda j: (-efficiency(j), j.submit_time, j.job_id))
        running = place_in_order(ranked, snapshot.capacity.gpus, keep_running=False)
        rank = {j.job_id: i for i, j in enumerate(ranked)}
        running.sort(key=lambda j: rank[j.job_id])  # IO is served in this order
        return running_allocation(running, snapshot, estimator, io_rule="priority")


class NotAPolicy:
    """Published under a policy name by mistake: the registry must refuse it."""
