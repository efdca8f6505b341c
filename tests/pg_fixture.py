"""A real PostgreSQL server for the database tests.

Where the server comes from, in order:
1. env SILOD_TEST_PG_URL, e.g. postgresql+psycopg://postgres@127.0.0.1:5432/postgres
   (the role must be allowed to CREATE DATABASE);
2. otherwise a throwaway server: `initdb` + `pg_ctl` from /usr/lib/postgresql/*/bin (Debian
   package `postgresql`) or PATH, in a temp dir, on a free port of 127.0.0.1, run as the
   `postgres` user when we are root (initdb refuses root); stopped at interpreter exit.
Each test gets a fresh database (`pg_url`) that is dropped afterwards.

Under CI=true a missing server FAILS the test instead of skipping it.

Fixtures: `pg_url` (a fresh PostgreSQL database URL) and `db_url` (parametrised: a SQLite file,
then a PostgreSQL database). Import them into a test module or a conftest:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
"""

from __future__ import annotations

import atexit
import glob
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_server_url: str | None = None
_server_error: str | None = None
_stop_server = None  # set when we started a throwaway server


def _find_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return found[-1] if found else shutil.which(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_throwaway() -> str:
    initdb, pg_ctl = _find_bin("initdb"), _find_bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise RuntimeError("no initdb/pg_ctl found (apt-get install postgresql) and SILOD_TEST_PG_URL is not set")
    tmp = Path(tempfile.mkdtemp(prefix="silod-pg-"))
    as_root = os.geteuid() == 0
    if as_root:
        import pwd

        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise RuntimeError("running as root but there is no 'postgres' user to run initdb as") from None
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
    data = tmp / "data"

    def command(args: list[str]) -> list[str]:
        if not as_root:
            return args
        if shutil.which("runuser"):
            return ["runuser", "-u", "postgres", "--", *args]
        return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(args)]

    def run(args: list[str]) -> None:
        proc = subprocess.run(command(args), capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {proc.stderr.strip() or proc.stdout.strip()}")

    run([initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
    port = _free_port()
    # fsync off: a test database need not survive a power cut, and tests get much faster.
    opts = f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c max_connections=200"
    run([pg_ctl, "-D", str(data), "-l", str(tmp / "server.log"), "-o", opts, "-w", "-t", "60", "start"])

    def stop() -> None:
        if not data.exists():
            return  # already stopped (session end and atexit both call this)
        subprocess.run(command([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    global _stop_server
    _stop_server = stop
    atexit.register(stop)
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"


class PrivateServer:
    """A throwaway PostgreSQL server of one test's own, which the test may stop and start again
    (the database-outage tests); the shared server above must never be stopped mid-session."""

    def __init__(self) -> None:
        initdb, self.pg_ctl = _find_bin("initdb"), _find_bin("pg_ctl")
        if not initdb or not self.pg_ctl:
            raise RuntimeError("no initdb/pg_ctl found (apt-get install postgresql)")
        self.tmp = Path(tempfile.mkdtemp(prefix="silod-pg-own-"))
        self.as_root = os.geteuid() == 0
        if self.as_root:
            import pwd

            pw = pwd.getpwnam("postgres")
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
        self.data = self.tmp / "data"
        self.port = _free_port()
        self._run([initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
        self.start()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _command(self, args: list[str]) -> list[str]:
        if not self.as_root:
            return args
        if shutil.which("runuser"):
            return ["runuser", "-u", "postgres", "--", *args]
        return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(args)]

    def _run(self, args: list[str]) -> None:
        proc = subprocess.run(self._command(args), capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {proc.stderr.strip() or proc.stdout.strip()}")

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.tmp} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        self._run([self.pg_ctl, "-D", str(self.data), "-l", str(self.tmp / "server.log"), "-o", opts, "-w", "-t", "60", "start"])

    def stop(self) -> None:
        self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def destroy(self) -> None:
        subprocess.run(self._command([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def private_pg() -> Iterator[PrivateServer]:
    """A PostgreSQL server this test alone uses and may stop/start."""
    try:
        server = PrivateServer()
    except Exception as exc:
        _unavailable(str(exc))
    try:
        yield server
    finally:
        server.destroy()


def pg_server_url() -> str:
    """The admin URL of a running server (started once per process); raises RuntimeError."""
    global _server_url, _server_error
    if _server_url is None and _server_error is None:
        try:
            _server_url = os.environ.get("SILOD_TEST_PG_URL") or _start_throwaway()
        except Exception as exc:  # remembered, so every test reports the same reason quickly
            _server_error = str(exc)
    if _server_url is None:
        raise RuntimeError(_server_error or "no PostgreSQL server")
    return _server_url


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL is required under CI=true: {reason}")
    pytest.skip(f"no PostgreSQL server: {reason}")


@pytest.fixture(scope="session")
def _pg_session() -> Iterator[None]:
    """Stops a throwaway server at the end of the session (atexit is the fallback)."""
    yield
    if _stop_server is not None:
        _stop_server()


@pytest.fixture
def pg_url(_pg_session: None) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    import sqlalchemy as sa

    try:
        admin = pg_server_url()
    except RuntimeError as exc:
        _unavailable(str(exc))
    name = f"silod_test_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(sa.make_url(admin).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        engine.dispose()
        _unavailable(f"cannot create a test database on {admin}: {exc}")
    url = sa.make_url(admin).set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same test on a real SQLite file and on a real PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'silod.db'}"
    return request.getfixturevalue("pg_url")
