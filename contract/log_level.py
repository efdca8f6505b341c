"""The `--log-level` every silod command takes (serve, mount, datamanager, the node agent): one
set of names, checked before anything starts, so a typo is a clear error rather than a
traceback from `logging` or uvicorn."""

from __future__ import annotations

from estimator.errors import UserError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def parse_log_level(value: str, option: str = "--log-level") -> str:
    """A level name in any case -> lower case (uvicorn's spelling; `logging` takes `.upper()`)."""
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        raise UserError(f"{option} {value!r} is not a log level; choose one of: {', '.join(LOG_LEVELS)}")
    return level
