"""Regenerate the recorded results of Gavel's own simulator that tests/test_gavel_parity.py
compares ours with. Not part of silod and not run by CI: it needs Gavel's code and its Python
dependencies, kept out of silod's.

How to run it (about a minute on one core):

    # 1. Gavel at the commit the parity data was made with (OSDI'20 artifact, MIT licence)
    git clone https://github.com/stanford-futuredata/gavel /tmp/gavel
    git -C /tmp/gavel checkout c4fa400
    # 2. Gavel's simulator dependencies, in a venv of their own (not silod's)
    python3 -m venv /tmp/gavel-venv
    /tmp/gavel-venv/bin/pip install numpy cvxpy ecos grpcio grpcio-tools psutil scipy scikit-learn matrix_completion
    cd /tmp/gavel/scheduler && mkdir -p runtime/rpc_stubs && for p in common enums iterator_to_scheduler \\
        scheduler_to_worker worker_to_scheduler; do /tmp/gavel-venv/bin/python -m grpc_tools.protoc \\
        -Iruntime/protobuf --python_out=runtime/rpc_stubs --grpc_python_out=runtime/rpc_stubs runtime/protobuf/$p.proto; done
    # 3. this script, with Gavel's interpreter, from the repository root
    /tmp/gavel-venv/bin/python tests/reference/gavel_parity/regenerate.py --gavel /tmp/gavel/scheduler

What it does, per case of CASES: it cuts the case's trace from traces/gavel-msr (the
first `jobs` lines whose job type has a throughput entry for their GPU count: Gavel's simulator
cannot run the others) into traces/<case>.trace (our 7-column format, which `silod simulate
--format gavel` reads), then runs Gavel's simulator on it as its driver
scheduler/scripts/drivers/simulate_scheduler_with_trace.py does (Scheduler(policy,
simulate=True, seed, time_per_iteration), simulate(cluster_spec, arrival_times, jobs,
num_gpus_per_server), get_average_jct) -- with two differences the driver cannot express: the
allocation-recompute interval (Scheduler's minimum_time_between_allocation_resets; the driver
always uses its default, 1,920 s) is set per run, and the trace is given as Job objects built from
the 7-column lines (the driver's parse_trace wants Gavel's later 10-column format; the three extra
columns are the defaults: no working directory, priority weight 1, no SLO). Results go to
results/<case>.json: per run (policy, interval) the average JCT and each job's JCT, in trace
order, read from the Scheduler's own per-job completion times. Max-min fairness runs twice per
interval: as Gavel's code is, and `corrected` (CORRECTIONS below, three patches of Scheduler
methods for that run alone), which the per-job targets are held to.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
#: the msr traces shipped with silod
SHARED = REPO / "traces" / "gavel-msr"

#: name -> (source trace, jobs kept, GPUs, longest job kept in hours alone: None = any). Small
#: enough that each of our runs takes a second or two (a run has a round per 360 s of makespan);
#: contended enough that the round mechanism decides who runs.
CASES = {
    "ed69ec-1gpu": ("ed69ec.trace", 120, 4, 24),  # every job 1 GPU (the trace's jobs of <= 24 h)
    "e13805-mixed": ("e13805.trace", 70, 16, None),  # 1-24 GPU jobs
    "2869ce-gangs": ("2869ce.trace", 60, 32, None),  # mostly 8- and 32-GPU gangs
    "51b7ef-small": ("51b7ef.trace", 18, 16, None),  # 1-, 4- and 8-GPU jobs
}
#: (Gavel policy name, allocation-recompute interval in seconds, corrected) recorded per case.
#: corrected: the same run with two departures of Gavel's simulator from its own rules taken out
#: (CORRECTIONS; docs/gavel.md, "Parity with Gavel's own simulator", shows what each moves).
RUNS = (("max_min_fairness", 0, False), ("max_min_fairness", 1920, False), ("fifo", 0, False),
        ("max_min_fairness", 0, True), ("max_min_fairness", 1920, True))
#: What a corrected run changes, as recorded in results/<case>.json:
#: 1. its allocation's shares rounded to SHARE_DIGITS significant digits: ECOS returns the equal
#:    shares of jobs alike (x_j = G / (n g_j) when the GPUs bind) with solver noise in the last
#:    digits, and that noise, not the deficit (Gavel's tie-break), decides their order;
#: 2. an idle cluster recomputes its allocation at once: with an interval, the simulator waits
#:    for the next arrival when every job of the allocation in force has finished, GPUs idle
#:    while jobs wait (its physical scheduler computes the allocation at once);
#: 3. whole rounds: a job runs int(throughput x 360) steps a round, so a round ends up to one
#:    step short of 360 s, by an amount that depends on which job types run, and the rounds'
#:    ends drift against the arrivals; here a round runs throughput x 360 steps (a fraction).
CORRECTIONS = ("shares to 6 significant digits", "an idle cluster recomputes at once", "whole 360 s rounds")
SHARE_DIGITS = 6
ROUND_S = 360  # Gavel's time_per_iteration default, and ours


def cut_trace(source: Path, jobs: int, table: dict, max_hours: float | None = None) -> list[str]:
    kept = []
    for line in source.read_text().splitlines():
        cols = line.split("\t")
        key = f"('{cols[0]}', {int(cols[6])})"
        if key in table and (max_hours is None or int(cols[4]) / table[key]["null"] <= max_hours * 3600):
            kept.append(line)
        if len(kept) == jobs:
            break
    return kept


def write_throughputs(table: dict, traces: Path) -> None:
    """throughputs.json: the v100 entries (running alone) of Gavel's simulation_throughputs.json
    for the job types of CASES' traces, every GPU count: what our reader needs."""
    types = set()
    for source, jobs, _, hours in CASES.values():
        types.update(line.split("\t")[0] for line in cut_trace(traces / source, jobs, table, hours))
    keep = {k: {"null": v["null"]} for k, v in table.items() if k.split("', ")[0][2:] in types}
    (HERE / "throughputs.json").write_text(json.dumps({"v100": keep}, indent=0, sort_keys=True) + "\n")


