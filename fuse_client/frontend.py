"""Which FUSE front end serves a mount: the raw /dev/fuse server with passthrough, or libfuse.

`--fuse-backend`:
- `auto` (default): the raw server when it can mount (root) and the kernel negotiates FUSE
  passthrough (protocol 7.40, Linux >= 6.9 with CONFIG_FUSE_PASSTHROUGH) *and* accepts a backing
  file in the cache directory; otherwise libfuse (any kernel, also unprivileged via fusermount3).
- `raw`: the raw server; passthrough when negotiated (unless --no-passthrough), else every read
  goes through the server. Fails with a clear error where it cannot mount.
- `libfuse`: mfusepy over the system libfuse (read_buf + kernel page cache), as before.

Both serve the same DatasetOperations, so caching, admission, throttling, the breaker and the
accounting are one implementation.
"""

from __future__ import annotations

import logging
from pathlib import Path

from estimator.errors import UserError
from fuse_client.operations import DatasetOperations

log = logging.getLogger(__name__)

PASSTHROUGH_KERNEL = (6, 9)


class Frontend:
    def __init__(self, cfg, ops: DatasetOperations, cache_root: Path) -> None:
        self.cfg = cfg
        self.ops = ops
        self.cache_root = cache_root
        self.raw = None  # RawFuseServer when the raw backend serves
        self.backend = "libfuse"
        self.fallback_reason: str | None = None
        self._served = False

    # -- choosing ----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Mount with the raw server when chosen; decide the backend before serving."""
        choice = self.cfg.fuse_backend
        if choice == "libfuse":
            return
        if choice == "auto":
            reason = self._auto_precheck()
            if reason is not None:
                self.fallback_reason = reason
                log.info("--fuse-backend auto: using libfuse (%s)", reason)
                return
        from fuse_client.rawfuse.device import RawFuseUnavailable
        from fuse_client.rawfuse.server import RawFuseError, RawFuseServer

        server = RawFuseServer(
            self.ops, self.cfg.mountpoint, f"silod:{self.cfg.dataset}", passthrough=self.cfg.passthrough,
            allow_other=self.cfg.allow_other, open_threads=self.cfg.fuse_threads, backing_dir=self.cache_root,
        )
        try:
            negotiated = server.mount()
        except (RawFuseUnavailable, RawFuseError) as exc:
            if choice == "raw":
                raise UserError(f"--fuse-backend raw: {exc}; use --fuse-backend libfuse (or auto)") from None
            self.fallback_reason = str(exc)
            log.info("--fuse-backend auto: using libfuse (%s)", exc)
            return
        if choice == "auto" and not server.passthrough:
            why = ("the kernel did not negotiate FUSE passthrough" if not negotiated.passthrough
                   else "the kernel refused a backing file in the cache directory")
            server.abort()
            self.fallback_reason = why
            log.info("--fuse-backend auto: using libfuse (%s)", why)
            return
        self.raw = server
        self.backend = "raw"

    def _auto_precheck(self) -> str | None:
        import os

        from fuse_client.rawfuse.device import kernel_release

        if not self.cfg.passthrough:
            return "--no-passthrough"
        if os.geteuid() != 0:
            return "not root: passthrough backing files need CAP_SYS_ADMIN"
        if kernel_release() < PASSTHROUGH_KERNEL:
            return f"kernel {os.uname().release} is older than 6.9 (no FUSE passthrough)"
        return None

    def describe(self) -> str:
        if self.raw is None:
            return "libfuse" + (f" (raw not used: {self.fallback_reason})" if self.fallback_reason else "")
        return "raw /dev/fuse " + ("with passthrough" if self.raw.passthrough else "without passthrough")

    # -- serving -----------------------------------------------------------------------------

    def serve(self) -> None:
        self._served = True
        if self.raw is not None:
            self.raw.serve_forever()
            return
        self._serve_libfuse()

    def _serve_libfuse(self) -> None:
        import mfusepy

        from fuse_client.fs import SilodFS

        cfg = self.cfg
        mfusepy.FUSE(
            SilodFS(self.ops, cfg.fuse_threads), str(cfg.mountpoint), raw_fi=True, foreground=True, ro=True,
            fsname=f"silod:{cfg.dataset}", subtype="silod", default_permissions=True,
            **({"allow_other": True} if cfg.allow_other else {}),
            # libfuse starts a worker per request while none is idle, up to max_threads
            # (default 10: ten slow misses would stall every hit behind them).
            max_threads=cfg.fuse_threads, max_idle_threads=min(cfg.fuse_threads, 32),
        )

    def close(self) -> None:
        """If the raw server mounted but never served (an error in between), drop the mount."""
        if self.raw is not None and not self._served:
            self.raw.abort()

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.ops.counters
        out = {
            "fuse_backend": self.backend,
            "passthrough": bool(self.raw is not None and self.raw.passthrough),
            "read_requests": c.read_requests,
            "passthrough_opens": c.passthrough_opens,
            "kernel_cache_opens": c.kernel_cache_opens,
            "daemon_opens": c.daemon_opens,
            "streaming_opens": c.streaming_opens,
            "open_handles": self.ops.open_handles(),
        }
        if self.raw is not None:
            out.update(self.raw.stats())
        return out
