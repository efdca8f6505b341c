"""The data manager's state: allocations (persisted) and FUSE clients (registered + live stats).

Pure data and rules; no HTTP. `StateStore` adds the one piece of I/O, an atomically replaced
JSON file, so a restarted manager recovers every allocation and registration.

Rules that are easy to get wrong, in one place:
- Cache is allocated to a *dataset* and applies to the dataset's cache on every node that mounts
  it; jobs sharing the dataset on a node share that cache.
- Remote IO is allocated to a *job* and split evenly among its workers (mounts), as in SiloD §6
  for data-parallel training. The divisor is max(declared workers, live mounts of the job), so a
  job can never exceed its allocation even if more mounts show up than were declared.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

# A client that has not sent a heartbeat for this long is reported as not live and does not
# count as a worker of its job.
LIVE_TIMEOUT_S = 5.0

# Mounts one node may have registered at once. A node runs a few mounts per job; without a bound
# one agent registered 1,500 clients and every save (the whole state file, fsynced) went from 8 to
# 81 ms for every node (issue 20 review). At the bound a node's clients that are not live are
# dropped first: a mount that is merely cut off registers again when its heartbeat gets a 404.
MAX_CLIENTS_PER_NODE = 512


class UnknownEntity(LookupError):
    """A dataset, job or client the manager has never heard of (HTTP 404)."""


class TooManyClients(Exception):
    """A node has MAX_CLIENTS_PER_NODE live clients already (HTTP 429)."""


class StateNotSaved(OSError):
    """The state file could not be written (disk full, directory gone): the change was undone in
    memory too, so what the manager serves is what a restart would load (HTTP 503)."""


class DatasetState(BaseModel):
    name: str
    uri: str | None = None
    cache_bytes: int | None = None  # None: the scheduler has not allocated cache yet
    #: uniform | lru (fuse_client/lru_cache.py); None: not set, mounts keep the node's mode
    cache_mode: Literal["uniform", "lru"] | None = None


class JobState(BaseModel):
    id: str
    dataset: str | None = None
    bytes_per_s: float | None = None  # None: the scheduler has not allocated remote IO yet
    workers: int = 1


def _bounded(value: object, allocated: int | None) -> int:
    """A reported byte count as a non-negative int, at most `allocated` when that is known."""
    try:
        n = int(value or 0)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return 0
    n = max(n, 0)
    return n if allocated is None else min(n, int(allocated))


def _bounded_or_none(value: object, allocated: int | None) -> int | None:
    """`_bounded`, or None when the client did not report the figure (absent or null)."""
    return None if value is None else _bounded(value, allocated)


#: A mean per-miss service time above this (seconds) is not a figure a mount measures: dropped.
MAX_MISS_SERVICE_S = 3600.0


def _miss_service(value: object) -> dict[str, float | int | None]:
    """A mount's cumulative per-miss service counters ({"count", "sum_s", "bytes"}) as the status
    shows them: counts and bytes non-negative ints, the sum a finite non-negative float no larger
    than count x MAX_MISS_SERVICE_S; all None when absent or malformed (an older mount, a bad agent)."""
    none: dict[str, float | int | None] = {"miss_service_count": None, "miss_service_s": None, "miss_service_bytes": None}
    if not isinstance(value, dict):
        return none
    got = [value.get(k) for k in ("count", "sum_s", "bytes")]
    # Numbers only (a string, a bool or a list is no count), finite and non-negative.
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in got):
        return none
    count, total, nbytes = int(got[0]), float(got[1]), int(got[2])
    return {"miss_service_count": count, "miss_service_s": min(total, count * MAX_MISS_SERVICE_S),
            "miss_service_bytes": nbytes}


def _rate_at_most(value: object, allocated: float | None) -> float | None:
    """A reported rate (bytes/s) as a finite non-negative float, at most `allocated` when known;
    None when absent or not a number."""
    try:
        r = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(r):
        return None
    r = max(r, 0.0)
    return r if allocated is None else min(r, float(allocated))


class ClientRegistration(BaseModel):
    """What a FUSE client says about itself when it registers."""

    client_id: str
    node: str
    dataset: str
    job: str
    source: str = ""
    mountpoint: str = ""
    pid: int = 0


class ClientState(ClientRegistration):
    registered_at: float = Field(default_factory=time.time)


class PersistedState(BaseModel):
    version: int = 1
    datasets: dict[str, DatasetState] = {}
    jobs: dict[str, JobState] = {}
    clients: dict[str, ClientState] = {}
    #: node -> the storage keys it has a reason to mount (pushed by the scheduler from its record
    #: of where admitted jobs' pods run, PUT /v1/placements); None: never pushed (not enforced)
    placements: dict[str, list[str]] | None = None


@dataclass(frozen=True)
class ClientAllocation:
    cache_bytes: int | None
    remote_io_bytes_per_s: float | None
    cache_mode: str | None = None

    def as_dict(self) -> dict:
        out = {"cache_bytes": self.cache_bytes, "remote_io_bytes_per_s": self.remote_io_bytes_per_s}
        if self.cache_mode is not None:  # only once the scheduler has set it: older clients see no change
            out["cache_mode"] = self.cache_mode
        return out


@dataclass
class Runtime:
    """What is not persisted: liveness and the last stats of each client."""

    last_seen: dict[str, float] = field(default_factory=dict)
    stats: dict[str, dict] = field(default_factory=dict)


class StateStore:
    """Thread-safe state with write-through persistence to `<state-dir>/state.json`."""

    def __init__(self, state_dir: Path, clock=time.monotonic) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / "state.json"
        self.clock = clock
        self.lock = threading.RLock()
        self.runtime = Runtime()
        self.state = self._load()

    # -- persistence -------------------------------------------------------------------------

    def _load(self) -> PersistedState:
        if not self.path.exists():
            return PersistedState()
        return PersistedState.model_validate_json(self.path.read_text())

    def _save(self) -> None:
        tmp = self.path.with_name(f".state.json.{os.getpid()}.tmp")
        data = self.state.model_dump_json(indent=1).encode()
        try:
            # 0600 (a umask can only take bits away): it names every node's mounts, jobs and
            # dataset sources; no secrets, but not every local user's to read.
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # readers (and a restart) see the old or the new state, never half
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise StateNotSaved(f"could not write {self.path} ({exc.strerror or exc}); nothing was changed: "
                                f"free space or fix the state directory, then retry") from exc

    @contextmanager
    def _change(self) -> Iterator[PersistedState]:
        """One change of the persisted state, all or nothing. Each change checks its input
        before it touches the state; if the save then fails, the state in memory is put back to
        the file's (which the atomic replace keeps whole), so the manager never serves an
        allocation or a client that a restart would not have. Reloading only on failure costs
        the common path nothing (no copy per write)."""
        with self.lock:
            yield self.state
            try:
                self._save()
            except StateNotSaved:
                self.state = self._load()
                self.runtime.last_seen = {c: t for c, t in self.runtime.last_seen.items() if c in self.state.clients}
                raise

    # -- placements: which node may mount which dataset ------------------------------------------

    def set_placements(self, nodes: dict[str, list[str]]) -> dict[str, list[str]]:
        """Replace the scheduler's map of node -> storage keys it has a reason to mount."""
        with self._change():
            self.state.placements = {str(n): sorted({str(k) for k in keys}) for n, keys in nodes.items()}
            return dict(self.state.placements)

    def placed_on(self, node: str, dataset: str) -> bool | None:
        """Whether `dataset` (a storage key) has a reason to be on `node`; None: the scheduler
        never pushed placements, so nothing is known (and nothing enforced)."""
        with self.lock:
            if self.state.placements is None:
                return None
            return dataset in self.state.placements.get(node, ())

    # -- declarations and allocations (Table 3) ----------------------------------------------

    def declare_dataset(self, name: str, uri: str | None = None) -> DatasetState:
        with self._change():
            ds = self.state.datasets.get(name)
            if ds is None:
                ds = self.state.datasets[name] = DatasetState(name=name, uri=uri)
            elif uri is not None:
                ds.uri = uri
            return ds

    def declare_job(self, job_id: str, dataset: str | None = None, workers: int | None = None) -> JobState:
        with self._change():
            if dataset is not None and dataset not in self.state.datasets:
                # Not an implicit create: a typo in the dataset name would otherwise make a new,
                # empty dataset that no cache allocation ever reaches.
                raise UnknownEntity(f"job {job_id!r} reads dataset {dataset!r}, which is not declared; "
                                    f"declare it first with PUT /v1/datasets/{dataset}")
            job = self.state.jobs.get(job_id)
            if job is None:
                job = self.state.jobs[job_id] = JobState(id=job_id)
            if dataset is not None:
                job.dataset = dataset
            if workers is not None:
                job.workers = workers
            return job

    def dataset(self, name: str) -> DatasetState:
        ds = self.state.datasets.get(name)
        if ds is None:
            raise UnknownEntity(f"unknown dataset {name!r}; declare it with PUT /v1/datasets/{name} or mount it first")
        return ds

    def job(self, job_id: str) -> JobState:
        job = self.state.jobs.get(job_id)
        if job is None:
            raise UnknownEntity(f"unknown job {job_id!r}; declare it with PUT /v1/jobs/{job_id} or mount it first")
        return job

    def allocate_cache_size(self, name: str, nbytes: int) -> DatasetState:
        with self._change():
            ds = self.dataset(name)
            ds.cache_bytes = int(nbytes)
            return ds

    def set_cache_mode(self, name: str, mode: str) -> DatasetState:
        """uniform | lru for the dataset's cache on every node (the scheduler sets it from the
        access pattern of the jobs that read the dataset)."""
        with self._change():
            ds = self.dataset(name)
            ds.cache_mode = mode  # type: ignore[assignment]  # checked by the API
            return ds

    def allocate_remote_io(self, job_id: str, bytes_per_s: float, workers: int | None = None) -> JobState:
        with self._change():
            job = self.job(job_id)
            job.bytes_per_s = float(bytes_per_s)
            if workers is not None:
                job.workers = workers
            return job

    def delete_job(self, job_id: str) -> None:
        with self._change():
            self.job(job_id)
            del self.state.jobs[job_id]

    # -- clients -----------------------------------------------------------------------------

    def register_client(self, client: ClientState) -> ClientAllocation:
        with self._change():
            if client.client_id not in self.state.clients:
                self._make_room(client.node)
            if client.dataset not in self.state.datasets:
                self.state.datasets[client.dataset] = DatasetState(name=client.dataset, uri=client.source or None)
            job = self.state.jobs.get(client.job)
            if job is None:
                self.state.jobs[client.job] = JobState(id=client.job, dataset=client.dataset)
            elif job.dataset is None:
                job.dataset = client.dataset
            self.state.clients[client.client_id] = client
            self.runtime.last_seen[client.client_id] = self.clock()
            return self.allocation_for(client.client_id)

    def _make_room(self, node: str) -> None:
        """Room for one more client of `node`: its clients that are not live are dropped when it
        is at MAX_CLIENTS_PER_NODE (TooManyClients if they are all live)."""
        mine = [c for c, state in self.state.clients.items() if state.node == node]
        if len(mine) < MAX_CLIENTS_PER_NODE:
            return
        stale = [c for c in mine if not self.is_live(c)]
        if len(mine) - len(stale) >= MAX_CLIENTS_PER_NODE:
            raise TooManyClients(f"node {node!r} has {len(mine)} live clients registered, the most one node may have "
                                 f"({MAX_CLIENTS_PER_NODE}); unregister mounts that ended (DELETE /v1/clients/ID)")
        for c in stale:
            del self.state.clients[c]
            self.runtime.last_seen.pop(c, None)
            self.runtime.stats.pop(c, None)

    def client_node(self, client_id: str) -> str:
        with self.lock:
            client = self.state.clients.get(client_id)
            if client is None:
                raise UnknownEntity(f"unknown client {client_id!r}; register with POST /v1/clients")
            return client.node

    def heartbeat(self, client_id: str, stats: dict) -> ClientAllocation:
        with self.lock:
            if client_id not in self.state.clients:
                raise UnknownEntity(f"unknown client {client_id!r}; register with POST /v1/clients")
            self.runtime.last_seen[client_id] = self.clock()
            self.runtime.stats[client_id] = stats
            return self.allocation_for(client_id)

    def unregister_client(self, client_id: str) -> None:
        with self._change():
            if client_id not in self.state.clients:
                raise UnknownEntity(f"unknown client {client_id!r}")
            del self.state.clients[client_id]
            self.runtime.last_seen.pop(client_id, None)
            self.runtime.stats.pop(client_id, None)

    def is_live(self, client_id: str) -> bool:
        seen = self.runtime.last_seen.get(client_id)
        return seen is not None and self.clock() - seen <= LIVE_TIMEOUT_S

    def live_clients_of_job(self, job_id: str) -> list[ClientState]:
        return [c for c in self.state.clients.values() if c.job == job_id and self.is_live(c.client_id)]

    def allocation_for(self, client_id: str) -> ClientAllocation:
        client = self.state.clients[client_id]
        ds = self.state.datasets.get(client.dataset)
        job = self.state.jobs.get(client.job)
        rate = None
        if job is not None and job.bytes_per_s is not None:
            workers = max(job.workers, len(self.live_clients_of_job(job.id)), 1)
            rate = job.bytes_per_s / workers
        return ClientAllocation(cache_bytes=None if ds is None else ds.cache_bytes, remote_io_bytes_per_s=rate,
                                cache_mode=None if ds is None else ds.cache_mode)

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict:
        """Per node and dataset: allocated, cached, effective per job; registered clients."""
        with self.lock:
            now = self.clock()
            clients = []
            nodes: dict[str, dict] = {}
            for c in self.state.clients.values():
                stats = self.runtime.stats.get(c.client_id, {})
                live = self.is_live(c.client_id)
                seen = self.runtime.last_seen.get(c.client_id)
                clients.append({
                    **c.model_dump(), "live": live,
                    "last_heartbeat_s_ago": None if seen is None else round(now - seen, 3),
                    "allocation": self.allocation_for(c.client_id).as_dict(), "stats": stats,
                })
                ds_alloc = self.state.datasets.get(c.dataset)
                node = nodes.setdefault(c.node, {"datasets": {}})
                entry = node["datasets"].setdefault(c.dataset, {
                    "allocated_bytes": None if ds_alloc is None else ds_alloc.cache_bytes,
                    "cache_mode": None if ds_alloc is None else ds_alloc.cache_mode,
                    "cached_bytes": 0, "items_cached": 0, "jobs": {},
                })
                # Mounts of one dataset on one node share one cache: report it once (the freshest).
                # A mount's cache never holds more than the dataset's allocation: a larger figure
                # (an agent reported 1e15 for another tenant's dataset, issue 20) is capped there.
                entry["cached_bytes"] = max(entry["cached_bytes"], _bounded(stats.get("cached_bytes"), entry["allocated_bytes"]))
                entry["items_cached"] = max(entry["items_cached"], _bounded(stats.get("items_cached"), None))
                alloc_rate = self.allocation_for(c.client_id).remote_io_bytes_per_s
                entry["jobs"][c.job] = {
                    "client_id": c.client_id, "live": live,
                    "effective_cached_bytes": _bounded_or_none(stats.get("effective_cached_bytes"), entry["allocated_bytes"]),
                    "remote_io_bytes_per_s": alloc_rate,
                    # The mount reads remote storage no faster than its allocation (its rate limiter):
                    # a larger figure (issue 20: an agent's report is not believed beyond what its
                    # node may carry) is capped there.
                    "remote_rate_bytes_per_s": _rate_at_most(stats.get("remote_rate_bytes_per_s"), alloc_rate),
                    "throughput_bytes_per_s": _rate_at_most(stats.get("throughput_bytes_per_s"), None),
                    # How old these figures are (the mount's last heartbeat): the scheduler takes
                    # the counters' deltas over the time they span, not over its own interval.
                    "stats_age_s": None if seen is None else max(0.0, round(now - seen, 3)),
                    **{k: _bounded_or_none(stats.get(k), None) for k in ("hit_bytes", "miss_bytes", "remote_bytes", "epoch")},
                    # The mount's per-miss service time, cumulative (fuse_client/accounting.py):
                    # the scheduler takes each interval's mean L = d(sum) / d(count) for the
                    # loader term of a job that declared its loader.
                    **_miss_service(stats.get("miss_service")),
                }
            datasets = {}
            for ds in self.state.datasets.values():
                cached = sum(n["datasets"][ds.name]["cached_bytes"] for n in nodes.values() if ds.name in n["datasets"])
                datasets[ds.name] = {
                    "uri": ds.uri, "allocated_bytes": ds.cache_bytes, "cache_mode": ds.cache_mode,
                    "cached_bytes_all_nodes": cached,
                    "jobs": sorted(j.id for j in self.state.jobs.values() if j.dataset == ds.name),
                }
            jobs = {
                j.id: {
                    "dataset": j.dataset, "remote_io_bytes_per_s": j.bytes_per_s, "workers": j.workers,
                    "live_clients": len(self.live_clients_of_job(j.id)),
                }
                for j in self.state.jobs.values()
            }
            return {"nodes": nodes, "datasets": datasets, "jobs": jobs, "clients": clients}

