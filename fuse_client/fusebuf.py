"""Zero-copy reads for mfusepy: answer `read_buf` with a file descriptor instead of bytes.

With the plain `read` callback every byte passes through a Python `bytes` object and a
`memmove`. With `read_buf` we hand libfuse a `fuse_bufvec` that names (fd, offset, size) of the
local cache file; libfuse then moves the data from the page cache to /dev/fuse itself (with
splice(2) when the kernel allows it), so Python only spends a few microseconds per request no
matter how large the request is. libfuse frees the bufvec with free(), hence the malloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import mfusepy

FUSE_BUF_IS_FD = 1 << 1
FUSE_BUF_FD_SEEK = 1 << 2
FUSE_BUF_FD_RETRY = 1 << 3
FUSE_CAP_SPLICE_WRITE = 1 << 7
FUSE_CAP_SPLICE_MOVE = 1 << 8


class _FuseBuf(ctypes.Structure):
    # struct fuse_buf in fuse_common.h (libfuse 3.x)
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("flags", ctypes.c_int),
        ("mem", ctypes.c_void_p),
        ("fd", ctypes.c_int),
        ("pos", ctypes.c_int64),
    ]


class _FuseBufvec(ctypes.Structure):
    # struct fuse_bufvec: the buf member is an inline array of one (mfusepy declares a pointer).
    _fields_ = [
        ("count", ctypes.c_size_t),
        ("idx", ctypes.c_size_t),
        ("off", ctypes.c_size_t),
        ("buf", _FuseBuf * 1),
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_BUFVEC_SIZE = ctypes.sizeof(_FuseBufvec)


def reply_with_fd(bufpp, fd: int, size: int, offset: int) -> int:
    """Fill `*bufpp` with a one-buffer bufvec reading `size` bytes of `fd` at `offset`."""
    address = _libc.malloc(_BUFVEC_SIZE)
    if not address:
        return -12  # ENOMEM
    vec = _FuseBufvec.from_address(address)
    vec.count, vec.idx, vec.off = 1, 0, 0
    buf = vec.buf[0]
    buf.size = size
    buf.flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK | FUSE_BUF_FD_RETRY
    buf.mem = None
    buf.fd = fd
    buf.pos = offset
    bufpp[0] = ctypes.cast(address, mfusepy.fuse_bufvec_p)
    return 0


def enable_splice(conn) -> None:
    """Ask libfuse to splice fd-backed replies into /dev/fuse when the kernel supports it."""
    if conn is not None:
        conn.want |= conn.capable & FUSE_CAP_SPLICE_WRITE


_pinned_threads: set[int] = set()
_gil_ensure = ctypes.pythonapi.PyGILState_Ensure


def pin_thread_state() -> None:
    """Keep the Python thread state of a libfuse worker thread alive between callbacks.

    libfuse's workers are threads Python did not create. For each callback, ctypes creates a
    Python thread state and destroys it on return, which costs tens of microseconds - more than
    the callback's own work for open/release of a cached file. Taking one extra, never released
    PyGILState reference per worker keeps its thread state for the thread's lifetime (a few KB
    per worker; libfuse keeps a small pool of workers). Measured: 4.2k -> 6.5k opens/s.
    """
    ident = threading.get_ident()
    if ident not in _pinned_threads:
        _gil_ensure()
        _pinned_threads.add(ident)
