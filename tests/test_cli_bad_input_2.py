"""Bad user input to the client and server commands: one clear line naming the input, exit 2, and
nothing done or created (a reviewer's findings: path segments, non-finite numbers, log levels,
tokens and server URLs, `silod secrets` on a wrong directory, non-ASCII digits, a BOM, a
directory where a file belongs)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

from scheduler.cli import main

ADMIN_TOKEN = "bad-input-admin-token-123"
ALICE = "alice-bad-input-token"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def run(monkeypatch, capsys):
    """`silod ARGV` in this process: (exit code, stdout, stderr)."""
    for k in list(os.environ):
        if k.startswith(("SILOD_", "AWS_")) and k != "SILOD_TEST_RUN_ID":
            monkeypatch.delenv(k)

    def _run(*argv: str, **env: str) -> tuple[int, str, str]:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        out, err = capsys.readouterr()
        for k in env:
            monkeypatch.delenv(k)
        return int(exc.value.code or 0), out, err

    return _run


def _is_user_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and needle in err, err
    assert "Traceback" not in err and "bug in silod" not in err, err
    assert 1 <= len([line for line in err.splitlines() if line.strip()]) <= 2, err


# ---------------------------------------------------------------- 1. cancel: the job id is one path segment


def test_path_segment_encodes_slashes_and_dot_segments() -> None:
    from scheduler.service.cli import _path_segment

    assert _path_segment("1/../2") == "1%2F..%2F2"
    assert _path_segment("..") == "%2E%2E" and _path_segment(".") == "%2E"
    assert _path_segment("a?b#c%d") == "a%3Fb%23c%25d"
    assert _path_segment("42") == "42"


# ---------------------------------------------------------------- 2. submit: non-finite numbers


@pytest.mark.parametrize("epochs", ["nan", "inf", "-inf", "0", "-1"])
def test_submit_epochs_must_be_finite_and_positive(run, epochs: str) -> None:
    code, _, err = run("submit", "--name", "a", "--gpus", "1", "--dataset", "d", "--epochs", epochs,
                       "--ideal-throughput", "1GB/s", "--server", f"http://127.0.0.1:{_port()}", "--token", "t" * 10)
    _is_user_error(code, err, "--epochs")
    assert "finite number > 0" in err


@pytest.mark.parametrize(("option", "value"), [("--step-bytes", "nan"), ("--step-bytes", "1e400"),
                                               ("--ideal-throughput", "inf"), ("--cpu-rate", "nan")])
def test_submit_other_numbers_must_be_finite(run, option: str, value: str) -> None:
    args = {"--step-bytes": ["--steps", "10"], "--ideal-throughput": ["--epochs", "1"],
            "--cpu-rate": ["--epochs", "1", "--ideal-throughput", "1GB/s"]}[option]
    code, _, err = run("submit", "--name", "a", "--gpus", "1", "--dataset", "d", *args, option, value,
                       "--server", f"http://127.0.0.1:{_port()}", "--token", "t" * 10)
    _is_user_error(code, err, option)


# ---------------------------------------------------------------- 3. --log-level


def test_log_level_is_checked_by_serve_mount_and_datamanager(run, tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"alice:{ALICE}\n")
    (tmp_path / "mnt").mkdir()
    commands = {
        "serve": ["serve", "--listen", f"127.0.0.1:{_port()}", "--backend", "null", "--gpus", "8", "--cache", "1TB",
                  "--remote-io", "1GB/s", "--tokens", str(tmp_path / "tokens"), "--state-dir", str(tmp_path / "s")],
        "mount": ["mount", str(tmp_path / "mnt"), "--source", str(tmp_path), "--dataset", "d", "--job", "j",
                  "--cache-dir", str(tmp_path / "cache")],
        "datamanager": ["datamanager", "--listen", f"127.0.0.1:{_port()}", "--state", str(tmp_path / "dm")],
        "csi-controller": ["csi-controller", "--socket", str(tmp_path / "csi.sock")],
    }
    for name, argv in commands.items():
        code, _, err = run(*argv, "--log-level", "bogus")
        _is_user_error(code, err, "--log-level 'bogus'")
        assert "debug, info, warning, error, critical" in err, (name, err)


def test_log_level_accepts_any_case() -> None:
    from contract.log_level import parse_log_level

    assert parse_log_level("INFO") == "info" and parse_log_level(" Warning ") == "warning"


# ---------------------------------------------------------------- 4. --token and --server


@pytest.mark.parametrize("command", [["jobs"], ["top", "--once"], ["cancel", "7"],
                                     ["dataset-add", "d", "--uri", "s3://b/d", "--size", "1GB"],
                                     ["submit", "--name", "a", "--gpus", "1", "--dataset", "d", "--epochs", "1",
                                      "--ideal-throughput", "1GB/s"]])
def test_client_commands_check_token_and_server(run, command: list[str]) -> None:
    closed = f"http://127.0.0.1:{_port()}"
    code, _, err = run(*command, "--token", "ジョブ", "--server", closed)
    _is_user_error(code, err, "--token must be printable ASCII")
    assert "ジョブ" not in err  # a token is not echoed
    code, _, err = run(*command, "--server", closed, SILOD_TOKEN="tok\nen-123")
    _is_user_error(code, err, "SILOD_TOKEN must be printable ASCII")
    for server in ("http://[::1", "http://"):
        code, _, err = run(*command, "--server", server, "--token", "x" * 10)
        _is_user_error(code, err, f"--server {server!r} is not a valid URL")


# ---------------------------------------------------------------- 5. silod secrets on a wrong directory


@pytest.mark.parametrize("command", [["secrets", "rotate"], ["secrets", "rotate", "--retire"], ["secrets", "reseal"]])
def test_secrets_refuse_a_state_dir_without_a_service(run, tmp_path: Path, command: list[str]) -> None:
    state = tmp_path / "nonexistent" / "dir"
    code, _, err = run(*command, "--state-dir", str(state))
    _is_user_error(code, err, str(state / "secret.keys"))
    assert "--state-dir of the running `silod serve`" in err
    assert not (tmp_path / "nonexistent").exists()

    # A key file but no database: the database is named, and still nothing is made.
    empty = tmp_path / "keys-only"
    empty.mkdir()
    (empty / "secret.keys").write_text("# keys\n")
    code, _, err = run(*command, "--state-dir", str(empty))
    _is_user_error(code, err, f"database {str(empty / 'silod.db')!r} does not exist")
    assert sorted(p.name for p in empty.iterdir()) == ["secret.keys"]
    code, _, err = run(*command, "--state-dir", str(empty), "--db", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    _is_user_error(code, err, "elsewhere.db")
    assert not (tmp_path / "elsewhere.db").exists()


def test_secrets_still_work_on_a_service_state_dir(run, tmp_path: Path) -> None:
    from scheduler.service.db import open_database
    from scheduler.service.sealed import load_secret_box

    state = tmp_path / "state"
    state.mkdir()
    open_database(f"sqlite:///{state / 'silod.db'}").dispose()  # what `silod serve` leaves
    load_secret_box(state)
    before = (state / "secret.keys").read_text()
    code, out, err = run("secrets", "rotate", "--state-dir", str(state))
    assert code == 0 and "new key in place" in out, err
    assert (state / "secret.keys").read_text() != before
    code, out, err = run("secrets", "reseal", "--state-dir", str(state))
    assert code == 0 and "re-sealed" in out, err


# ---------------------------------------------------------------- 6. --default-quota digits


@pytest.mark.parametrize("value", ["gpus=²", "running=٣", "queued=１"])
def test_default_quota_takes_ascii_digits_only(value: str) -> None:
    from estimator.errors import UserError
    from scheduler.service.cli import parse_quota

    with pytest.raises(UserError, match="must be a whole number >= 0"):
        parse_quota(value)
    assert parse_quota("gpus=8,running=4").gpus == 8


@pytest.mark.parametrize("value, says", [
    ("min_work=-5GB", "min_work '-5GB' is negative"),
    ("min_work=abc", "min_work 'abc' is not a size"),
    ("max_work=10tb", "max_work '10tb' is ambiguous"),
    ("min_work=1e400", "min_work '1e400' is not a finite number"),
    ("min_work=2GB,max_work=1GB", "min_work is above max_work"),
])
def test_default_quota_work_range_bad_values_name_the_key(value: str, says: str) -> None:
    from estimator.errors import UserError
    from scheduler.service.cli import parse_quota

    with pytest.raises(UserError, match=re.escape(says)):
        parse_quota(value)


def test_serve_default_quota_superscript_is_a_user_error(run, tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"alice:{ALICE}\n")
    code, _, err = run("serve", "--listen", f"127.0.0.1:{_port()}", "--backend", "null", "--gpus", "8", "--cache", "1TB",
                       "--remote-io", "1GB/s", "--tokens", str(tmp_path / "tokens"), "--state-dir", str(tmp_path / "s"),
                       "--default-quota", "gpus=²")
    _is_user_error(code, err, "--default-quota gpus='²' must be a whole number >= 0")


# ---------------------------------------------------------------- 7. tokens file with a BOM


def test_tokens_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    from scheduler.service.api.auth import parse_tokens_file

    f = tmp_path / "tokens"
    f.write_bytes("\ufeffalice:alice-token-123\nbob:bob-token-4567\n".encode())
    assert parse_tokens_file(f) == [("alice", "alice-token-123"), ("bob", "bob-token-4567")]


# ---------------------------------------------------------------- 8. a directory where a file belongs


def test_serve_token_key_that_is_a_directory(run, tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"alice:{ALICE}\n")
    (tmp_path / "s" / "token.key").mkdir(parents=True)
    code, _, err = run("serve", "--listen", f"127.0.0.1:{_port()}", "--backend", "null", "--gpus", "8", "--cache", "1TB",
                       "--remote-io", "1GB/s", "--tokens", str(tmp_path / "tokens"), "--state-dir", str(tmp_path / "s"),
                       SILOD_ADMIN_TOKEN=ADMIN_TOKEN)
    _is_user_error(code, err, f"{str(tmp_path / 's' / 'token.key')!r} is a directory; it must be a file")


def test_datamanager_state_json_that_is_a_directory(run, tmp_path: Path) -> None:
    (tmp_path / "dm" / "state.json").mkdir(parents=True)
    code, _, err = run("datamanager", "--listen", f"127.0.0.1:{_port()}", "--state", str(tmp_path / "dm"))
    _is_user_error(code, err, f"{str(tmp_path / 'dm' / 'state.json')!r} is a directory; it must be a file")


def test_serve_max_body_below_a_submission_is_refused(run, tmp_path: Path) -> None:
    """--max-body 0 started a server that answered every POST with 413."""
    (tmp_path / "tokens").write_text(f"alice:{ALICE}\n")
    for value in ("0", "100B"):
        code, _, err = run("serve", "--listen", f"127.0.0.1:{_port()}", "--backend", "null", "--gpus", "8", "--cache", "1TB",
                           "--remote-io", "1GB/s", "--tokens", str(tmp_path / "tokens"), "--state-dir", str(tmp_path / "s"),
                           "--max-body", value)
        _is_user_error(code, err, "--max-body")
        assert "1KiB" in err
