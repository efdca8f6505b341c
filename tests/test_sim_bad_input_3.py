"""Bad input to the simulator's commands, third round (a reviewer's findings): damaged parts given
to `silod experiment --merge` (a JSON list, NaN, a float shard number, a missing field, a FIFO,
a part claiming 10^20 shards), submit times past the simulator's horizon, a damaged Gavel
simulation_throughputs.json, Alibaba openb rows with duplicate names, the wrong number of fields
or bytes that are not UTF-8, and `silod trace export --out` under a file. Each is one clear line
and exit 2, and a failed merge leaves the user's earlier outputs as they were.

Every command runs the real console entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from full_disk import fill_to_the_last_block, tiny_tmpfs

SILOD = [sys.executable, "-m", "scheduler"]
HEADER = "job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs\n"
OPENB_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
OPENB_ROW = "p{},12000,16384,1,1000,,LS,Running,0,100000,0\n"


def silod(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        return subprocess.run([*SILOD, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"silod {' '.join(args)} hung (no answer in {timeout:g} s)")


def user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "bug in silod" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


# ---------------------------------------------------------------- 1. --merge: damaged parts


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    """The two parts of `silod experiment micro --shard I/2` (four small simulations)."""
    root = tmp_path_factory.mktemp("parts")
    for i in (1, 2):
        proc = silod("experiment", "micro", "--quiet", "--workers", "1", "--shard", f"{i}/2", "--out", str(root))
        assert proc.returncode == 0, proc.stderr
    return root


def _edit(change):
    def apply(path: Path) -> None:
        body = json.loads(path.read_text())
        change(body)
        path.write_text(json.dumps(body))
    return apply


def _set_summary(key, value):
    return _edit(lambda b: b["results"][0]["summary"].__setitem__(key, value))


DAMAGE = {
    # was "This is a bug in silod" (AttributeError)
    "json-list": (lambda p: p.write_text("[]"), "a JSON list, not an object"),
    "deep-nesting": (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "maximum recursion depth"),
    # were merged silently: int(1.5) is 1, and NaN went into the JSON and the plot
    "float-shard": (_edit(lambda b: b.__setitem__("shard", [1.5, 2])), "shard I is 1.5"),
    "nan-result": (_set_summary("avg_jct_s", float("nan")), "the number NaN is not finite"),
    "huge-number": (lambda p: p.write_text(p.read_text().replace('"total_runs": 4', '"total_runs": 1e400')), "1e400 is not finite"),
    # were tracebacks in the merge or the plotting code ("This is a bug in silod")
    "text-result": (_set_summary("avg_jct_s", "fast"), "avg_jct_s is 'fast'"),
    # finite but no run's: merged into a table of 300-digit JCTs, exit 0
    "huge-jct": (_set_summary("avg_jct_s", 1e308), "avg_jct_s is 1e+308 s, outside 0 to"),
    "huge-jct-by-kind": (_edit(lambda b: b["results"][0]["jct_by_kind"].__setitem__("regular", 1e300)), "regular is 1e+300 s"),
    "negative-bytes": (_set_summary("remote_bytes", -5.0), "remote_bytes is -5.0, which no run gives (negative)"),
    "negative-utilization": (_set_summary("gpu_utilization", -3.0), "gpu_utilization is -3.0, which no run gives"),
    "missing-run": (_edit(lambda b: b["results"][0].pop("run")), "no field 'run'"),
    "short-fairness": (_edit(lambda b: b["results"][0].__setitem__("fairness", [[1.0]])), "not enough values"),
    "extra-run-field": (_edit(lambda b: b["results"][0]["run"].__setitem__("color", "red")), "color"),
    "bad-capacity": (_edit(lambda b: b["config"].__setitem__("capacity", {"gpus": -1})), "ClusterCapacity"),
    "missing-config": (_edit(lambda b: b["config"].pop("seed")), "config must be an object with"),
    "infinite-trace-jobs": (lambda p: p.write_text(p.read_text().replace('"trace_jobs": 5', '"trace_jobs": Infinity')), "not finite"),
    # a MemoryError (a list of 5 * 10^11 run indices)
    "huge-total-runs": (_edit(lambda b: b.__setitem__("total_runs", 10**12)), "1000000000000; one of them was edited"),
    # At [1, 10^20] --merge hung listing the shards missing (and its memory grew without end); 20,000
    # shows the same missing bound without that: it listed 19,999 missing shards in one message.
    "too-many-shards": (_edit(lambda b: b.__setitem__("shard", [1, 20_000])), "shard N is 20000, not a whole number from 1 to 10,000"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_merge_refuses_a_damaged_part_and_keeps_earlier_outputs(parts, tmp_path, damage):
    change, expected = DAMAGE[damage]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    shutil.copy(parts / "micro.part-1-of-2.json", tmp_path / "a")
    shutil.copy(parts / "micro.part-2-of-2.json", tmp_path / "b")
    change(tmp_path / "a" / "micro.part-1-of-2.json")
    out = tmp_path / "m"
    out.mkdir()
    (out / "micro.json").write_text("earlier results\n")
    proc = silod("experiment", "micro", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--quiet")
    user_error(proc, str(tmp_path / "a" / "micro.part-1-of-2.json"), expected)
    assert (out / "micro.json").read_text() == "earlier results\n"
    assert not (out / "micro.png").exists()


def test_the_undamaged_parts_still_merge(parts, tmp_path):
    proc = silod("experiment", "micro", "--merge", str(parts), "--out", str(tmp_path / "m"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "merged 2 part(s), 4 simulations" in proc.stdout


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_merge_refuses_a_fifo_named_like_a_part(parts, tmp_path):
    # Reading it blocked forever (and a symlink to /dev/zero read until memory ran out).
    (tmp_path / "a").mkdir()
    shutil.copy(parts / "micro.part-2-of-2.json", tmp_path / "a")
    os.mkfifo(tmp_path / "a" / "micro.part-1-of-2.json")
    proc = silod("experiment", "micro", "--merge", str(tmp_path / "a"), "--out", str(tmp_path / "m"), "--quiet", timeout=60)
    user_error(proc, "micro.part-1-of-2.json", "not a regular file")


def test_shard_count_is_bounded(tmp_path):
    # --shard 1/10^20 wrote a part that --merge then could not finish listing the missing shards of.
    proc = silod("experiment", "micro", "--quiet", "--workers", "1", "--shard", "1/100000000000000000000", "--out", str(tmp_path / "s"))
    user_error(proc, "--shard 1/100000000000000000000", "N must be from 1 to 10,000")
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- 2. submit times past the horizon


def test_horizon_is_the_simulators():
    from scheduler.sim.engine import SimConfig
    from traces.model import MAX_SUBMIT_S

    assert MAX_SUBMIT_S == SimConfig().max_sim_time_s


def _gavel(tmp_path: Path, arrival: str = "0", throughput: object = 10.0) -> Path:
    job_type = "Transformer (batch size 128)"
    trace = tmp_path / "t.trace"
    trace.write_text(f"{job_type}\tcmd\t-step\t1\t14612\t{arrival}\t1\n")
    entry = throughput if isinstance(throughput, str) else {"null": throughput}
    (tmp_path / "simulation_throughputs.json").write_text(json.dumps({"v100": {f"('{job_type}', 1)": entry}}))
    return trace


@pytest.mark.parametrize("fmt", ["csv", "gavel", "alibaba-openb"])
def test_a_job_submitted_after_the_horizon_is_refused(tmp_path, fmt):
    # Was a run with "0 jobs" (the job never started), exit 0.
    if fmt == "csv":
        trace, where = tmp_path / "t.csv", "line 2, column 'submit_time'"
        trace.write_text(HEADER + "a,1e12,1,x,d,5GB,10MB/s,1\n")
    elif fmt == "gavel":
        trace, where = _gavel(tmp_path, arrival="1e12"), "t.trace:1: arrival_time"
    else:
        trace, where = tmp_path / "openb.csv", "line 2, column 'creation_time'"
        trace.write_text(OPENB_HEADER + "p,12000,16384,1,1000,,LS,Running,1e12,1000000100000,1e12\n")
    out = tmp_path / "o"
    proc = silod("simulate", "--trace", str(trace), "--format", fmt, "--gpus", "8", "--out", str(out), "--quiet")
    user_error(proc, str(trace), where, "horizon")
    assert not (out / "summary.json").exists()


# ---------------------------------------------------------------- 3. Gavel: a damaged simulation_throughputs.json


@pytest.mark.parametrize("throughput", [None, 0, -3, "fast", "not-an-object"], ids=["no-null", "zero", "negative", "text", "entry-text"])
def test_gavel_damaged_throughputs_are_user_errors(tmp_path, throughput):
    # no-null, zero, text and entry-text were tracebacks ("This is a bug in silod"); negative was
    # reported as a job reading a negative number of bytes.
    trace = _gavel(tmp_path, throughput="not-an-object" if throughput == "not-an-object" else throughput)
    proc = silod("simulate", "--trace", str(trace), "--format", "gavel", "--gpus", "8", "--out", str(tmp_path / "o"), "--quiet")
    # The file's whole path and the trace line that asked (the message named neither).
    user_error(proc, str(tmp_path / "simulation_throughputs.json"), "('Transformer (batch size 128)', 1)", f"{trace}:1")


def test_gavel_job_type_without_throughputs_names_the_file_and_line(tmp_path):
    trace = _gavel(tmp_path)
    trace.write_text("Transformer (batch size 128)\tcmd\t-step\t1\t14612\t0\t1\n"
                     "ResNet-50 (batch size 64)\tcmd\t-step\t1\t100\t5\t2\n")
    proc = silod("simulate", "--trace", str(trace), "--format", "gavel", "--gpus", "8", "--out", str(tmp_path / "o"), "--quiet")
    user_error(proc, str(tmp_path / "simulation_throughputs.json"), f"{trace}:2", "'ResNet-50 (batch size 64)'", "2 or fewer GPUs")


# ---------------------------------------------------------------- 4. Alibaba openb rows


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # a KeyError in the simulator ("This is a bug in silod")
        (OPENB_ROW.format(1) * 2, "line 3, column 'name': task 'p1' is also on line 2"),
        # skipped as "never scheduled", without a word
        (OPENB_ROW.format(1) + "p2,12000,16384,1\n", "line 3: 4 fields, but the header has 11"),
        # the extra fields were ignored
        (OPENB_ROW.format(1).rstrip("\n") + ",7,8\n", "line 2: 13 fields, but the header has 11"),
        # "cpu_rate inf must be a positive rate", naming neither file nor column
        ("p,1e-300,16384,1,1000,,LS,Running,0,100000,0\n", "line 2, column 'cpu_milli'"),
    ],
    ids=["duplicate-name", "short-row", "long-row", "tiny-cpu-request"],
)
def test_alibaba_bad_rows_name_file_line_and_column(tmp_path, body, expected):
    trace = tmp_path / "openb.csv"
    trace.write_text(OPENB_HEADER + body)
    proc = silod("simulate", "--trace", str(trace), "--format", "alibaba-openb", "--gpus", "8", "--out", str(tmp_path / "o"), "--quiet")
    user_error(proc, str(trace), expected)


def test_alibaba_trace_that_is_not_utf8_names_the_file(tmp_path):
    # Was "input is not text (...); give a UTF-8 text file", naming no file.
    trace = tmp_path / "openb.csv"
    trace.write_bytes((OPENB_HEADER + OPENB_ROW.format("\xe9")).encode("latin-1"))
    proc = silod("simulate", "--trace", str(trace), "--format", "alibaba-openb", "--gpus", "8", "--out", str(tmp_path / "o"), "--quiet")
    user_error(proc, str(trace), "is not UTF-8 text")


# ---------------------------------------------------------------- 5. trace export --out under a file


def test_trace_export_out_under_a_file(tmp_path):
    # Was "error: ...: File exists", exit 1.
    (tmp_path / "f").write_text("mine\n")
    proc = silod("trace", "export", "--out", str(tmp_path / "f" / "trace.csv"), "--max-jobs", "2")
    user_error(proc, "--out's directory", "exists and is not a directory")
    assert (tmp_path / "f").read_text() == "mine\n"


def test_a_curriculum_that_grows_too_many_times_is_refused(tmp_path):
    """Found by the review: starting_percent 1e-6 at alpha 1.0000001 is 1.4e8 growths, which the
    simulator stepped through one by one for hours. Refused at its line and column now."""
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,access,starting_percent,alpha,step,batch,item_size\n"
                     "a,0,1,x,d,5GB,10MB/s,1,curriculum,0.000001,1.0000001,1,1,1B\n")
    user_error(silod("simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), "--quiet"), "alpha", "at most 1,000", "line 2")
    assert not (tmp_path / "o" / "summary.json").exists()


def test_numbers_in_a_trace_are_ascii_digits(tmp_path):
    """int() and float() read any script's digits: '٣' GPUs was a 3-GPU job."""
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "a,0,\u0663,x,d,5GB,10MB/s,1\n", encoding="utf-8")
    user_error(silod("simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), "--quiet"), "num_gpus", "line 2")


def test_trace_export_on_a_full_disk_keeps_the_earlier_file(tmp_path):
    """The export wrote --out in place: a failure half-way left a cut-off trace where the user's
    file was. On a real 64 KiB tmpfs filled to the last block the earlier file now stays whole."""
    with tiny_tmpfs(tmp_path / "tiny") as disk:
        earlier = disk / "trace.csv"
        earlier.write_text(HEADER + "a,0,1,x,d,5GB,10MB/s,1\n")
        fill_to_the_last_block(disk / "filler")
        user_error(silod("trace", "export", "--out", str(earlier)), str(earlier), "unchanged")
        assert earlier.read_text() == HEADER + "a,0,1,x,d,5GB,10MB/s,1\n"
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "trace.csv"]


def test_jobs_that_cannot_finish_are_named_in_a_warning(tmp_path, monkeypatch):
    """Jobs still queued at the simulator's horizon were only a count in summary.json. Reaching
    the real ten-year horizon takes a million steps, so the horizon is shortened here (in
    process): three 600-s jobs on one GPU, a 1,000-s horizon (checked at each step's start, so the
    second, started at 600 s, still ends)."""
    import functools

    from typer.testing import CliRunner

    import scheduler.sim.engine as engine
    from scheduler.cli import app

    monkeypatch.setattr(engine, "SimConfig", functools.partial(engine.SimConfig, max_sim_time_s=1000.0))
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "".join(f"{j},0,1,x,d,6GB,10MB/s,1\n" for j in "abc"))
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--gpus", "1", "--gpus-per-node", "1",
                                      "--remote-io", "1GB/s", "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "warning: 1 job(s) did not finish (c)" in result.output
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["unfinished_jobs"] == 1


