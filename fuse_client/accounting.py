"""Per-job accounting of the data plane: what the job read, from where, and how fast.

One `JobAccounting` per mount (a mount serves one job). It is fed by the FUSE layer and read by
the stats-file writer and the heartbeat to the data manager. It holds no I/O; time is passed in.

The epoch bitset implements SiloD's "delayed effectiveness" bookkeeping (§6): a bit per item,
set when the job reads the item in the current epoch. When every bit is set the epoch is over
and the bitset is cleared. Bytes of items that this job fetched *and* admitted into the cache
during the current epoch do not help the job until its next epoch, so they are subtracted from
the dataset's cached bytes to give the job's effective cache.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import asdict, dataclass, field

# Observed throughput is an exponentially weighted moving average with this time constant:
# long enough to smooth per-item bursts, short enough to follow an allocation change.
THROUGHPUT_TAU_S = 2.0


class EpochBitset:
    """One bit per item (items are numbered by their index in the dataset listing)."""

    def __init__(self, num_items: int) -> None:
        self.num_items = num_items
        self._bits = bytearray((num_items + 7) // 8)
        self.count = 0

    def test(self, index: int) -> bool:
        return bool(self._bits[index >> 3] & (1 << (index & 7)))

    def set(self, index: int) -> bool:
        """Set bit `index`; return True if it was newly set."""
        byte, mask = index >> 3, 1 << (index & 7)
        if self._bits[byte] & mask:
            return False
        self._bits[byte] |= mask
        self.count += 1
        return True

    def full(self) -> bool:
        return self.num_items > 0 and self.count == self.num_items

    def clear(self) -> None:
        self._bits = bytearray(len(self._bits))
        self.count = 0


# Open latency buckets (seconds, upper bounds): 50 us .. 10 s, so a page-cache hit, a local
# miss and a remote stall each land in their own decade.
LATENCY_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class LatencyHistogram:
    """Counts of open latencies per bucket (Prometheus style: cumulative `le` buckets on export)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    sum_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1  # first bound >= seconds
        self.sum_s += seconds
        self.count += 1

    def export(self) -> dict:
        """{"buckets": [[le, cumulative count], ..., ["+Inf", count]], "sum_s", "count"}."""
        buckets, running = [], 0
        for bound, n in zip([*LATENCY_BUCKETS_S, "+Inf"], self.counts):
            running += n
            buckets.append([bound, running])
        return {"buckets": buckets, "sum_s": self.sum_s, "count": self.count}

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (None without observations)."""
        if not self.count:
            return None
        target, running = q * self.count, 0
        for bound, n in zip([*LATENCY_BUCKETS_S, float("inf")], self.counts):
            running += n
            if running >= target:
                return bound
        return float("inf")


@dataclass
class StatsSnapshot:
    """What the stats file and the heartbeat report. Field names are the contract's."""

    remote_bytes: int
    hit_bytes: int
    miss_bytes: int
    read_bytes: int
    hits: int
    misses: int
    shared_fetches: int
    epoch: int
    items_read_epoch: int
    items_total: int
    ineffective_cached_bytes: int
    throughput_bytes_per_s: float
    remote_rate_bytes_per_s: float
    remote_errors: int
    failed_opens: int
    open_latency_hit: dict
    open_latency_miss: dict
    # Per-miss service time (JobAccounting.miss_served): {"buckets", "sum_s", "count", "bytes"}.
    miss_service: dict


@dataclass
class _Rate:
    """EWMA of a byte counter's rate."""

    value: float = 0.0
    last_time: float | None = None
    last_count: int = 0

    def update(self, count: int, now: float) -> float:
        if self.last_time is None:
            self.last_time, self.last_count = now, count
            return self.value
        dt = now - self.last_time
        if dt <= 0:
            return self.value
        instant = (count - self.last_count) / dt
        alpha = 1.0 - math.exp(-dt / THROUGHPUT_TAU_S)
        self.value += alpha * (instant - self.value)
        self.last_time, self.last_count = now, count
        return self.value


# Distinct pods one mount keeps counters for; reads of further pods count as unattributed (a node
# runs far fewer pods than this over a mount's lifetime).
MAX_PODS = 4096


@dataclass
class PodCounters:
    """What one pod read through this mount (the node agent reports these per pod)."""

    read_bytes: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    hits: int = 0
    misses: int = 0
    # Its misses' service time (JobAccounting.miss_served): how many were delivered whole, their
    # summed service time in whole microseconds (counters stay integers that only rise, as the
    # node agent carries them over mount restarts), and their bytes. A Kubernetes pod's job gets
    # the loader term's L (estimator.loader_miss_rate) from these, through its agent's reports.
    miss_service_count: int = 0
    miss_service_us: int = 0
    miss_service_bytes: int = 0


