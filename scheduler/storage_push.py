"""The storage push: cache and remote-IO allocations to the data manager, only what changed
since the last successful push; a failed push is retried next round and shown in /v1/cluster."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from scheduler.service_types import StoragePusher

log = logging.getLogger("silod.storage")


class StoragePush:
    def __init__(self, pusher: StoragePusher | None):
        self.pusher = pusher
        self._pushed_cache: dict[str, float] = {}
        self._pushed_io: dict[str, float] = {}
        self.last_error: str | None = None

    def push(self, cache: Mapping[str, float], io: Mapping[str, float]) -> None:
        if self.pusher is None:
            return
        errors = []
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
