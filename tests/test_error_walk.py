"""Every `silod` command and subcommand, given the mistakes people make: a missing required option,
a bad value, a value out of range, a nonexistent file, a binary file, an unwritable output path.

Each case runs the real console entry point in a subprocess and asserts what a user sees: no
traceback, at most two lines on stderr, a message naming the input, and the exit code of
scheduler/cli.py's contract (2 for usage errors and bad input, 1 for runtime failures such as an
unreachable server). Every case fails before anything long-running starts (no mount is made, no
server listens); a case that would start one instead fails by its timeout.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SILOD = [sys.executable, "-m", "scheduler"]
ADMIN_TOKEN = "walk-admin-token-0123456789"
# As root every existing directory is writable, so the unwritable path is one that cannot exist.
UNWRITABLE = "/proc/silod-error-walk/out"
TRACE_HEADER = "job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs\n"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


@pytest.fixture(scope="module")
def busy_listen():
    """HOST:PORT where a server already listens, for the port-in-use cases."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def files(tmp_path_factory, busy_listen) -> dict[str, str]:
    root = tmp_path_factory.mktemp("walk")
    binary = root / "binary.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x00\xff\xfe" + random.Random(1).randbytes(4096))
    (root / "tiny.csv").write_text(TRACE_HEADER + "j1,0,1,resnet50,d1,10GB,100MB/s,1\n")
    (root / "huge.csv").write_text(TRACE_HEADER + "j1,0,1,resnet50,d1,1e30,100MB/s,1\n")
    # a misspelled optional column: silently ignored, the job would run as an epoch job
    (root / "acess.csv").write_text(TRACE_HEADER.rstrip("\n") + ",acess\nj1,0,1,resnet50,d1,10GB,100MB/s,1,curriculum\n")
    (root / "mnt").mkdir()
    (root / "source").mkdir()
    (root / "source" / "item0").write_bytes(b"x" * 100)
    (root / "gavel").mkdir()  # a binary "trace" beside a throughputs file, so the trace itself is read
    (root / "gavel" / "binary.bin").write_bytes(binary.read_bytes())
    (root / "gavel" / "simulation_throughputs.json").write_text('{"v100": {}}')
    (root / "cache-with-mnt" / "mnt").mkdir(parents=True)
    (root / "corrupt-state").mkdir()
    (root / "corrupt-state" / "state.json").write_bytes(binary.read_bytes())
    return {
        "root": str(root), "bin": str(binary), "tiny": str(root / "tiny.csv"), "huge": str(root / "huge.csv"),
        "mnt": str(root / "mnt"), "cache_with_mnt": str(root / "cache-with-mnt"), "source": str(root / "source"), "cache": str(root / "cache"),
        "missing": str(root / "does-not-exist.csv"), "corrupt": str(root / "corrupt-state"),
        "state": str(root / "state"), "gavel_bin": str(root / "gavel" / "binary.bin"), "closed": f"http://127.0.0.1:{_closed_port()}",
        "acess": str(root / "acess.csv"), "busy": busy_listen,
    }


MOUNT = ["mount", "{mnt}", "--source", "{source}", "--dataset", "d1", "--job", "j1", "--cache-dir", "{cache}"]
SERVE = ["serve", "--backend", "null", "--state-dir", "{state}", "--gpus", "4", "--cache", "1TB", "--remote-io", "1GB/s"]

