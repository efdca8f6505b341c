"""Cost of LRU mode and of the partitions, each as a ratio against a reference in the same run.

    python benchmarks/bench_lru.py [--items 5000] [--jobs 1000] [--json out.json]

1. hit     open+close of cached items (the FUSE hit path's cache work) in LRU mode, which
           notes each hit in memory (stamped on the files every tick; the flush is timed
           separately), against uniform mode.
2. admit   admissions into a *full* LRU cache (each must evict; victims chosen by scanning
           the index's stamps, amortised by the 1% batch) against admissions into a uniform
           cache with room (no eviction), same item sizes.
3. policy  one scheduling decision with the partitions (a third of the jobs irregular: three
           policy calls plus the shared pool) against the plain policy call on the same jobs,
           for fifo, sjf and gavel.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from estimator.access import EPOCH, IRREGULAR  # noqa: E402
from fuse_client.cache_store import DatasetCache, file_crc32, item_key  # noqa: E402
from fuse_client.lru_cache import CacheMode  # noqa: E402
from policies import ClusterCapacity, DatasetView, JobView, SiloDEstimator, Snapshot, get_policy  # noqa: E402
from scheduler.core.partition import allocate_partitioned  # noqa: E402

ITEM = 4096


def _fill(cache: DatasetCache, prefix: str, n: int) -> None:
    for i in range(n):
        key = item_key(f"{prefix}{i}")
        fd, path = cache.new_staging_file(key)
        os.pwrite(fd, b"x" * ITEM, 0)
        crc = file_crc32(fd, ITEM)
        os.close(fd)
        if not cache.publish(key, path, ITEM, crc):
            os.unlink(path)


def bench_hit(root: Path, items: int) -> dict:
    out = {}
    for mode in (CacheMode.UNIFORM, CacheMode.LRU):
        cache = DatasetCache(root / mode.value, "ds")
        cache.set_mode(mode)
        _fill(cache, "i", items)
        keys = [item_key(f"i{i}") for i in range(items)]
        random.Random(0).shuffle(keys)
        t0 = time.perf_counter()
        for key in keys:
            os.close(cache.open_cached(key))
        out[mode.value] = items / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        stamped = cache.flush_recency()
        out[f"{mode.value}_flush_us_per_item"] = (time.perf_counter() - t0) / max(stamped, 1) * 1e6
    return {"uniform_hits_per_s": out["uniform"], "lru_hits_per_s": out["lru"], "lru_over_uniform": out["lru"] / out["uniform"],
            "lru_flush_us_per_item": out["lru_flush_us_per_item"]}


def bench_admit(root: Path, items: int, admissions: int) -> dict:
    lru = DatasetCache(root / "admit-lru", "ds")
    lru.set_allocation(items * ITEM)
    lru.set_mode(CacheMode.LRU)
    _fill(lru, "old", items)  # full
    t0 = time.perf_counter()
    _fill(lru, "new", admissions)
    lru_s = (time.perf_counter() - t0) / admissions
    assert lru.usage().cached_bytes <= items * ITEM
    uniform = DatasetCache(root / "admit-uniform", "ds")
    _fill(uniform, "old", items)  # same index size, unlimited allocation: every item admitted
    t0 = time.perf_counter()
    _fill(uniform, "new", admissions)
    uniform_s = (time.perf_counter() - t0) / admissions
    return {"items": items, "lru_admit_us": lru_s * 1e6, "uniform_admit_us": uniform_s * 1e6, "lru_over_uniform_time": lru_s / uniform_s}


def _snapshot(n: int, irregular_every: int) -> Snapshot:
    rng = random.Random(1)
    jobs = tuple(
        JobView(f"j{i}", rng.choice([1, 1, 2, 4, 8]), f"d{i % (n // 3 + 1)}", rng.uniform(2e6, 9e8), rng.uniform(1e10, 1e14),
                float(i), rng.random() < 0.5, access=IRREGULAR if irregular_every and i % irregular_every == 0 else EPOCH)
        for i in range(n)
    )
    datasets = {j.dataset: DatasetView(j.dataset, 1e12) for j in jobs}
    return Snapshot(0.0, jobs, datasets, ClusterCapacity(gpus=400, cache=1e14, remote_io=4e9, gpus_per_node=8))


def bench_policy(jobs: int, repeats: int = 3) -> dict:
    out = {}
    mixed = _snapshot(jobs, irregular_every=3)
    for name in ("fifo", "sjf", "gavel"):
        policy = get_policy(name)
        times = {}
        for label, call in (("plain", lambda: policy.allocate(mixed, SiloDEstimator())),
                            ("partitioned", lambda: allocate_partitioned(mixed, policy, SiloDEstimator()))):
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - t0)
            times[label] = best
        out[name] = {"plain_ms": times["plain"] * 1e3, "partitioned_ms": times["partitioned"] * 1e3,
                     "ratio": times["partitioned"] / times["plain"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=5_000)
    ap.add_argument("--admissions", type=int, default=1_000)
    ap.add_argument("--jobs", type=int, default=1_000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "hit": bench_hit(Path(tmp), args.items),
            "admit": bench_admit(Path(tmp), args.items, args.admissions),
            "policy": bench_policy(args.jobs),
        }
    h, a = results["hit"], results["admit"]
    print(f"hit path   uniform {h['uniform_hits_per_s']:,.0f}/s  lru {h['lru_hits_per_s']:,.0f}/s  ratio {h['lru_over_uniform']:.2f}"
          f"  (tick flush, off the hit path: {h['lru_flush_us_per_item']:.0f} us per hit item)")
    print(f"admission  ({a['items']:,} items) uniform {a['uniform_admit_us']:.0f} us  lru (evicting) {a['lru_admit_us']:.0f} us  "
          f"ratio {a['lru_over_uniform_time']:.2f}")
    for name, r in results["policy"].items():
        print(f"decision   {name:6s} {args.jobs} jobs: plain {r['plain_ms']:.1f} ms  partitioned {r['partitioned_ms']:.1f} ms  ratio {r['ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
