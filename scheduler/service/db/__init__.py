"""Persistence for the scheduler service: SQLAlchemy 2.x models and engine setup.

`open_database(url)` returns an engine whose schema has been brought up to date by the
Alembic migrations in scheduler/service/migrations.
"""

from scheduler.service.db.engine import normalize_url, open_database, upgrade_schema

__all__ = ["normalize_url", "open_database", "upgrade_schema"]
