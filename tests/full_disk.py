"""A real full filesystem for tests of what a failed save must leave behind: a 64 KiB tmpfs
(the tests run as root, as CI does) filled to its last block."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def tiny_tmpfs(where: Path, size: str = "64k") -> Iterator[Path]:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_to_the_last_block(path: Path) -> None:
    """Write `path` until the filesystem refuses (unbuffered, so ENOSPC is met here and not at close)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
