"""The storage push: cache and remote-IO allocations to the data manager, only what changed
since the last successful push; a failed push is retried next round and shown in /v1/cluster."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from scheduler.service.types import StoragePusher

log = logging.getLogger("silod.storage")


class StoragePush:
    def __init__(self, pusher: StoragePusher | None):
        self.pusher = pusher
        self._pushed_cache: dict[str, float] = {}
        self._pushed_io: dict[str, float] = {}
        self._pushed_mode: dict[str, str] = {}
        self._pushed_autocache: dict[str, float] = {}
        self.last_error: str | None = None

    def push(self, cache: Mapping[str, float], io: Mapping[str, float],
             cache_mode: Mapping[str, str] | None = None, autocache: Mapping[str, float] | None = None) -> None:
        if self.pusher is None:
            return
        errors = []
        # The mode first: a dataset turning LRU with a smaller allocation then evicts by recency.
        set_mode = getattr(self.pusher, "set_cache_mode", None)
        for name, mode in (cache_mode or {}).items() if callable(set_mode) else ():
            if self._pushed_mode.get(name) == mode:
                continue
            try:
                set_mode(name, mode)
                self._pushed_mode[name] = mode
            except Exception as exc:  # retried next round
                errors.append(f"cache mode {name}: {exc}")
        # Autocaching before sizes: a backend that keeps preprocessed items itself (the local
        # one) routes the dataset's allocation there once it knows the choice. Backends without
        # `set_autocache` (Kubernetes: the training job's loader caches, docs/input-pipeline.md)
        # only show the choice in the API.
        set_autocache = getattr(self.pusher, "set_autocache", None)
        for name, expansion in (autocache or {}).items() if callable(set_autocache) else ():
            if self._pushed_autocache.get(name, 1.0) == expansion and name in self._pushed_autocache:
                continue
            try:
                set_autocache(name, expansion)
                self._pushed_autocache[name] = expansion
                self._pushed_cache.pop(name, None)  # re-push its size: it may now go elsewhere
            except Exception as exc:  # retried next round
                errors.append(f"autocache {name}: {exc}")
        for name, nbytes in cache.items():
            if self._pushed_cache.get(name) == nbytes:
                continue
            try:
                self.pusher.allocate_cache_size(name, nbytes)
                self._pushed_cache[name] = nbytes
            except Exception as exc:  # retried next round: the dict keeps the old value
                errors.append(f"cache {name}: {exc}")
        for job_id, rate in io.items():
            if self._pushed_io.get(job_id) == rate:
                continue
            try:
                self.pusher.allocate_remote_io(job_id, rate)
                self._pushed_io[job_id] = rate
            except Exception as exc:
                errors.append(f"remote IO {job_id}: {exc}")
        self.last_error = "; ".join(errors)[:2000] if errors else None
        if errors:
            log.warning("data manager push failed: %s", self.last_error)
