"""The registered readers' epoch state as rows of arrays their cache system owns.

A reader's epoch state is what the cache system reads and writes at every look-up: the chunks
it has looked up this epoch (the §6 bitset, `SimJob.read_mask`), its epoch's order
(`SimJob.perm`), and two counts, the cached chunks it has not looked up yet
(`SimJob.unread_cached`) and how many of those changes others made (`SimJob.moved`). Every
admission and eviction updates the counts of the readers of the chunk's dataset; as rows of a
few arrays, a compiled loop over an LRU's chunks (lru_kernel.py) can update them, and the
engine can read every running job's count as one column.

A job holds arrays of its own until its cache system registers it (`add`): from then on its
attributes are views of its row, and it takes copies back out when it leaves (`remove`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: The columns of `ReaderRows.counts` (SimJob.unread_cached, SimJob.moved).
UNREAD, MOVED = 0, 1


class ReaderRows:
    def __init__(self) -> None:
        self.reads = np.zeros((16, 0), dtype=bool)
        self.perms = np.zeros((16, 0), dtype=np.int64)
        self.counts = np.zeros((16, 2), dtype=np.int64)
        self._owner: list[Any] = [None] * 16
        self._free: list[int] = []
        self._next = 0

    def add(self, job: Any) -> None:
        """Give `job` a row (its read mask, permutation and counts move into it)."""
        n = job.dataset.n_chunks
        if self._free:
            row = self._free.pop()
        else:
            row = self._next
            self._next += 1
        rows, width = len(self._owner), self.reads.shape[1]
        if row >= rows or n > width:
            self._resize(2 * rows if row >= rows else rows, max(n, 2 * width) if n > width else width)
        self.reads[row, :n] = job.read_mask
        self.reads[row, n:] = False
        self.perms[row, :n] = job.perm
        self.counts[row] = job.counts[job.crow]
        self._owner[row] = job
        self._point(job, row)

    def remove(self, job: Any) -> None:
        """`job` leaves with copies of its row."""
        row, n = job.crow, job.dataset.n_chunks
        job.read_mask = self.reads[row, :n].copy()
        job.perm = self.perms[row, :n].copy()
        job.counts, job.crow = self.counts[row:row + 1].copy(), 0
        self._owner[row] = None
        self._free.append(row)

    def _point(self, job: Any, row: int) -> None:
        n = job.dataset.n_chunks
        job.read_mask = self.reads[row, :n]
        job.perm = self.perms[row, :n]
        job.counts, job.crow = self.counts, row

    def _resize(self, rows: int, width: int) -> None:
        old = len(self._owner)
        for name in ("reads", "perms", "counts"):
            a = getattr(self, name)
            grown = np.zeros((rows, width if name != "counts" else a.shape[1]), dtype=a.dtype)
            grown[:old, :a.shape[1]] = a
            setattr(self, name, grown)
        self._owner.extend([None] * (rows - old))
        for row, job in enumerate(self._owner):
            if job is not None:
                self._point(job, row)


class ReaderGroups:
    """Per reader row, the group its reader's look-ups touch (an LRU's dataset index, a uniform
    domain's slot; negative: none, or one the compiled loops leave to Python) and whether a
    registered reader holds the row. `csr` gives each group's held rows: the readers whose counts
    an admission or eviction in the group moves, as the compiled look-ups walk them."""

    def __init__(self) -> None:
        self.code = np.full(16, -1, dtype=np.int64)
        self.held = np.zeros(16, dtype=bool)

    def hold(self, row: int, code: int) -> None:
        """A registered reader holds `row`, in group `code`."""
        if row >= len(self.code):
            grow = max(row + 1, len(self.code))
            self.code = np.concatenate([self.code, np.full(grow, -1, dtype=np.int64)])
            self.held = np.concatenate([self.held, np.zeros(grow, dtype=bool)])
        self.code[row] = code
        self.held[row] = True

    def csr(self, groups: int) -> tuple[np.ndarray, np.ndarray]:
        """(pointers, rows): group g's held rows are rows[pointers[g]:pointers[g + 1]], in row order
        (on columns, not a pass over the readers)."""
        rows = (self.held & (self.code >= 0)).nonzero()[0]
        codes = self.code[rows]
        ptr = np.zeros(groups + 1, dtype=np.int64)
        np.bincount(codes, minlength=groups).cumsum(out=ptr[1:])
        return ptr, rows[codes.argsort(kind="stable")]
