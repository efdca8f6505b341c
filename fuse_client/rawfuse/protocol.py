"""The FUSE wire protocol (include/uapi/linux/fuse.h, protocol 7.40+): the part a read-only
file system needs, as struct formats and constants. Little-endian x86-64/arm64 layouts.

Only what the server below uses is here; the header is the source of truth for each layout
(sizes are checked at import, so a typo in a format fails loudly, not on the wire).
"""

from __future__ import annotations

import struct

KERNEL_MAJOR = 7
# The minor version we speak: 7.40 added FUSE_PASSTHROUGH, backing_id in fuse_open_out and
# max_stack_depth in fuse_init_out. Older kernels get their own minor back (and no passthrough).
OUR_MINOR = 40
MIN_KERNEL_MINOR = 31  # 7.31: FUSE_MAX_PAGES and the 64-byte fuse_init_out we send

# -- opcodes -----------------------------------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
GETXATTR = 22
LISTXATTR = 23
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
IOCTL = 39
POLL = 40
BATCH_FORGET = 42
READDIRPLUS = 44
LSEEK = 46
STATX = 52

OPCODE_NAMES = {v: k for k, v in globals().items() if k.isupper() and isinstance(v, int) and 0 < v < 64
                and k not in ("KERNEL_MAJOR", "OUR_MINOR", "MIN_KERNEL_MINOR")}

# -- INIT flags (flags | flags2 << 32) ---------------------------------------------------------
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
SPLICE_WRITE = 1 << 7
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
INIT_EXT = 1 << 30
DIRECT_IO_ALLOW_MMAP = 1 << 36  # 7.39: shared mmap of a FOPEN_DIRECT_IO open (streaming misses)
PASSTHROUGH = 1 << 37

# -- fuse_open_out.open_flags ------------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

# -- /dev/fuse ioctls (_IOR/_IOW(229, nr, type)) ----------------------------------------------
_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (229 << 8) | nr


DEV_IOC_CLONE = _ioc(_IOC_READ, 0, 4)
DEV_IOC_BACKING_OPEN = _ioc(_IOC_WRITE, 1, 16)  # struct fuse_backing_map
DEV_IOC_BACKING_CLOSE = _ioc(_IOC_WRITE, 2, 4)

# -- structs -----------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2 (+ unused[11])
# major minor max_readahead flags max_background congestion_threshold max_write time_gran
# max_pages map_alignment flags2 max_stack_depth unused[6]
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
# ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid gid rdev blksize flags
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
# nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec, then ATTR
ENTRY_OUT = struct.Struct("<QQQQII" + ATTR.format[1:])
ATTR_OUT = struct.Struct("<QII" + ATTR.format[1:])  # attr_valid attr_valid_nsec dummy, then ATTR
OPEN_IN = struct.Struct("<II")  # flags open_flags
OPEN_REPLY = struct.Struct("<IiQQIi")  # OUT_HEADER + OPEN_OUT in one pack (the hot path)
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
RELEASE_IN = struct.Struct("<QIIQ")  # fh flags release_flags lock_owner
FORGET_IN = struct.Struct("<Q")  # nlookup
BATCH_FORGET_IN = struct.Struct("<II")  # count dummy
INTERRUPT_IN = struct.Struct("<Q")  # unique
# blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
DIRENT = struct.Struct("<QQII")  # ino off namelen type, then the name padded to 8 bytes
IOCTL_IN = struct.Struct("<QIIQII")  # fh flags cmd arg in_size out_size
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding

for _s, _size in ((IN_HEADER, 40), (OUT_HEADER, 16), (INIT_OUT, 64), (ATTR, 88), (ENTRY_OUT, 128), (ATTR_OUT, 104),
                  (OPEN_OUT, 16), (OPEN_REPLY, 32), (READ_IN, 40), (RELEASE_IN, 24), (STATFS_OUT, 80), (DIRENT, 24), (IOCTL_IN, 32),
                  (BACKING_MAP, 16)):
    assert _s.size == _size, (_s.format, _s.size, _size)

ROOT_ID = 1
DT_DIR, DT_REG = 4, 8
S_IFDIR, S_IFREG = 0o040000, 0o100000

# Read buffer for requests: the kernel refuses reads shorter than max(8 KiB, header + write_in +
# max_write). A read-only server sets max_write to one page, so 64 KiB is ample (a LOOKUP name
# is at most 1 KiB; a BATCH_FORGET fills at most a page).
MAX_WRITE = 4096
REQUEST_BUFFER = 64 * 1024

# The largest READ the kernel may send: INIT grants max_pages pages (the kernel also caps a
# READ's size at max_read, which a mount without that option leaves unlimited). A READ reply is
# the 16-byte out header plus up to that many bytes, so its buffer is MAX_READ + OUT_HEADER.size:
# a reply the kernel gets short of what it asked is end of file to it, and it shrinks the inode
# (issue 19: a buffer of exactly MAX_READ silently cut files at 1 MiB - 16 bytes).
PAGE_SIZE = 4096
MAX_PAGES_GRANTED = 256
MAX_READ = MAX_PAGES_GRANTED * PAGE_SIZE
READ_REPLY_BUFFER = 16 + MAX_READ


def dirent_size(namelen: int) -> int:
    return (DIRENT.size + namelen + 7) & ~7
