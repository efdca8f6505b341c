"""What the simulator's cache systems and readers know of each other.

A cache system (cache_systems) answers a reading job's lookups and keeps its count of cached,
unread chunks; a reader (reader.SimJob) advances through its epoch against a cache system. The
cache system sees a job only through `CacheReader`, so the two modules do not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(eq=False, slots=True)
class SimDataset:
    name: str
    size: float
    n_chunks: int
    index: int  # position in the engine's dataset list
    #: Bytes the cache holds per source byte: 1 caching the source, e caching its readers'
    #: preprocessed data (autocaching; set by the cache system from the round's plan).
    expansion: float = 1.0
    chunk_size: float = field(init=False)  # bytes per chunk (read in the hot loops: computed once)

    def __post_init__(self) -> None:
        self.chunk_size = self.size / self.n_chunks

    @property
    def cached_chunk_bytes(self) -> float:
        """Cache bytes one cached chunk takes (e x its source bytes when preprocessed)."""
        return self.chunk_size * self.expansion


class CacheReader(Protocol):
    """A job as its cache system sees it (reader.SimJob is the one implementation)."""

    job_id: str
    dataset: SimDataset
    ideal: float  # f*, bytes/s
    read_mask: np.ndarray  # chunks looked up in the current epoch (the §6 bitset)
    unread_cached: int  # cached chunks it has not looked up yet this epoch
    moved: int  # unread chunks that others' admissions and evictions made cached or uncached (the engine resets it)
    start_time: float | None  # when it first held GPUs (None: still queued)

    @property
    def gpus(self) -> int: ...


@dataclass(slots=True)
class TurnAdvance:
    """What a compiled per-job advance needs of a step (engine._advance_vector hands it to
    SimCacheSystem.look_up_in_turn): the running jobs' columns, in their order, and where the
    results go."""

    python: np.ndarray  # bool: jobs only the Python advance takes (curriculum draws, preprocessed data)
    slots: np.ndarray  # their rows in the job table's `state`
    substep: np.ndarray  # int: chunks per sub-step
    k: np.ndarray  # chunks per epoch
    chunk: np.ndarray  # bytes per chunk
    ideal: np.ndarray  # bytes/s
    total: np.ndarray  # bytes to read in all
    caps: np.ndarray  # remote IO, bytes/s
    now: float
    dt: float
    substeps: int  # sub-steps each may take (-1: no limit)
    state: np.ndarray  # the job table's reading positions
    read: np.ndarray  # out: bytes read
    remote: np.ndarray  # out: bytes fetched
    finished_at: np.ndarray  # out: when it finished (NaN: it did not)
    elapsed: np.ndarray  # out: seconds of the step used
    applied: np.ndarray  # out: cleared for each job advanced per job


@dataclass(slots=True)
class StepResult:
    """What one job's read over a step did (scheduler/sim/reader.py's advance; the cache systems'
    compiled clocks hand per-job steps back in it)."""

    bytes_read: float = 0.0
    remote_bytes: float = 0.0
    finished_at: float | None = None
    elapsed: float = 0.0  # seconds of the step used (less than dt only with `substeps`)
