"""/dev/fuse as a device: mount(2) with a FUSE fd, cloned fds, backing-file ioctls, unmount.

Mounting this way needs CAP_SYS_ADMIN (root), as does FUSE_DEV_IOC_BACKING_OPEN (the kernel
only lets a privileged server name backing files, because their reads bypass the server); the
raw front end therefore runs as root only and `--fuse-backend auto` falls back to libfuse
(fusermount3) otherwise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from fuse_client.rawfuse import protocol as p

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2
OVERLAYFS_SUPER_MAGIC = 0x794C7630
ECRYPTFS_SUPER_MAGIC = 0xF15F


class RawFuseUnavailable(OSError):
    """The raw /dev/fuse front end cannot run here (not root, no /dev/fuse, old kernel...)."""


def open_device() -> int:
    try:
        return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RawFuseUnavailable(exc.errno, f"cannot open /dev/fuse: {exc.strerror}") from None


def mount(fd: int, mountpoint: Path, fsname: str, subtype: str, allow_other: bool) -> None:
    """mount(2) a FUSE file system served on `fd` at `mountpoint` (read-only, nosuid, nodev)."""
    if os.geteuid() != 0:
        raise RawFuseUnavailable(errno.EPERM, "the raw FUSE front end mounts with mount(2) and needs root")
    rootmode = stat.S_IFDIR
    opts = f"fd={fd},rootmode={rootmode:o},user_id={os.getuid()},group_id={os.getgid()},default_permissions"
    if allow_other:
        opts += ",allow_other"
    if _libc.mount(fsname.encode(), str(mountpoint).encode(), f"fuse.{subtype}".encode(),
                   MS_RDONLY | MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        e = ctypes.get_errno()
        raise RawFuseUnavailable(e, f"mount(2) of {mountpoint} failed: {os.strerror(e)}")


def unmount(mountpoint: Path, lazy: bool = False) -> bool:
    """umount2; True when it worked (False e.g. with EBUSY while files are open and not lazy)."""
    return _libc.umount2(str(mountpoint).encode(), MNT_DETACH if lazy else 0) == 0


def clone(fd: int) -> int:
    """A new /dev/fuse fd on the same connection (FUSE_DEV_IOC_CLONE): its own reply queue,
    so reader threads do not contend on one fd's lock."""
    new = open_device()
    try:
        fcntl.ioctl(new, p.DEV_IOC_CLONE, struct.pack("<I", fd))
    except OSError:
        os.close(new)
        raise
    return new


def backing_open(dev_fd: int, file_fd: int) -> int:
    """Register `file_fd` as a backing file; returns its backing id (> 0)."""
    arg = bytearray(p.BACKING_MAP.pack(file_fd, 0, 0))
    # The kernel returns the id as the ioctl's result; fcntl.ioctl returns that result when
    # given a mutable buffer with mutate_flag=True.
    return fcntl.ioctl(dev_fd, p.DEV_IOC_BACKING_OPEN, arg, True)


def backing_close(dev_fd: int, backing_id: int) -> None:
    fcntl.ioctl(dev_fd, p.DEV_IOC_BACKING_CLOSE, struct.pack("<I", backing_id))


def stack_depth_for(path: Path) -> int:
    """max_stack_depth to negotiate so that files under `path` can back passthrough opens:
    the kernel refuses a backing file whose file system is stacked as deep as the FUSE mount
    (overlayfs counts 1, so a cache on overlayfs needs 2; ext4/xfs/tmpfs need 1)."""
    ftype = _statfs_type(path)  # os.statvfs has no f_type
    return 2 if ftype in (OVERLAYFS_SUPER_MAGIC, ECRYPTFS_SUPER_MAGIC) else 1


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Statfs)]


def _statfs_type(path: Path) -> int | None:
    buf = _Statfs()
    if _libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        return None
    return buf.f_type & 0xFFFFFFFF


@dataclass(frozen=True)
class KernelFuse:
    """What this kernel's FUSE offered at INIT."""

    minor: int
    flags: int
    max_readahead: int

    @property
    def passthrough(self) -> bool:
        return bool(self.flags & p.PASSTHROUGH)


def kernel_release() -> tuple[int, int]:
    parts = os.uname().release.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0
