"""The public traces a user can get from a clone (issue 48, Build item 6).

Gavel's msr traces ship in traces/gavel-msr with their MIT licence and a README whose tables are
checked here against the files. Alibaba's openb trace is fetched by `silod trace fetch
alibaba-openb`: the tests serve the copy in ../shared/traces/alibaba-openb from a real HTTP server
on 127.0.0.1 (`--base-url`; the same SHA-256 pins as GitHub's files), and a tampered copy, a dead
port and a 404 each fail with one clear line and leave the destination as it was.
"""

from __future__ import annotations

import ast
import collections
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from test_simulate_cli import _shared_traces  # noqa: E402 - shared/ beside this clone or its origin

REPO = Path(__file__).resolve().parents[1]
GAVEL = REPO / "traces" / "gavel-msr"
OPENB = _shared_traces() / "alibaba-openb"
needs_openb = pytest.mark.skipif(not OPENB.is_dir() and os.environ.get("CI") != "true",
                                 reason="the shared openb trace is not on this machine")


def silod(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scheduler", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


# ---------------------------------------------------------------- shipped: Gavel msr


def test_the_msr_traces_ship_with_their_mit_licence():
    assert "MIT License" in (GAVEL / "LICENSE").read_text()
    assert "Stanford Future Data Systems" in (GAVEL / "LICENSE").read_text()
    traces = sorted(p.stem for p in GAVEL.glob("*.trace"))
    assert len(traces) == 15 and (GAVEL / "simulation_throughputs.json").is_file()
    # package data: a wheel carries them too
    assert '"gavel-msr/*"' in (REPO / "pyproject.toml").read_text()


def _table(text: str, heading: str) -> list[list[str]]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    body = []
    for line in rows[2:]:
        body.append([c.strip() for c in line.strip("|").split("|")])
    return body


def _entries() -> dict[str, set[int]]:
    table = json.loads((GAVEL / "simulation_throughputs.json").read_text())["v100"]
    out: dict[str, set[int]] = collections.defaultdict(set)
    for key in table:
        job_type, gpus = ast.literal_eval(key)
        out[job_type].add(gpus)
    return out


def test_the_readme_says_what_the_throughput_table_holds():
    """Issue 46 found the shared README wrong (it said every type has 1/2/4/8-GPU entries and
    '103-197 jobs per trace'): the shipped README's table is checked against the JSON."""
    readme = (GAVEL / "README.md").read_text()
    entries = _entries()
    claimed: dict[str, set[int]] = {}
    for types, counts in _table(readme, "## What the throughput table holds"):
        m = re.fullmatch(r"(.+?)(?: \(batch size ([\d, ]+)\))?", types)
        family, sizes = m.group(1), m.group(2)
        names = [family] if sizes is None else [f"{family} (batch size {s.strip()})" for s in sizes.split(",")]
        for name in names:
            claimed[name] = {int(c) for c in counts.split(",")}
    assert claimed == dict(entries)


def test_the_readme_counts_each_trace_s_jobs_as_the_files_hold_them():
    entries = _entries()
    rows = _table((GAVEL / "README.md").read_text(), "## The traces")
    assert sorted(r[0] for r in rows) == sorted(p.stem for p in GAVEL.glob("*.trace"))
    for vc, jobs, days, counts, one_gpu_type, other in rows:
        lines = [line.split("\t") for line in (GAVEL / f"{vc}.trace").read_text().splitlines() if line.strip()]
        gpus = [int(c[6]) for c in lines]
        missing = [(c[0], int(c[6])) for c in lines if int(c[6]) not in entries[c[0]]]
        n_one = sum(1 for t, _ in missing if entries[t] == {1})
        assert int(jobs.replace(",", "")) == len(lines), vc
        assert float(days) == round(max(float(c[5]) for c in lines) / 86400, 1), vc
        assert {int(c) for c in counts.split(",")} == set(gpus), vc
        assert (int(one_gpu_type), int(other)) == (n_one, len(missing) - n_one), vc


def test_silod_trace_path_names_the_shipped_folder_and_a_simulation_reads_it(tmp_path):
    proc = silod("trace", "path", "gavel-msr")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == GAVEL
    out = tmp_path / "o"
    sim = silod("simulate", "--trace", str(GAVEL / "795a4c.trace"), "--gpus", "8", "--out", str(out), "--quiet")
    assert sim.returncode == 0, sim.stderr
    assert json.loads((out / "summary.json").read_text())["jobs"] == 3


@pytest.mark.parametrize("args", [
    ["simulate", "--trace", "missing/6c71a0.trace", "--format", "gavel"],
    ["simulate", "--trace", "missing.csv"],
    ["simulate", "--trace", "missing-openb", "--format", "alibaba-openb"],
    ["experiment", "matrix", "--trace", "missing/6c71a0.trace"],
    ["experiment", "alibaba", "--trace", "missing-openb"],
])
def test_a_missing_trace_names_where_to_get_it(tmp_path, args):
    """The error used to repeat the missing path as its own fix ('pass --trace
    ../shared/traces/...'); now it names the shipped folder or the fetch command."""
    proc = silod(*args, "--out", str(tmp_path / "o"), "--quiet", cwd=tmp_path,
                 env={"SILOD_TRACES_DIR": str(tmp_path / "fetched")})
    assert proc.returncode == 2, proc.stderr
    assert "silod trace fetch alibaba-openb" in proc.stderr
    if "alibaba" not in " ".join(args):
        assert str(GAVEL) in proc.stderr
    assert "shared/traces" not in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- fetched: Alibaba openb


class _Server:
    """A real HTTP server on 127.0.0.1 serving one folder (http.server)."""

    def __init__(self, root: Path):
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/csv"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _mirror(tmp_path: Path, tamper: str | None = None, drop: str | None = None) -> Path:
    root = tmp_path / "mirror"
    (root / "csv").mkdir(parents=True)
    for f in OPENB.glob("*.csv"):
        if f.name != drop:
            shutil.copy(f, root / "csv" / f.name)
    if tamper:
        path = root / "csv" / tamper
        data = bytearray(path.read_bytes())
        data[100] ^= 0x01  # one bit of one task row: same size, another SHA-256
        path.write_bytes(bytes(data))
    return root


@needs_openb
def test_the_pins_are_the_shared_copy_s_sha256_and_github_s_raw_urls():
    from traces.public import ALIBABA_OPENB

    assert re.fullmatch(r"[0-9a-f]{40}", ALIBABA_OPENB.commit)
    for f in ALIBABA_OPENB.files:
        data = (OPENB / f.name).read_bytes()
        assert (f.size, f.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        assert ALIBABA_OPENB.url(f) == ("https://raw.githubusercontent.com/alibaba/clusterdata/"
                                        f"{ALIBABA_OPENB.commit}/cluster-trace-gpu-v2023/csv/{f.name}")


@needs_openb
def test_fetch_downloads_checks_and_refuses_to_overwrite(tmp_path):
    dest = tmp_path / "openb"
    with _Server(_mirror(tmp_path)) as server:
        proc = silod("trace", "fetch", "alibaba-openb", "--dest", str(dest), "--base-url", server.url)
        assert proc.returncode == 0, proc.stderr
        assert "2 files checked" in proc.stdout
        for f in OPENB.glob("*.csv"):
            assert (dest / f.name).read_bytes() == f.read_bytes()
        assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in OPENB.glob("*.csv"))  # no leftovers
        # Again: refused without --force, nothing touched.
        (dest / "openb_node_list_gpu_node.csv").write_text("mine\n")
        again = silod("trace", "fetch", "alibaba-openb", "--dest", str(dest), "--base-url", server.url)
        assert again.returncode == 2 and "--force" in again.stderr, again.stderr
        assert (dest / "openb_node_list_gpu_node.csv").read_text() == "mine\n"
        forced = silod("trace", "fetch", "alibaba-openb", "--dest", str(dest), "--base-url", server.url, "--force")
        assert forced.returncode == 0, forced.stderr
        assert (dest / "openb_node_list_gpu_node.csv").read_bytes() == (OPENB / "openb_node_list_gpu_node.csv").read_bytes()


@needs_openb
def test_the_default_destination_is_where_experiment_alibaba_looks(tmp_path, monkeypatch):
    monkeypatch.setenv("SILOD_TRACES_DIR", str(tmp_path / "traces"))
    with _Server(_mirror(tmp_path)) as server:
        proc = silod("trace", "fetch", "alibaba-openb", env={"SILOD_TRACE_BASE_URL": server.url})
        assert proc.returncode == 0, proc.stderr
    where = silod("trace", "path", "alibaba-openb")
    assert where.returncode == 0 and Path(where.stdout.strip()) == tmp_path / "traces" / "alibaba-openb"
    import scheduler.sim.experiments as ex

    runner = ex.ExperimentRunner(None, None, 5, 360.0, 128, show_progress=False, workers=1)
    assert ex.alibaba_source(runner).path == str(tmp_path / "traces" / "alibaba-openb" / "openb_pod_list_default.csv")


@needs_openb
@pytest.mark.parametrize("case", ["tampered", "missing-file", "no-server"])
def test_a_bad_download_fails_clearly_and_writes_nothing(tmp_path, case):
    dest = tmp_path / "openb"
    if case == "no-server":
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/csv"
        proc = silod("trace", "fetch", "alibaba-openb", "--dest", str(dest), "--base-url", url)
        expected = "could not download"
    else:
        root = _mirror(tmp_path, tamper="openb_pod_list_default.csv" if case == "tampered" else None,
                       drop="openb_node_list_gpu_node.csv" if case == "missing-file" else None)
        with _Server(root) as server:
            proc = silod("trace", "fetch", "alibaba-openb", "--dest", str(dest), "--base-url", server.url)
        expected = "SHA-256" if case == "tampered" else "HTTP 404"
    assert proc.returncode == 1, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3  # the progress lines and one error
    assert not dest.exists()  # nothing written, not even the folder


def test_trace_path_of_a_trace_not_fetched_names_the_command(tmp_path):
    proc = silod("trace", "path", "alibaba-openb", env={"SILOD_TRACES_DIR": str(tmp_path)})
    assert proc.returncode == 2 and "run `silod trace fetch alibaba-openb` first" in proc.stderr, proc.stderr


def test_fetch_of_an_unknown_trace_names_the_known_ones(tmp_path):
    proc = silod("trace", "fetch", "alibaba-openc", "--dest", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert "did you mean 'alibaba-openb'" in proc.stderr and "traces/gavel-msr" in proc.stderr
