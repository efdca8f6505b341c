"""The mount's stats file (`silod mount --stats-file`), as the control plane reads it.

The mount rewrites the file atomically at least once a second; the local backend's workers read
it to report a job's hits, misses and cache. These are the fields both sides rely on (the file
carries more: latency histograms, epoch progress), all byte counts since the mount started.
"""

from __future__ import annotations

#: The stats file's contract (docs/data-plane.md, "Mount a dataset"): every stats file has these.
REQUIRED_FIELDS = ("remote_bytes", "hit_bytes", "miss_bytes", "cached_bytes", "items_cached", "read_bytes")

#: What a worker's status report carries from the mount: the required fields and the allocation
#: the mount is enforcing (None until the mount has one).
REPORTED_FIELDS = REQUIRED_FIELDS + ("cache_allocation_bytes", "io_rate_bytes_per_s", "manager_connected",
                                     # per-miss service time ({"count", "sum_s", "bytes"}, cumulative): the
                                     # loader term's L (scheduler/service/measured_params.py)
                                     "miss_service")