# (case id, argv, exit code, text the message must contain)
CASES: list[tuple[str, list[str], int, str]] = [
    ("unknown-command", ["simulat"], 2, "No such command 'simulat'"),
    ("unknown-global-option", ["--bogus"], 2, "--bogus"),
    ("no-arguments-prints-help", [], 2, "Usage"),
    # simulate
    ("simulate-option-without-value", ["simulate", "--gpus"], 2, "--gpus"),
    ("simulate-bad-gpus", ["simulate", "--gpus", "many"], 2, "--gpus 'many'"),
    ("trace-export-point-without-experiment", ["trace", "export", "--autocache-points", "--out", "{root}/t.csv"], 2,
     "add --experiment NAME"),
    ("trace-fetch-unknown", ["trace", "fetch", "alibaba-openc", "--dest", "{root}/openb"], 2, "did you mean 'alibaba-openb'"),
    ("trace-fetch-dest-is-a-file", ["trace", "fetch", "alibaba-openb", "--dest", "{tiny}"], 2, "is a file, not a folder"),
    ("simulate-unknown-option", ["simulate", "--gpu", "4"], 2, "--gpu"),
    ("simulate-bad-format", ["simulate", "--format", "xml"], 2, "--format"),
    ("simulate-cache-out-of-range", ["simulate", "--cache", "1e30"], 2, "1EB"),
    ("simulate-remote-io-out-of-range", ["simulate", "--remote-io", "100TB/s"], 2, "10TB/s"),
    ("simulate-gpus-out-of-range", ["simulate", "--gpus", "2000000"], 2, "1,000,000"),
    ("simulate-unknown-policy", ["simulate", "--trace", "{tiny}", "--policy", "nope"], 2, "nope"),
    ("simulate-unknown-cache-system", ["simulate", "--trace", "{tiny}", "--cache-system", "nope"], 2, "nope"),
    ("simulate-nonexistent-trace", ["simulate", "--trace", "{missing}"], 2, "does-not-exist.csv"),
    ("simulate-binary-trace", ["simulate", "--trace", "{bin}"], 2, "binary.bin"),
    ("simulate-binary-gavel-trace", ["simulate", "--trace", "{gavel_bin}", "--format", "gavel"], 2, "binary.bin"),
    ("simulate-trace-size-out-of-range", ["simulate", "--trace", "{huge}"], 2, "1EB"),
    ("simulate-nonexistent-cluster", ["simulate", "--cluster", "{missing}"], 2, "does-not-exist.csv"),
    ("simulate-binary-cluster", ["simulate", "--cluster", "{bin}"], 2, "binary.bin"),
    ("simulate-misspelled-optional-column", ["simulate", "--trace", "{acess}"], 2, "did you mean 'access'"),
    ("simulate-negative-seed", ["simulate", "--trace", "{tiny}", "--seed", "-1"], 2, "--seed -1"),
    ("simulate-policy-typo", ["simulate", "--trace", "{tiny}", "--policy", "fifoo"], 2, "did you mean 'fifo'"),
    ("simulate-cache-system-typo", ["simulate", "--trace", "{tiny}", "--cache-system", "Aluxio"], 2,
     "did you mean 'alluxio'"),
    ("simulate-unwritable-out", ["simulate", "--trace", "{tiny}", "--quiet", "--out", UNWRITABLE], 2, "--out"),
    # experiment
    ("experiment-missing-name", ["experiment"], 2, "Missing argument 'name'"),
    ("experiment-unknown-name", ["experiment", "nope"], 2, "nope"),
    ("experiment-bad-max-jobs", ["experiment", "micro", "--max-jobs", "x"], 2, "--max-jobs"),
    ("experiment-cache-out-of-range", ["experiment", "micro", "--cache", "1e30"], 2, "1EB"),
    ("experiment-nonexistent-trace", ["experiment", "matrix", "--trace", "{missing}", "--max-jobs", "2", "--quiet",
                                      "--out", "{root}/exp1"], 2, "does-not-exist.csv"),
    ("experiment-binary-trace", ["experiment", "matrix", "--trace", "{bin}", "--max-jobs", "2", "--quiet",
                                 "--out", "{root}/exp2"], 2, "binary.bin"),
    ("experiment-negative-seed", ["experiment", "micro", "--seed", "-1", "--quiet", "--out", "{root}/exp3"], 2, "--seed -1"),
    ("experiment-name-typo", ["experiment", "micr"], 2, "did you mean 'micro'"),
    ("experiment-unwritable-out", ["experiment", "micro", "--quiet", "--out", UNWRITABLE], 2, "--out"),
    # mount
    # agent (the CSI node agent)
    ("agent-bad-idle-unmount", ["agent", "--idle-unmount", "soon"], 2, "--idle-unmount"),
    ("agent-no-dataset-source", ["agent", "--node", "n1", "--state-dir", "{state}"], 2, "--datasets FILE or --scheduler URL"),
    ("agent-nonexistent-datasets", ["agent", "--node", "n1", "--state-dir", "{state}", "--datasets", "{missing}"], 2, "does-not-exist.csv"),
    ("agent-binary-datasets", ["agent", "--node", "n1", "--state-dir", "{state}", "--datasets", "{bin}"], 2, "binary.bin"),
    ("agent-bad-report-interval", ["agent", "--node", "n1", "--state-dir", "{state}", "--datasets", "{bin}",
                                   "--report-interval", "soon"], 2, "--report-interval"),
    ("agent-bad-cache-size", ["agent", "--node", "n1", "--state-dir", "{state}", "--datasets", "{bin}",
                              "--cache-size", "lots"], 2, "--cache-size"),
    ("agent-zero-cache-size", ["agent", "--node", "n1", "--state-dir", "{state}", "--datasets", "{bin}",
                               "--cache-size", "0"], 2, "--cache-size '0' must be positive"),
    ("serve-kubernetes-bad-api-url", ["serve", "--backend", "kubernetes", "--state-dir", "{state}", "--gpus", "4",
                                      "--cache", "1TB", "--remote-io", "1GB/s", "--backend-opt", "api-url=ftp://x/y"],
     2, "api-url='ftp://x/y'"),
    ("csi-controller-no-dataset-source", ["csi-controller", "--socket", "{state}/c.sock"], 2,
     "--datasets FILE or --scheduler URL"),
    ("csi-controller-nonexistent-datasets", ["csi-controller", "--socket", "{state}/c.sock", "--datasets", "{missing}"],
     2, "does-not-exist.csv"),
    ("serve-webhook-without-cert", ["serve", "--backend", "kubernetes", "--webhook-listen", "127.0.0.1:0"], 2,
     "--webhook-cert and --webhook-key"),
    ("serve-bad-node-agent", ["serve", "--gpus", "4", "--cache", "1GB", "--remote-io", "1GB/s", "--backend", "null",
                              "--node-agent", "a=n1", "--node-agent", "a=n2"], 2, "bound to two nodes"),
    ("mount-missing-source", ["mount", "{mnt}", "--dataset", "d1", "--job", "j1", "--cache-dir", "{cache}"], 2, "--source"),
    ("mount-bad-cache-size", [*MOUNT, "--cache-size", "lots"], 2, "--cache-size 'lots'"),
    ("mount-bad-node", [*MOUNT, "--node", "../x y"], 2, "is not a node name"),
    ("mount-io-rate-out-of-range", [*MOUNT, "--io-rate", "1e30"], 2, "10TB/s"),
    ("mount-nonexistent-mountpoint", ["mount", "{missing}", *MOUNT[2:]], 2, "does-not-exist.csv"),
    ("mount-nonexistent-source", [*MOUNT[:3], "{missing}", *MOUNT[4:]], 2, "does-not-exist.csv"),
    ("mount-binary-file-as-source", [*MOUNT[:3], "{bin}", *MOUNT[4:]], 2, "binary.bin"),
    ("mount-unsupported-scheme", [*MOUNT[:3], "ftp://example.invalid/data", *MOUNT[4:]], 2, "ftp://"),
    ("mount-unwritable-stats-file", [*MOUNT, "--stats-file", UNWRITABLE], 2, "--stats-file"),
    ("mount-unwritable-cache-dir", [*MOUNT[:-1], UNWRITABLE], 2, "--cache-dir"),
    # issue 19: each of these used to mount and then hang (D state, blocked reads, endless tracebacks)
    ("mount-cache-dir-inside-mountpoint", [*MOUNT[:-1], "{mnt}/cache"], 2, "inside the mount point"),
    ("mount-cache-dir-is-mountpoint", [*MOUNT[:-1], "{mnt}"], 2, "inside the mount point"),
    ("mount-mountpoint-inside-cache-dir", ["mount", "{cache_with_mnt}/mnt", *MOUNT[2:-1], "{cache_with_mnt}"], 2,
     "inside --cache-dir"),
    ("mount-io-rate-zero", [*MOUNT, "--io-rate", "0"], 2, "--io-rate 0"),
    ("mount-io-rate-zero-with-unit", [*MOUNT, "--io-rate", "0MB/s"], 2, "--io-rate 0"),
    ("mount-io-rate-negative", [*MOUNT, "--io-rate", "-5MB/s"], 2, "--io-rate"),
    ("mount-stats-file-in-proc", [*MOUNT, "--stats-file", "/proc/silod-stats"], 2, "--stats-file '/proc/silod-stats'"),
    ("mount-stats-file-is-a-directory", [*MOUNT, "--stats-file", "{root}"], 2, "is a directory"),
    # datamanager
    ("datamanager-missing-state", ["datamanager"], 2, "--state"),
    ("datamanager-bad-listen", ["datamanager", "--state", "{state}", "--listen", "everywhere"], 2, "--listen"),
    ("datamanager-port-in-use", ["datamanager", "--state", "{state}", "--listen", "{busy}"], 2, "the port is in use"),
    ("datamanager-binary-file-as-state", ["datamanager", "--state", "{bin}"], 2, "--state"),
    ("datamanager-corrupt-state-file", ["datamanager", "--state", "{corrupt}"], 2, "state.json"),
    ("datamanager-unwritable-state", ["datamanager", "--state", UNWRITABLE], 2, "--state"),
    # serve
    ("serve-option-without-value", ["serve", "--listen"], 2, "--listen"),
    ("serve-bad-listen", [*SERVE, "--listen", "everywhere"], 2, "--listen"),
    ("serve-bad-gpus", ["serve", "--backend", "null", "--state-dir", "{state}", "--gpus", "x", "--cache", "1TB",
                        "--remote-io", "1GB/s"], 2, "--gpus"),
    ("serve-cache-out-of-range", [*SERVE[:7], "--cache", "1e30", "--remote-io", "1GB/s"], 2, "1EB"),
    ("serve-bad-round", [*SERVE, "--round", "0"], 2, "--round"),
    ("serve-unknown-policy", [*SERVE, "--policy", "nope"], 2, "nope"),
    ("serve-policy-typo", [*SERVE, "--policy", "Gavl"], 2, "did you mean 'gavel'"),
    ("serve-port-in-use", [*SERVE, "--listen", "{busy}"], 2, "the port is in use"),
    ("serve-unknown-backend", ["serve", "--backend", "nope", "--state-dir", "{state}", *SERVE[5:]], 2, "nope"),
    ("serve-nonexistent-tokens", [*SERVE, "--tokens", "{missing}"], 2, "does-not-exist.csv"),
    ("serve-binary-tokens", [*SERVE, "--tokens", "{bin}"], 2, "binary.bin"),
    ("serve-nonexistent-cluster", ["serve", "--backend", "null", "--state-dir", "{state}", "--cluster", "{missing}"], 2,
     "does-not-exist.csv"),
    ("serve-binary-cluster", ["serve", "--backend", "null", "--state-dir", "{state}", "--cluster", "{bin}"], 2, "binary.bin"),
    ("serve-unwritable-state-dir", ["serve", "--backend", "null", "--state-dir", UNWRITABLE, *SERVE[5:]], 2, "--state-dir"),
    ("serve-unwritable-db", [*SERVE, "--db", f"sqlite:///{UNWRITABLE}/silod.db"], 2, "--db"),
    # API clients
    ("submit-missing-name", ["submit", "--gpus", "1", "--dataset", "d1", "--epochs", "1"], 2, "--name"),
    ("submit-bad-gpus", ["submit", "--name", "a", "--gpus", "x", "--dataset", "d1", "--epochs", "1"], 2, "--gpus"),
    ("submit-gpus-out-of-range", ["submit", "--name", "a", "--gpus", "0", "--dataset", "d1", "--epochs", "1"], 2, "--gpus 0"),
    ("submit-rate-out-of-range", ["submit", "--name", "a", "--gpus", "1", "--dataset", "d1", "--epochs", "1",
                                  "--ideal-throughput", "1e30"], 2, "10TB/s"),
    ("submit-unreachable-server", ["submit", "--name", "a", "--gpus", "1", "--dataset", "d1", "--epochs", "1",
                                   "--ideal-throughput", "1GB/s", "--server", "{closed}", "--token", "t"], 1, "cannot reach"),
    ("jobs-unreachable-server", ["jobs", "--server", "{closed}", "--token", "t"], 1, "cannot reach"),
    ("jobs-bad-server-url", ["jobs", "--server", "localhost", "--token", "t"], 2, "--server"),
    ("jobs-no-token", ["jobs", "--server", "{closed}"], 2, "SILOD_TOKEN"),
    ("top-no-token", ["top", "--once", "--server", "{closed}"], 2, "SILOD_TOKEN"),
    ("top-unreachable-server", ["top", "--once", "--server", "{closed}", "--token", "t"], 1, "cannot reach"),
    ("top-bad-interval", ["top", "--interval", "0", "--server", "{closed}", "--token", "t"], 2, "--interval 0"),
    ("cancel-missing-id", ["cancel", "--token", "t"], 2, "Missing argument 'job_id'"),
    ("cancel-unreachable-server", ["cancel", "1", "--server", "{closed}", "--token", "t"], 1, "cannot reach"),
    ("dataset-add-missing-uri", ["dataset-add", "d1", "--size", "1GB"], 2, "--uri"),
    ("dataset-add-bad-size", ["dataset-add", "d1", "--uri", "s3://b/d1", "--size", "big"], 2, "--size 'big'"),
    ("dataset-add-size-out-of-range", ["dataset-add", "d1", "--uri", "s3://b/d1", "--size", "2EB"], 2, "1EB"),
    ("dataset-add-size-in-bits-or-bytes", ["dataset-add", "d1", "--uri", "s3://b/d1", "--size", "10tb"], 2,
     "10TB for 10 terabytes (10TB) or 10Tbit for 10 terabits (1.25TB)"),
    ("submit-rate-in-bits-or-bytes", ["submit", "--name", "a", "--gpus", "1", "--dataset", "d1", "--epochs", "1",
                                      "--ideal-throughput", "1Gb/s"], 2, "1GB/s for 1 gigabytes/s"),
    # demo
    ("demo-unknown-option", ["demo", "--fast"], 2, "--fast"),
    ("demo-unknown-policy", ["demo", "--policy", "nope"], 2, "nope"),
    ("demo-policy-typo", ["demo", "--policy", "SJFF"], 2, "did you mean 'sjf'"),
    # /proc exists and os.access says root may write there; no file can be made in it
    ("demo-json-where-no-file-can-be-made", ["demo", "--json", "/proc/silod-error-walk.json"], 2, "--json"),
    ("demo-unwritable-workdir", ["demo", "--workdir", UNWRITABLE], 2, "--workdir"),
    ("demo-binary-file-as-workdir", ["demo", "--workdir", "{bin}"], 2, "--workdir"),
    ("demo-unwritable-json", ["demo", "--json", UNWRITABLE + "/demo.json"], 2, "--json"),
]