def _corrected(scheduler) -> tuple:
    """Patch Gavel's Scheduler with CORRECTIONS; returns what to restore."""
    cls = scheduler.Scheduler
    originals = (cls._compute_allocation, cls._update_priorities, cls._get_num_steps)
    compute, update, _ = originals

    def compute_allocation(self, state=None):
        allocation = compute(self, state)
        return {job: {w: float(f"{v:.{SHARE_DIGITS}g}") for w, v in per.items()} for job, per in allocation.items()}

    def update_priorities(self):
        if self._need_to_update_allocation and self._jobs and not any(j in (self._allocation or {}) for j in self._jobs):
            self._last_reset_time = 0  # as the simulator forces a reset when its queue is empty
        return update(self)

    def get_num_steps(self, job_id, worker_type, single_job_id=None):
        # (single jobs only: the parity runs pack no jobs)
        return min(self._throughputs[job_id][worker_type] * self._time_per_iteration, self._get_remaining_steps(job_id))

    cls._compute_allocation, cls._update_priorities, cls._get_num_steps = compute_allocation, update_priorities, get_num_steps
    return originals


def run_gavel(gavel: Path, lines: list[str], policy_name: str, interval: float, gpus: int, corrected: bool = False) -> dict:
    sys.path.insert(0, str(gavel))
    import scheduler  # Gavel's
    import utils
    from job import Job

    jobs, arrivals = [], []
    for line in lines:
        job_type, command, num_steps_arg, needs_data_dir, total_steps, arrival, scale_factor = line.split("\t")
        jobs.append(Job(job_id=None, job_type=job_type, command=command, working_directory="", needs_data_dir=bool(int(needs_data_dir)),
                        num_steps_arg=num_steps_arg, total_steps=int(total_steps), duration=None, scale_factor=int(scale_factor),
                        priority_weight=1.0, SLO=-1.0))
        arrivals.append(float(arrival))
    policy = utils.get_policy(policy_name, solver="ECOS", seed=0)
    sched = scheduler.Scheduler(policy, throughputs_file=str(gavel / "simulation_throughputs.json"), simulate=True, seed=0,
                                time_per_iteration=ROUND_S, minimum_time_between_allocation_resets=interval)
    logging.disable(logging.WARNING)  # Gavel logs every micro-task
    originals = _corrected(scheduler) if corrected else None
    started = time.process_time()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            sched.simulate({"v100": gpus, "p100": 0, "k80": 0}, arrivals, jobs, num_gpus_per_server={"v100": 1, "p100": 1, "k80": 1})
            avg = sched.get_average_jct(verbose=False)
    finally:
        if originals is not None:
            cls = scheduler.Scheduler
            cls._compute_allocation, cls._update_priorities, cls._get_num_steps = originals
    cpu = time.process_time() - started
    assert len(sched._job_completion_times) == len(lines), "Gavel did not finish every job"
    ids = sorted(sched._job_completion_times, key=lambda j: j[0])
    jct = [sched._job_completion_times[j] for j in ids]
    sched.shutdown()
    run = {"policy": policy_name, "interval_s": interval, "avg_jct_s": float(avg), "jct_s": jct, "gavel_cpu_s": round(cpu, 2)}
    return {**run, "corrections": list(CORRECTIONS)} if corrected else run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gavel", type=Path, required=True, help="Gavel's scheduler/ directory at c4fa400")
    ap.add_argument("--traces", type=Path, default=SHARED, help="the gavel-msr traces (traces/gavel-msr)")
    ap.add_argument("--case", action="append", help="only these cases (default: all)")
    args = ap.parse_args()
    table = json.loads((args.gavel / "simulation_throughputs.json").read_text())["v100"]
    (HERE / "traces").mkdir(exist_ok=True)
    (HERE / "results").mkdir(exist_ok=True)
    write_throughputs(table, args.traces)
    for case, (source, jobs, gpus, hours) in CASES.items():
        if args.case and case not in args.case:
            continue
        lines = cut_trace(args.traces / source, jobs, table, hours)
        (HERE / "traces" / f"{case}.trace").write_text("\n".join(lines) + "\n")
        runs = []
        for policy_name, interval, corrected in RUNS:
            run = run_gavel(args.gavel, lines, policy_name, interval, gpus, corrected)
            runs.append(run)
            print(f"{case}: {policy_name} interval {interval} s{' corrected' if corrected else ''}: avg JCT {run['avg_jct_s']:.1f} s "
                  f"({len(run['jct_s'])} jobs, {run['gavel_cpu_s']} CPU s)")
        out = {"source": f"gavel-msr/{source}", "jobs": len(lines), "gpus": gpus, "max_hours": hours, "round_s": ROUND_S,
               "gavel_commit": "c4fa40097339e9608ab71fd64c8bdea96a5e4a4c", "runs": runs}
        (HERE / "results" / f"{case}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