@dataclass
class JobAccounting:
    num_items: int
    remote_bytes: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    hits: int = 0
    misses: int = 0
    shared_fetches: int = 0
    epoch: int = 0
    ineffective_cached_bytes: int = 0
    remote_errors: int = 0  # failed attempts to read from the remote (each retry counts)
    failed_opens: int = 0  # opens answered with EIO (remote failures and breaker rejections)
    latency_hit: LatencyHistogram = field(default_factory=LatencyHistogram)
    latency_miss: LatencyHistogram = field(default_factory=LatencyHistogram)
    # How long each missed item held its reader: from the open request reaching this process to
    # the item's last byte delivered (see DatasetOperations). The estimator's loader term
    # (estimator.loader_miss_rate: m = W s / L) needs L, the time a miss keeps one loader worker
    # from its next item; the open alone (latency_miss) ends before a daemon-served miss's bytes
    # are read, and the remote fetch alone leaves out queueing for the open pool and the reads.
    miss_service: LatencyHistogram = field(default_factory=LatencyHistogram)
    miss_service_bytes: int = 0  # bytes of the items counted in miss_service (s = bytes / count)
    bitset: EpochBitset = field(init=False)
    _read_rate: _Rate = field(default_factory=_Rate)
    _remote_rate: _Rate = field(default_factory=_Rate)
    pods: dict[str, PodCounters] = field(default_factory=dict)  # pod uid -> counters (agent mounts)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.bitset = EpochBitset(self.num_items)

    def item_opened(self, index: int, hit: bool, shared_fetch: bool = False, admitted_size: int = 0) -> None:
        """The job started reading item `index`; `hit` says whether it came from the cache.

        `admitted_size` > 0 when this job's own fetch put the item into the cache: those bytes
        only become useful to this job in its next epoch.
        """
        with self._lock:
            # A re-read within an epoch (e.g. a retry) leaves the bitset and the epoch unchanged.
            self.bitset.set(index)
            if hit:
                self.hits += 1
            else:
                self.misses += 1
                if shared_fetch:
                    self.shared_fetches += 1
            self.ineffective_cached_bytes += admitted_size
            if self.bitset.full():
                self.epoch += 1
                self.bitset.clear()
                self.ineffective_cached_bytes = 0

    def fetch_admitted(self, size: int) -> None:
        """This job's own fetch of an item opened while it was fetched (a streaming open,
        item_opened before its end) was admitted: the admitted_size of item_opened, told late."""
        with self._lock:
            self.ineffective_cached_bytes += size

    def hit_opened(self, index: int, seconds: float, nbytes_read: int = 0) -> None:
        """item_opened(hit=True) + open_finished(hit=True) [+ bytes_read(hit=True)] under one
        lock acquisition: this is the hot path of cached reads."""
        with self._lock:
            bits = self.bitset
            bits.set(index)
            self.hits += 1
            self.hit_bytes += nbytes_read
            self.latency_hit.observe(seconds)
            if bits.full():
                self.epoch += 1
                bits.clear()
                self.ineffective_cached_bytes = 0

    def bytes_read(self, nbytes: int, hit: bool, pod: str = "") -> None:
        with self._lock:
            if hit:
                self.hit_bytes += nbytes
            else:
                self.miss_bytes += nbytes
            if pod and (c := self._pod(pod)) is not None:
                c.read_bytes += nbytes
                if hit:
                    c.hit_bytes += nbytes
                else:
                    c.miss_bytes += nbytes

    def pod_opened(self, pod: str, hit: bool, nbytes: int = 0) -> None:
        """An item opened by a process of pod `pod` (its uid, from the caller's cgroup);
        `nbytes`: the bytes of it already accounted as read at open (kernel-served reads)."""
        if not pod:
            return
        with self._lock:
            if (c := self._pod(pod)) is not None:
                if hit:
                    c.hits += 1
                    c.hit_bytes += nbytes
                else:
                    c.misses += 1
                    c.miss_bytes += nbytes
                c.read_bytes += nbytes

    def _pod(self, pod: str) -> PodCounters | None:
        c = self.pods.get(pod)
        if c is None and len(self.pods) < MAX_PODS:
            c = self.pods[pod] = PodCounters()
        return c

    def pod_snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {uid: asdict(c) for uid, c in self.pods.items()}

    def open_finished(self, seconds: float, hit: bool) -> None:
        """Latency of one open, from the FUSE request to a ready descriptor."""
        with self._lock:
            (self.latency_hit if hit else self.latency_miss).observe(seconds)

    def miss_served(self, seconds: float, nbytes: int, pod: str = "") -> None:
        """A missed item of `nbytes` was delivered whole, `seconds` after its open request arrived
        (`pod`: the uid of the pod whose process opened it, counted for it too)."""
        with self._lock:
            self.miss_service.observe(max(0.0, seconds))
            self.miss_service_bytes += nbytes
            if pod and (c := self._pod(pod)) is not None:
                c.miss_service_count += 1
                c.miss_service_us += round(max(0.0, seconds) * 1e6)
                c.miss_service_bytes += nbytes

    def remote_error(self) -> None:
        with self._lock:
            self.remote_errors += 1

    def open_failed(self) -> None:
        with self._lock:
            self.failed_opens += 1

    def bytes_fetched(self, nbytes: int) -> None:
        with self._lock:
            self.remote_bytes += nbytes

    def items_evicted(self, nbytes: int) -> None:
        """Evictions may remove items counted as ineffective; never report a negative figure."""
        with self._lock:
            self.ineffective_cached_bytes = max(0, self.ineffective_cached_bytes - nbytes)

    def snapshot(self, now: float) -> StatsSnapshot:
        with self._lock:
            read = self.hit_bytes + self.miss_bytes
            return StatsSnapshot(
                remote_bytes=self.remote_bytes,
                hit_bytes=self.hit_bytes,
                miss_bytes=self.miss_bytes,
                read_bytes=read,
                hits=self.hits,
                misses=self.misses,
                shared_fetches=self.shared_fetches,
                epoch=self.epoch,
                items_read_epoch=self.bitset.count,
                items_total=self.num_items,
                ineffective_cached_bytes=self.ineffective_cached_bytes,
                throughput_bytes_per_s=self._read_rate.update(read, now),
                remote_rate_bytes_per_s=self._remote_rate.update(self.remote_bytes, now),
                remote_errors=self.remote_errors,
                failed_opens=self.failed_opens,
                open_latency_hit=self.latency_hit.export(),
                open_latency_miss=self.latency_miss.export(),
                miss_service={**self.miss_service.export(), "bytes": self.miss_service_bytes},
            )
