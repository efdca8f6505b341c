"""The node agent's consumption reports: what each pod read through this node's FUSE mounts,
sent to the silod scheduler every `--report-interval` seconds (POST /v1/agents/{node}/consumption).

Each dataset mount counts reads per pod (the caller's kubepods cgroup, fuse_client/pod_attribution.py)
into its stats file. Counters there restart from 0 when a mount process restarts (the agent
restarted, or an idle mount was unmounted and mounted again); the stats file's `instance` says
which process wrote it, so the reporter carries the last totals of an old instance over and the
scheduler sees counters that only rise. The carried totals are kept in `<state>/consumption.json`
so an agent restart does not lose them.

Each report also carries the bytes the node's cache directory can hold (`cache_disk`: statvfs
of the directory's file system, capped by the agent's --cache-size): the scheduler plans the
node's cache with it instead of an annotation or an even share (docs/kubernetes-nodes.md).

The token is read from a file at every report (a node-bound credential an operator provisions
per node, rotated in place), or from $SILOD_AGENT_TOKEN.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("silod.agent.report")

COUNTERS = ("read_bytes", "hit_bytes", "miss_bytes", "hits", "misses",
            # the pod's misses delivered whole, their summed service time (us) and bytes
            # (accounting.PodCounters): the loader term's L for a Kubernetes pod's job
            "miss_service_count", "miss_service_us", "miss_service_bytes")
MAX_STATS_BYTES = 16 * 1024 * 1024
# A pod no stats file has listed for this long ended long ago, and the scheduler already holds its
# last counters (they only rise): the agent stops reporting it and forgets it.
FORGET_AFTER_S = 24 * 3600.0
BATCH = 1000  # the scheduler's cap on pods per report


@dataclass
class _Seen:
    instance: str
    counters: dict[str, int]
    carried: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    seen_at: float = 0.0  # wall clock of the last stats file that listed the pod


class ConsumptionReporter:
    def __init__(self, *, node: str, mounts: Callable[[], list[Path]], state_file: Path, url: str | None = None,
                 token: Callable[[], str] | None = None, interval_s: float = 10.0, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time, cache_disk: Callable[[], int | None] | None = None):
        self.node = node
        self.mounts = mounts
        self.state_file = state_file
        self.url = url.rstrip("/") if url else None
        self.token = token
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.cache_disk = cache_disk
        self.seen: dict[str, _Seen] = {}  # "<stats file>|<pod uid>" -> last seen
        self.last_result: dict | None = None
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.state_file.read_text())
            self.seen = {k: _Seen(**v) for k, v in raw.items()}
        except FileNotFoundError:
            pass
        except (ValueError, TypeError) as exc:
            log.error("ignoring unreadable %s: %s", self.state_file, exc)

    def _save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in sorted(self.seen.items())}))
        os.replace(tmp, self.state_file)

    def collect(self) -> dict[str, dict[str, int]]:
        """Cumulative counters per pod uid over every dataset mount of the node."""
        now = self.clock()
        for path in self.mounts():
            try:
                if path.stat().st_size > MAX_STATS_BYTES:
                    log.error("%s is larger than %d bytes; skipped", path, MAX_STATS_BYTES)
                    continue
                stats = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue  # not written yet, or gone
            instance = str(stats.get("instance") or "")
            for uid, c in (stats.get("pods") or {}).items():
                if not isinstance(c, dict):
                    continue
                counters = {k: int(c.get(k) or 0) for k in COUNTERS}
                key = f"{path}|{uid}"
                prev = self.seen.get(key)
                if prev is None:
                    self.seen[key] = _Seen(instance, counters, seen_at=now)
                    continue
                prev.seen_at = now
                if prev.instance != instance:  # a new mount process: its counters started again at 0
                    # (.get: a state file from before a counter existed has none of it)
                    prev.carried = {k: prev.carried.get(k, 0) + prev.counters.get(k, 0) for k in COUNTERS}
                    prev.instance = instance
                prev.counters = counters
        for key in [k for k, s in self.seen.items() if now - s.seen_at > FORGET_AFTER_S]:
            del self.seen[key]
        totals: dict[str, dict[str, int]] = {}
        for key, s in self.seen.items():
            uid = key.rsplit("|", 1)[1]
            t = totals.setdefault(uid, dict.fromkeys(COUNTERS, 0))
            for k in COUNTERS:
                t[k] += s.carried.get(k, 0) + s.counters.get(k, 0)
        self._save()
        return totals

    def report_once(self) -> dict:
        """Collect and send; returns the scheduler's answer (accepted, ignored with reasons)."""
        import httpx

        if self.url is None or self.token is None:
            raise RuntimeError("no scheduler URL or token to report to")
        totals = self.collect()
        pods = [{"pod_uid": uid, **c} for uid, c in sorted(totals.items())]
        result: dict = {"accepted": 0, "ignored": []}
        headers = {"Authorization": f"Bearer {self.token()}"}
        disk = self.cache_disk() if self.cache_disk is not None else None
        for i in range(0, max(len(pods), 1), BATCH):
            body: dict = {"pods": pods[i:i + BATCH]}
            if disk is not None and i == 0:
                body["cache_disk_bytes"] = disk
            r = httpx.post(f"{self.url}/v1/agents/{self.node}/consumption", json=body,
                           headers=headers, timeout=self.timeout_s)
            if r.status_code != 200:
                raise RuntimeError(f"the scheduler answered HTTP {r.status_code}: {r.text[:300]}")
            body = r.json()
            result["accepted"] += int(body.get("accepted", 0))
            result["ignored"] += list(body.get("ignored") or [])
        return result

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="silod-agent-report", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.last_result = self.report_once()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - the scheduler may be down: counters are cumulative, retry
                self.last_error = str(exc)
                log.warning("consumption report not sent: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + self.timeout_s + 1)


def cache_disk_bytes(cache_dir: Path, cap: int | None = None) -> int | None:
    """The bytes the node's cache directory can hold: the size of its file system (statvfs),
    capped by the agent's configured --cache-size. None when the directory cannot be read (the
    report then says nothing of the disk, and the scheduler keeps its fallback)."""
    try:
        st = os.statvfs(cache_dir)
    except OSError as exc:
        log.warning("cache directory %s not measured: %s", cache_dir, exc)
        return None
    size = int(st.f_blocks) * int(st.f_frsize)
    return min(size, cap) if cap is not None else size


def token_source(token_file: Path | None, env_token: str | None) -> Callable[[], str]:
    if token_file is not None:
        def read() -> str:
            return token_file.read_text().strip()
        return read
    if not env_token:
        raise ValueError("no token")
    return lambda: env_token
