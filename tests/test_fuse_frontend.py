"""Choosing the FUSE front end (--fuse-backend), without mounting: the raw server is only picked
where it can work, and forcing it where it cannot is a clear error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from estimator.errors import UserError
from fuse_client import frontend as frontend_mod
from fuse_client.rawfuse import device
from fuse_client.rawfuse import protocol as p


@dataclass
class _Cfg:
    fuse_backend: str
    passthrough: bool = True
    mountpoint: Path = Path("/nonexistent-mountpoint")
    dataset: str = "ds"
    allow_other: bool = False
    fuse_threads: int = 4


class _Ops:  # Frontend only hands it to the server, which fails before serving in these cases
    listing = None
    mtime_ns = 0


def test_auto_uses_libfuse_with_no_passthrough_when_not_root_and_on_old_kernels(monkeypatch):
    f = frontend_mod.Frontend(_Cfg("auto", passthrough=False), _Ops(), Path("/tmp"))
    f.prepare()
    assert f.raw is None and f.backend == "libfuse" and f.fallback_reason == "--no-passthrough"

    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    f = frontend_mod.Frontend(_Cfg("auto"), _Ops(), Path("/tmp"))
    f.prepare()
    assert f.raw is None and "not root" in f.fallback_reason

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(device, "kernel_release", lambda: (6, 8))
    f = frontend_mod.Frontend(_Cfg("auto"), _Ops(), Path("/tmp"))
    f.prepare()
    assert f.raw is None and "older than 6.9" in f.fallback_reason
    assert "libfuse" in f.describe()


def test_libfuse_backend_never_builds_the_raw_server():
    f = frontend_mod.Frontend(_Cfg("libfuse"), _Ops(), Path("/tmp"))
    f.prepare()
    assert f.raw is None and f.backend == "libfuse" and f.fallback_reason is None


def test_raw_backend_where_it_cannot_mount_is_a_user_error(monkeypatch):
    import os

    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse: the error is then about opening it, checked by the same path")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    from fuse_client.rawfuse import server as server_mod

    monkeypatch.setattr(server_mod, "_Inodes", lambda ops: type("I", (), {"files": [], "file_base": 2})())
    f = frontend_mod.Frontend(_Cfg("raw"), _Ops(), Path("/tmp"))
    with pytest.raises(UserError, match=r"--fuse-backend raw: .*root.*--fuse-backend libfuse"):
        f.prepare()


def test_protocol_constants_match_the_kernel_header():
    # include/uapi/linux/fuse.h: _IOR(229, 0, uint32_t), _IOW(229, 1, struct fuse_backing_map),
    # _IOW(229, 2, uint32_t); FUSE_PASSTHROUGH is bit 37 of flags|flags2<<32; FOPEN_PASSTHROUGH bit 7.
    assert p.DEV_IOC_CLONE == 0x8004E500
    assert p.DEV_IOC_BACKING_OPEN == 0x4010E501
    assert p.DEV_IOC_BACKING_CLOSE == 0x4004E502
    assert p.PASSTHROUGH == 1 << 37 and p.FOPEN_PASSTHROUGH == 0x80
    assert (p.INIT_OUT.size, p.ENTRY_OUT.size, p.ATTR_OUT.size, p.OPEN_OUT.size) == (64, 128, 104, 16)
    assert p.dirent_size(1) == 32 and p.dirent_size(8) == 32 and p.dirent_size(9) == 40
