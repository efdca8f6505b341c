"""Checks of output paths given on the command line, made before a command does its work.

A simulation or a demo that runs for minutes and then fails to write its result wastes the
user's time; these checks fail first, with one message naming the option and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from estimator.errors import UserError


def ensure_writable_dir(path: Path, option: str) -> Path:
    """Create `path` (and parents) if needed and check that files can be created in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{option} {str(path)!r} exists and is not a directory; give a directory") from None
    except OSError as exc:
        raise UserError(f"{option} {str(path)!r} cannot be created ({exc.strerror}); give a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{option} {str(path)!r} is not writable; give a writable directory")
    return path


def ensure_writable_file(path: Path, option: str) -> Path:
    """Check that `path` can be written: its directory exists and is writable, it is not a directory."""
    if path.is_dir():
        raise UserError(f"{option} {str(path)!r} is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{option} {str(path)!r}: directory {str(parent)!r} does not exist; create it or give another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{option} {str(path)!r} is not writable; give a writable path")
    # os.access answers yes to root everywhere, also where no file can be made (/proc, a
    # read-only mount): open the file for real. An existing file is opened to append nothing;
    # a new one is created and removed again.
    existed = path.exists()
    try:
        with path.open("a" if existed else "x"):
            pass
    except OSError as exc:
        raise UserError(f"{option} {str(path)!r} cannot be written ({exc.strerror}); give a writable path") from None
    if not existed:
        path.unlink(missing_ok=True)
    return path