def test_every_command_is_walked():
    """A new command must get its cases here: the walk covers every registered command."""
    from scheduler.cli import app

    registered = {c.name or c.callback.__name__ for c in app.registered_commands}
    walked = {argv[0] for _, argv, _, _ in CASES if argv and not argv[0].startswith("-")}
    assert registered - walked == set(), f"commands without error-walk cases: {sorted(registered - walked)}"


@pytest.mark.parametrize(("argv", "code", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_is_short_and_exit_code_is_right(files, tmp_path, argv, code, needle):
    args = [a.format(**files) for a in argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SILOD_", "AWS_"))}
    env.update(SILOD_ADMIN_TOKEN=ADMIN_TOKEN, XDG_STATE_HOME=str(tmp_path / "xdg"), COLUMNS="100")
    proc = subprocess.run([*SILOD, *args], capture_output=True, text=True, timeout=90, env=env, stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}:\n{output}"
    assert needle in output, f"the message should name {needle!r}:\n{output}"
    if argv:  # `silod` alone prints its help; every error is one or two lines
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert 1 <= len(lines) <= 2, f"expected one or two lines on stderr, got {len(lines)}:\n{proc.stderr}"
        assert lines[0].startswith("error: "), proc.stderr


def test_debug_shows_the_traceback(files):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    for argv, extra_env in ((["--debug", "simulate", "--trace", files["missing"]], {}),
                            (["simulate", "--trace", files["missing"]], {"SILOD_DEBUG": "1"})):
        proc = subprocess.run([*SILOD, *argv], capture_output=True, text=True, timeout=60, env={**env, **extra_env})
        assert proc.returncode == 2
        assert "Traceback" in proc.stderr and "does-not-exist.csv" in proc.stderr.splitlines()[-1]


def test_exit_codes_of_commands_reach_the_shell():
    """Without standalone mode typer returns `raise typer.Exit(code)` as a value; `silod mount`
    (the mount's exit status) and `silod demo` (jobs that did not finish) rely on it."""
    code = ("import sys, typer; from scheduler.cli import app, main\n"
            "@app.command('exit-three')\n"
            "def exit_three() -> None:\n"
            "    raise typer.Exit(3)\n"
            "main(['exit-three'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr


def test_trace_with_a_byte_order_mark_is_read(tmp_path):
    """Spreadsheet programs save CSV with a UTF-8 byte-order mark before the header."""
    trace = tmp_path / "bom.csv"
    trace.write_bytes("\ufeff".encode() + (TRACE_HEADER + "j1,0,1,resnet50,d1,10GB,100MB/s,1\n").encode())
    proc = subprocess.run([*SILOD, "simulate", "--trace", str(trace), "--quiet", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "summary.json").exists()


def test_policy_names_follow_one_case_rule():
    """`FIFO` is `fifo` wherever a policy is named; a typo suggests the closest name."""
    from estimator.errors import UserError
    from policies.registry import get_policy, resolve_policy_name

    assert resolve_policy_name("FIFO") == "fifo" and resolve_policy_name("Gavel") == "gavel"
    assert get_policy("SJF").name == "sjf"
    with pytest.raises(UserError, match="did you mean 'greedy'"):
        resolve_policy_name("gredy")


def test_simulate_accepts_a_policy_name_in_capitals(tmp_path):
    proc = subprocess.run([*SILOD, "simulate", "--max-jobs", "3", "--policy", "FIFO", "--cache-system", "SILOD",
                           "--quiet", "--out", str(tmp_path)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert '"policy": "fifo"' in (tmp_path / "summary.json").read_text()


def test_docs_say_fifo_backfills():
    """FIFO skips a job that does not fit and starts later, smaller ones
    (tests/test_policies.py::test_fifo_keeps_running_jobs_and_backfills); the docs must say so."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "policies.md").read_text()
    fifo = next(line for line in text.split("\n- ") if line.startswith("`fifo`"))
    assert "backfilling" in fifo and "smaller jobs start" in fifo
