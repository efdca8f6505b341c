"""Does the DataLoader's in-order hand-out cost the real PyTorch job at partial caches?

For each c/d, one `silod mount` (link free) and two trainers of silod_client/examples/train_cnn.py
on it, one with torch's in_order=True (the default) and one with in_order=False; after each has
run one epoch (the first fills the cache), their epochs alternate A-B-B-A so that the machine's
drift falls on both alike, and the figure is the median over pairs of out-of-order / in-order
epoch rate. Head-of-line blocking (a slow batch holding up faster ones) would show as a ratio
above the c/d = 0 and c/d = 1 points' (all misses, all hits: no spread in misses per batch).

    .venv/bin/python benchmarks/bench_loader_order.py [--pairs 10] [--fractions 0,0.25,0.5,0.75,1]
        [--prefetch 2] [--out FILE] [--b-prefetch 8 --b-in-order]

`--b-prefetch N --b-in-order` makes the second trainer an in-order one with a deeper read-ahead
(torch's prefetch_factor N) instead: the other way round head-of-line blocking, a deeper window.

Needs torch, /dev/fuse, fusermount3 and root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pytorch_estimator import FRACTIONS, MB, median, mounted, rate, trainer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10, help="A-B pairs of epochs per c/d")
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--fractions", default=",".join(f"{c:g}" for c in FRACTIONS))
    ap.add_argument("--b-prefetch", type=int, default=None, help="the second trainer's prefetch (default --prefetch)")
    ap.add_argument("--b-in-order", action="store_true", help="the second trainer in order too (with --b-prefetch)")
    ap.add_argument("--out", type=Path, default=Path("bench_loader_order.json"))
    args = ap.parse_args(argv)
    try:
        fractions = [float(v) for v in args.fractions.split(",")]
    except ValueError:
        ap.error(f"--fractions {args.fractions!r}: give comma-separated numbers in [0, 1], e.g. 0,0.5,1")
    b_prefetch = args.prefetch if args.b_prefetch is None else args.b_prefetch
    if any(not 0 <= c <= 1 for c in fractions) or args.pairs < 1 or args.images < 16 or min(args.prefetch, b_prefetch) < 1:
        ap.error("each --fractions value must be in [0, 1], --pairs >= 1, --images >= 16, --prefetch and --b-prefetch >= 1")
    b_name = f"{'in-order' if args.b_in_order else 'out-of-order'} prefetch {b_prefetch}"
    from scheduler.backends.local import fuse_problems
    from scheduler.demo import make_jpegs, torch_problem

    problems = fuse_problems() + ([torch_problem()] if torch_problem() else [])
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="silod-bench-order-"))
    out = {}
    try:
        source = work / "remote" / "jpegs"
        d = make_jpegs(source, args.images, seed=1)
        load0 = os.getloadavg()[0]
        for i, c in enumerate(fractions):
            with mounted(work, source, f"o{i}", c * d * (1.02 if c >= 1 else 1.0), None) as (mnt, stats, _pid):
                a, b = trainer(mnt, 2, args.prefetch, True), trainer(mnt, 2, b_prefetch, args.b_in_order)
                try:
                    a.epoch()
                    b.epoch()
                    ra: list[float] = []
                    rb: list[float] = []
                    for k in range(args.pairs):
                        for t in ((a, b) if k % 2 == 0 else (b, a)):
                            (ra if t is a else rb).append(rate(t.epoch()))
                finally:
                    a.close()
                    b.close()
            ratios = [y / x for x, y in zip(ra, rb)]
            out[f"{c:g}"] = {"in_order_mb_s": median(ra) / MB, "b_mb_s": median(rb) / MB,
                             "ratio": median(ratios), "spread": [min(ratios), max(ratios)]}
            print(f"c/d={c:g}: in-order prefetch {args.prefetch} {median(ra) / MB:.3f} MB/s, {b_name} {median(rb) / MB:.3f} MB/s,"
                  f" ratio {median(ratios):.3f} (pairs {min(ratios):.2f}-{max(ratios):.2f})", flush=True)
        print(f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        args.out.write_text(json.dumps({"prefetch": args.prefetch, "b": b_name, "pairs": args.pairs, "points": out}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
