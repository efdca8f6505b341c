"""Engine construction and schema migration.

SQLite is the default: one file, WAL journal so readers (GET /v1/jobs) never wait for the
writer (the scheduling round), and a busy timeout so a second connection waits instead of
failing. PostgreSQL is reached through psycopg 3.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event

from estimator.errors import UserError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def normalize_url(url: str) -> str:
    """Accept `sqlite:///path`, a bare file path, and `postgresql://` (mapped to psycopg 3)."""
    url = url.strip()
    if not url:
        raise UserError("--db is empty; give sqlite:///path/to/silod.db or postgresql+psycopg://user@host/db")
    if "://" not in url:
        return f"sqlite:///{url}"
    scheme = url.split("://", 1)[0]
    if scheme in ("postgresql", "postgres"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    if scheme.startswith("sqlite") or scheme.startswith("postgresql+psycopg"):
        return url
    raise UserError(f"unsupported database URL scheme {scheme!r}; use sqlite:///FILE or postgresql+psycopg://...")


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    # NORMAL is durable against process crashes under WAL (only an OS crash can lose the last
    # commits) and makes a commit ~10x cheaper than FULL: 1,000 submissions must take seconds.
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def private_sqlite_files(path: Path) -> None:
    """The database file created 0600 before SQLite opens it (SQLite creates the -wal and -shm
    files with the database file's mode), and existing files made 0600: they hold tokens'
    digests, sealed secrets and every tenant's jobs (issue 20: `nobody` read the -wal file)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return  # SQLite reports the real problem, naming the file
    os.close(fd)
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"),
              path.with_name(path.name + "-journal")):
        try:
            if f.stat().st_mode & 0o077:
                f.chmod(0o600)
        except OSError:
            pass  # absent, or not ours: SQLite answers for it


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        if url in ("sqlite://", "sqlite:///:memory:"):
            raise UserError("an in-memory SQLite database would lose every job at exit; give a file: sqlite:///silod.db")
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise UserError(f"database directory {Path(path).parent} does not exist; create it or pass another --db")
        if path:
            private_sqlite_files(Path(path.split("?", 1)[0]).expanduser())
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=20,
            max_overflow=20,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True)


def upgrade_schema(engine: Engine) -> None:
    """Run the Alembic migrations up to head (idempotent)."""
    import logging

    # Alembic logs its plug-ins (when imported) and migration context at INFO on every start
    # (nine lines with nothing to act on); its warnings and a migration's own errors still show.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            # A batch migration on SQLite rebuilds a table (copy, drop, rename); with foreign keys
            # enforced, dropping a table other rows reference fails. SQLite's documented procedure
            # turns enforcement off for the rebuild (it cannot change inside a transaction) and
            # checks every reference before committing.
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        try:
            with connection.begin():
                cfg.attributes["connection"] = connection
                command.upgrade(cfg, "head")
                if sqlite:
                    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"the schema migration left rows with broken references: {broken[:5]}")
        finally:
            if sqlite:
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()


def open_database(url: str) -> Engine:
    """An engine for `url` with the schema at the latest migration. Errors name the URL."""
    from sqlalchemy.exc import OperationalError

    engine = make_engine(url)
    try:
        upgrade_schema(engine)
    except OperationalError as exc:
        engine.dispose()
        safe = engine.url.render_as_string(hide_password=True)
        raise UserError(f"cannot open database {safe}: {exc.orig}") from exc
    return engine
