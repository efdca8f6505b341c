"""Synthetic traces following the job-duration distribution the SiloD paper uses (§7).

The paper generates its traces "following the same job duration distribution reported by
Microsoft" (Philly, Jeon et al. ATC'19), as Gavel does. We use Gavel's generator parameters:
80% of jobs last 10^U(1.5, 3) minutes and 20% last 10^U(3, 4) minutes; GPU counts are 1, 2, 4
or 8 with probabilities 0.70, 0.10, 0.15, 0.05; arrivals are Poisson. Models are drawn from the
paper's catalog (Table 4 / Fig. 6). Every job reads its own dataset copy unless
`dataset_sharing` > 0 (§7.3).
"""

from __future__ import annotations

import numpy as np

from estimator.errors import UserError
from traces.catalog import DATASETS, MODELS
from traces.model import Trace, TraceJob

GPU_CHOICES = np.array([1, 2, 4, 8])
GPU_PROBS = np.array([0.70, 0.10, 0.15, 0.05])
MODEL_MIX = {"resnet50": 0.3, "resnet152": 0.15, "efficientnetb1": 0.3, "vlad": 0.15, "bert": 0.1}


def generate_trace(
    num_jobs: int,
    *,
    mean_interarrival_s: float = 600.0,
    dataset_sharing: float = 0.0,
    seed: int = 0,
) -> Trace:
    if num_jobs < 1:
        raise UserError(f"number of jobs {num_jobs} must be >= 1")
    if mean_interarrival_s < 0:
        raise UserError("mean inter-arrival time must be >= 0 seconds")
    if not 0.0 <= dataset_sharing <= 1.0:
        raise UserError(f"dataset sharing {dataset_sharing} must be a fraction between 0 and 1")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(mean_interarrival_s, num_jobs)) if mean_interarrival_s > 0 else np.zeros(num_jobs)
    long_job = rng.random(num_jobs) < 0.2
    exponent = np.where(long_job, rng.uniform(3.0, 4.0, num_jobs), rng.uniform(1.5, 3.0, num_jobs))
    duration_s = 60.0 * 10.0**exponent
    gpus = rng.choice(GPU_CHOICES, size=num_jobs, p=GPU_PROBS)
    names = list(MODEL_MIX)
    models = rng.choice(names, size=num_jobs, p=np.array([MODEL_MIX[n] for n in names]))
    shared = rng.random(num_jobs) < dataset_sharing
    jobs, sizes = [], {}
    for i in range(num_jobs):
        spec = MODELS[str(models[i])]
        size = DATASETS[spec.dataset].size
        job_id = f"job{i:05d}"
        dataset = spec.dataset if shared[i] else f"{spec.dataset}/{job_id}"
        sizes[dataset] = size
        rate = spec.ideal_per_gpu * int(gpus[i])
        jobs.append(TraceJob(job_id, float(arrivals[i]), int(gpus[i]), spec.name, dataset, rate, duration_s[i] * rate / size))
    return Trace(tuple(jobs), sizes, source=f"synthetic(n={num_jobs}, seed={seed})")
