"""Reference jobs (itemsim.RefJob) as a silod trace CSV, so the same jobs run through
`silod simulate`. Curriculum columns are empty for epoch readers; `item_size` is the dataset's
bytes / `items` (the reference's item count), which only curriculum jobs use."""

from __future__ import annotations


def trace_csv(jobs, datasets: dict, items: int) -> str:
    rows = ["job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,access,starting_percent,alpha,step,batch,item_size"]
    for j in jobs:
        access = "curriculum," + ",".join(str(v) for v in j.curriculum) if j.curriculum else ",,,,"
        rows.append(f"{j.job_id},{j.submit},{j.gpus},m,{j.dataset},{datasets[j.dataset]:.0f},{j.ideal:.0f},{j.epochs},{access},"
                    f"{datasets[j.dataset] / items:.0f}")
    return "\n".join(rows) + "\n"
