"""Autocaching on the local backend: a node-local store of a dataset's preprocessed items.

When the scheduler chooses to cache a dataset's preprocessed data (policies/autocache.py), the
local backend writes `control.json` in the dataset's preprocessed directory: the expansion (bytes
per source byte at the autocache point) and the byte budget (the dataset's cache allocation,
which then goes here instead of to the mount's source cache). Every worker of that dataset
checks it (at most once a second): while it says "preprocessed", a worker looks an item up here
first; a hit skips the source read and the deterministic stage; a miss reads the source through
the mount, runs the stage, and stores its output while the budget has room (uniform caching as
SiloD's: admit until full, never evict; a smaller budget evicts random items). Switching back
to source caching, or to a different expansion, empties the store (different bytes).

The deterministic stage: `deterministic_stage` is the local backend's stand-in for a job's
decode/resize -- the item's bytes expanded to `expansion` x their size by a stream seeded from
their content (deterministic, and the same size a decoded image would have). A job that brings
its own stage (e.g. a JPEG decode) plugs it in here; on Kubernetes the training job's own
loader does this (docs/input-pipeline.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CONTROL = "control.json"
ITEMS = "items"
RECHECK_S = 1.0


@dataclass(frozen=True)
class Control:
    expansion: float  # 1.0: source caching (the store is not used)
    budget: float  # bytes


def write_control(directory: Path, expansion: float, budget: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{CONTROL}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(json.dumps({"expansion": float(expansion), "budget": float(budget)}))
    os.replace(tmp, directory / CONTROL)


def read_control(directory: Path) -> Control | None:
    try:
        data = json.loads((directory / CONTROL).read_text())
        return Control(float(data["expansion"]), float(data["budget"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def deterministic_stage(raw: bytes, expansion: float) -> bytes:
    """The stand-in for a job's deterministic preprocessing (see the module docstring)."""
    size = max(1, int(round(len(raw) * expansion)))
    seed = hashlib.blake2b(raw, digest_size=16).digest()
    return random.Random(seed).randbytes(size)


class PreprocessedStore:
    """The preprocessed items of one dataset on this node, shared by its workers (processes)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.items = self.dir / ITEMS
        self._lock = threading.Lock()
        self._control: Control | None = None
        self._checked = -1e9

    def control(self) -> Control | None:
        """The current choice (None or expansion 1: source caching), re-read at most once a second."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= RECHECK_S:
                self._checked = now
                self._control = read_control(self.dir)
            return self._control

    def _path(self, rel: str) -> Path:
        # Item names are the mount's relative paths; a digest keeps them one flat, safe file name.
        return self.items / hashlib.sha256(rel.encode()).hexdigest()

    def get(self, rel: str) -> bytes | None:
        try:
            return self._path(rel).read_bytes()
        except OSError:
            return None

    def used(self) -> int:
        try:
            return sum(e.stat().st_size for e in os.scandir(self.items) if e.is_file() and not e.name.startswith("."))
        except OSError:
            return 0

    def put(self, rel: str, data: bytes, budget: float) -> bool:
        """Store `data` if the budget has room (checked against what is on disk: several workers
        share the store, so a race may overshoot by the items in flight, at most one per loader)."""
        with self._lock:
            if self.used() + len(data) > budget:
                return False
            self.items.mkdir(parents=True, exist_ok=True)
            path = self._path(rel)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return True

    def fit(self, budget: float, rng: random.Random | None = None) -> int:
        """Evict random items until the store holds at most `budget` bytes; returns how many."""
        rng = rng or random.Random()
        try:
            files = [(e.path, e.stat().st_size) for e in os.scandir(self.items) if e.is_file() and not e.name.startswith(".")]
        except OSError:
            return 0
        total = sum(s for _, s in files)
        rng.shuffle(files)
        evicted = 0
        for path, size in files:
            if total <= budget:
                break
            with_missing_ok(path)
            total -= size
            evicted += 1
        return evicted

    def clear(self) -> None:
        shutil.rmtree(self.items, ignore_errors=True)


def with_missing_ok(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["Control", "PreprocessedStore", "deterministic_stage", "read_control", "write_control"]
