"""What people read and where files land: the demo's live table fits 80 columns (all columns
with --wide), and `silod serve` keeps its state in a per-user directory, never the current one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console

from scheduler.demo import COLUMNS, JobRow, render_table

# The widest values each cell can take in the demo (names, states, sizes and rates as formatted).
WIDEST = JobRow(job="resnet-a1", data="B", ideal="10MB/s", state="cancelled", done="100%", epoch="12",
                gpus="1/1", cache="1.34MB own", io_cap="12.3MB/s", hit="100%", speed="10.5MB/s")
TITLE = "storage-unaware: policy fifo, 4 GPUs, cache 40MB, remote IO 12MB/s"


def _render(wide: bool, width: int) -> list[str]:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    console.print(render_table(TITLE, [WIDEST] * 4, wide=wide))
    return console.export_text().splitlines()


def test_demo_table_fits_80_columns_without_truncating():
    lines = _render(wide=False, width=80)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert "…" not in text  # rich elides cells that do not fit: every value must be whole
    for value in ("resnet-a1", "cancelled", "1.34MB own", "12.3MB/s", "10.5MB/s"):
        assert value in text


def test_demo_table_wide_shows_every_column():
    text = "\n".join(_render(wide=True, width=200))
    for header, _, _ in COLUMNS:
        assert header in text
    narrow = "\n".join(_render(wide=False, width=200))
    assert "f*" not in narrow and " ep " not in narrow


def test_default_state_dir_follows_xdg(monkeypatch, tmp_path):
    from scheduler.service.cli import default_state_dir

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "silod"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")  # the spec says: ignore relative paths
    assert default_state_dir() == Path.home() / ".local" / "state" / "silod"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir() == Path.home() / ".local" / "state" / "silod"


def test_serve_defaults_leave_nothing_in_the_current_directory(monkeypatch, tmp_path):
    from scheduler.service.cli import build_service

    cwd = tmp_path / "checkout"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    service = build_service(db=None, backend="null", policy="fifo", round_s=60, gpus="4", cache="1TB", remote_io="1GB/s")
    try:
        assert str(service.engine.url.database) == str(tmp_path / "xdg" / "silod" / "silod.db")
    finally:
        service.close()
    assert os.listdir(cwd) == []
    assert (tmp_path / "xdg" / "silod" / "silod.db").is_file()


def test_unwritable_state_dir_is_a_user_error(tmp_path):
    from estimator.errors import UserError
    from scheduler.service.cli import build_service

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="--state-dir"):
        build_service(db=None, backend="null", policy="fifo", round_s=60, gpus="4", cache="1TB", remote_io="1GB/s",
                      state_dir=blocker / "state")


def test_piped_demo_and_headline_tables_are_printed_at_their_own_width(tmp_path):
    """Piped, the demo's --wide table used to be squeezed into 80 columns (cells cut to 'ru…',
    columns shrunk to nothing: '┃  ┃┃ ┃'). The commands print tables through
    scheduler.console.table_console, run here in a process whose stdout is a pipe."""
    import subprocess
    import sys

    code = (
        "from scheduler.console import table_console\n"
        "from scheduler.demo import JobRow, render_table\n"
        "from scheduler.sim.cli import _print_headlines\n"
        "row = JobRow(job='resnet50-imagenet-a-long-name', data='A', ideal='114MB/s', state='running', done='12%',"
        " epoch='3', gpus='2/2', cache='143GB own', io_cap='47.6MB/s', hit='71%', speed='112.3MB/s', cores='4.0',"
        " bound='remote_io')\n"
        "table_console().print(render_table('t', [row], wide=True))\n"
        "_print_headlines([('matrix', 'a setup', [('SiloD vs the storage-unaware baseline, average JCT', '1.23x')])])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    headers = [h.strip() for h in next(line for line in lines if "job" in line and "┃" in line).strip("┃").split("┃")]
    assert headers == [h for h, _, _ in COLUMNS]  # every column, none shrunk to nothing
    row = next(line for line in lines if "resnet50-imagenet-a-long-name" in line)
    assert [c.strip() for c in row.strip("│").split("│")] == [
        "resnet50-imagenet-a-long-name", "A", "114MB/s", "running", "12%", "3", "2/2", "143GB own", "47.6MB/s", "71%",
        "112.3MB/s", "4.0", "remote_io"]
    assert any("SiloD vs the storage-unaware baseline, average JCT" in line for line in lines)
    # COLUMNS, when set, still decides the width.
    narrow = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**env, "COLUMNS": "60"})
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 60
