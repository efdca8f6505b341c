"""Open files of a `file://` source beneath its root, never following a symlink out of it.

An allowed `file:///srv/datasets/` prefix must not become a way to read `/etc/shadow` through a
symlink a dataset's owner planted inside it (the mount runs as root). Every open of an item is
openat2(2) relative to a descriptor of the dataset root with RESOLVE_BENEATH: the kernel refuses
(EXDEV) any resolution that leaves the root, atomically, so a symlink swapped between a check and
the open does not help. RESOLVE_BENEATH also refuses absolute symlinks that lead back inside; for
those the real path is resolved and, if it is beneath the root, opened again with RESOLVE_BENEATH
(so the final open is still checked by the kernel). RESOLVE_NO_MAGICLINKS refuses
/proc/self/fd-style links.

Kernels before 5.6 have no openat2: there each open resolves the real path and checks that it
lies beneath the root's real path (an open racing a symlink swap could still escape there; the
mount logs once that it runs in this weaker mode).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import platform

log = logging.getLogger(__name__)

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
# openat2 is 437 in the generic syscall table, which x86-64 and arm64 share for new calls.
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(platform.machine())

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_have_openat2: bool | None = None if _SYS_OPENAT2 else False


class OutsideRoot(PermissionError):
    """A path that resolves outside the dataset root."""


def _openat2(dir_fd: int, rel: str, flags: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), rel.encode("utf-8", "surrogateescape"),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), rel)
    return int(fd)


def open_beneath(root_fd: int, root_path: str, rel: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of `rel` under the directory `root_fd` (whose path is `root_path`); raises
    OutsideRoot when the path leaves the root (by `..`, an absolute path or any symlink)."""
    global _have_openat2
    rel = rel.lstrip("/") or "."
    if _have_openat2 is not False:
        try:
            fd = _openat2(root_fd, rel, flags)
            _have_openat2 = True
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS) or (exc.errno == errno.ENOSYS and _have_openat2):
                raise
            if exc.errno == errno.ENOSYS:
                _have_openat2 = False
                log.warning("this kernel has no openat2(2): file:// sources are checked by real path on every open "
                            "(a symlink swapped during an open could still escape the root)")
    # EXDEV: the path has an absolute symlink (or `..`) - fine if where it leads is still beneath
    # the root (datasets built with absolute links inside themselves). Resolve it, and open the
    # resolved path again beneath the root: if a link was swapped meanwhile, the kernel refuses.
    real_root = os.path.realpath(f"/proc/self/fd/{root_fd}")
    real = os.path.realpath(os.path.join(real_root, rel))
    inside = os.path.relpath(real, real_root)
    if inside == ".." or inside.startswith("../") or os.path.isabs(inside):
        raise OutsideRoot(errno.EACCES, f"{rel!r} resolves outside the dataset root {root_path!r}")
    if _have_openat2:
        try:
            return _openat2(root_fd, inside, flags)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise OutsideRoot(errno.EACCES, f"{rel!r} resolves outside the dataset root {root_path!r}") from None
            raise
    return os.open(real, flags | os.O_CLOEXEC | os.O_NOFOLLOW)


def open_root(path: str, prefix: str | None = None) -> int:
    """An O_PATH descriptor of the dataset root `path`; with `prefix` (an operator's allowed
    directory that contains `path`), `path` is itself resolved beneath the prefix, so the
    root cannot be a symlink out of it either."""
    if prefix is None:
        return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    prefix_fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rest = os.path.relpath(path, prefix)
        if rest == "." :
            return os.dup(prefix_fd)
        return open_beneath(prefix_fd, prefix, rest, os.O_PATH | os.O_DIRECTORY)
    finally:
        os.close(prefix_fd)