@pytest.mark.parametrize("cpu_rate, cpus_per_node, expect", [
    ("1B/s", "4", "4 cores at most x 1 B/s per core"),  # ran on for minutes towards a horizon it never reached
    ("20MB/s", "1e-9", "1e-09 cores at most"),  # ran 3 CPU minutes, then "average JCT 0.00 h", exit 0
])
def test_a_job_its_cores_cannot_finish_is_refused(tmp_path, cpu_rate, cpus_per_node, expect):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER.strip() + ",cpu_rate\n" + f"a,0,1,x,d,10GB,100MB/s,1,{cpu_rate}\n")
    out = tmp_path / "o"
    proc = silod("simulate", "--trace", str(trace), "--gpus", "1", "--gpus-per-node", "1", "--cpus-per-node", cpus_per_node,
                 "--out", str(out), "--quiet")
    user_error(proc, "job a", expect, "horizon", "cpu_rate and the cluster's CPU cores per node")
    assert not (out / "summary.json").exists()
    # The same job with enough cores runs.
    ok = silod("simulate", "--trace", str(trace), "--gpus", "1", "--gpus-per-node", "1", "--cpus-per-node", "4",
               "--out", str(out), "--quiet") if cpu_rate != "1B/s" else None
    assert ok is None or ok.returncode == 0, ok.stderr


def test_cpu_allocation_without_cores_and_a_rate_in_cores_are_clear_errors(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "a,0,1,x,d,10GB,100MB/s,1\n")
    # --cpu-allocation without --cpus-per-node was ignored (exit 0): CPU was not modelled at all.
    proc = silod("simulate", "--trace", str(trace), "--gpus", "1", "--cpu-allocation", "gpu-proportional", "--out", str(tmp_path / "o"))
    user_error(proc, "--cpu-allocation", "give --cpus-per-node")
    # "35 cores" was told to write "35 cores/s", which is refused in turn.
    trace.write_text(HEADER.strip() + ",cpu_rate\n" + "a,0,1,x,d,10GB,100MB/s,1,35 cores\n")
    proc = silod("simulate", "--trace", str(trace), "--gpus", "1", "--cpus-per-node", "4", "--out", str(tmp_path / "o"))
    user_error(proc, "'35 cores' is not a rate")
    assert "cores/s" not in proc.stderr
