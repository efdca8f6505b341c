"""An item still being fetched whose staged bytes readers may read already (streaming opens).

A large miss's open returns as soon as the fetch has staged its first bytes (dataplane.py);
each read then waits only until the staged bytes cover it. The guarantees of a whole fetch stay:

- A reader never gets bytes of two versions of an object. When the fetch restarts from byte 0
  (the object was replaced: another validator, or other bytes where bytes were staged)
  after bytes of this item were handed to a reader, every read of it fails with EIO from then on, with a log line,
  and the fetch goes on under a new InFlightItem for the opens that come later. The bytes of
  the new version go to a new file; the old one is left as it was, so a reply being sent from
  it still carries the old version only. (One item for all opens, not one verdict per open:
  with the kernel's page cache the opens of one inode share the pages already read.) Before
  any byte was handed out, a restart is invisible: the readers simply wait for the new bytes.
  (A server without ranges, or without validators, that sends the item whole again is no
  restart unless it names another version or its first bytes differ from the staged ones: the
  fetch reads past the bytes staged already, checking them: remote.py.)
- A read that ends at the item's last byte waits for the fetch to end, not just for the
  byte: a fetch that fails after its last byte was staged (the server sends more than the
  listing's size) ends the reader with EIO, never with a clean end of file.
- A failed fetch fails every read that is still waiting, and every later read, with EIO. Also
  when it stopped on the job's own token wait (paused at rate 0), where an open gets EAGAIN: a
  read(2) cannot fail with EAGAIN, which its callers take for "no data yet" (Python's unbuffered
  read returns None and its buffered read() the bytes so far: a sample cut short, no error).

Descriptors handed to readers stay open until the last reader and the fetch have let go
(`release`): a front end may still be reading from a descriptor after the fetch moved on to
another file (memory staging on a full disk, a restart), so none is closed under it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.05  # how often a waiting read looks at its request's interrupt flag


class ChangedWhileRead(OSError):
    """The object changed on the remote after bytes of the old version were read."""


class InFlightItem:
    """The staged prefix of one item's fetch, shared by the fetch (writer) and its readers."""

    def __init__(self, path: str, size: int, fd: int) -> None:
        self.path = path
        self.size = size
        self._cv = threading.Condition()
        self._fds = [os.dup(fd)]  # every descriptor handed out; closed when the last reference goes
        self._fd = self._fds[0]
        self._staged = 0  # bytes [0, staged) are in self._fd
        self._served = False  # some of them went to a reader
        self._done = False
        self._error: BaseException | None = None
        self._refs = 1  # the fetch's own reference

    # -- the fetch's side ----------------------------------------------------------------------

    def staged_to(self, end: int) -> None:
        """Bytes up to `end` are written to the current descriptor."""
        with self._cv:
            if end > self._staged:
                self._staged = end
                self._cv.notify_all()

    def moved(self, fd: int) -> None:
        """The fetch goes on in `fd`, which holds the same bytes staged so far (memory staging)."""
        new = os.dup(fd)
        with self._cv:
            self._fds.append(new)
            self._fd = new

    def restarted(self, fd: int) -> bool:
        """The fetch starts again from byte 0 in the fresh file `fd`. False when readers got bytes
        of this item already: it then fails for good (and drops the fetch's reference), and the
        fetch needs a new InFlightItem for the new version."""
        with self._cv:
            if self._served:
                self._done = True
                self._error = ChangedWhileRead(errno.EIO, f"{self.path!r} changed on the remote while it was read")
                self._cv.notify_all()
            else:
                new = os.dup(fd)
                self._fds.append(new)
                self._fd = new
                self._staged = 0
                return True
        log.error("%s changed on the remote while it was read (the fetch restarted on the new version): its "
                  "open readers get EIO, the opens from now on read the new version", self.path)
        self.release()
        return False

    def finish(self, error: BaseException | None = None) -> None:
        """The fetch ended (complete when `error` is None); drops the fetch's reference."""
        with self._cv:
            self._done = True
            self._error = error
            self._cv.notify_all()
        self.release()

    # -- the readers' side ---------------------------------------------------------------------

    def acquire(self) -> bool:
        """Take a reader's reference; False once every reference is gone (descriptors closed)."""
        with self._cv:
            if not self._refs:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._cv:
            self._refs -= 1
            if self._refs:
                return
            fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def ready(self, offset: int, n: int) -> bool:
        """True when a read of `n` bytes at `offset` would not wait."""
        end = offset + n
        with self._cv:
            return n == 0 or self._error is not None or (self._staged >= end and (end < self.size or self._done))

    def span(self, offset: int, n: int, cancelled: Callable[[], bool] | None = None) -> int:
        """The descriptor to send `n` bytes at `offset` from, once they are staged. Raises EIO
        when the fetch failed (or the object changed after bytes of it were read), EINTR when
        `cancelled()` while waiting."""
        end = offset + n
        with self._cv:
            if n == 0:  # at or past the end: nothing to wait for
                return self._fd
            while True:
                if self._error is not None:
                    if isinstance(self._error, ChangedWhileRead):
                        raise ChangedWhileRead(*self._error.args)
                    raise OSError(errno.EIO, f"fetching {self.path!r} failed: {self._error}")
                # The read with the last byte waits for the fetch's end: its checks come after it.
                if self._staged >= end and (end < self.size or self._done):
                    self._served = True
                    return self._fd
                if cancelled is not None and cancelled():
                    raise InterruptedError(errno.EINTR, f"read of {self.path!r} interrupted")
                self._cv.wait(WAIT_SLICE_S)

    def staged(self) -> int:
        with self._cv:
            return self._staged
