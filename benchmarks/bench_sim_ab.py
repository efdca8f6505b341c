"""Two simulator engines side by side: this checkout against a base revision, cell by cell.

    python benchmarks/bench_sim_ab.py --base REV [--cells fifo/silod,gavel/alluxio] [--require-identical] [--out FILE]

Each Fig. 12 cell (policy/cache system on the 2,000-job synthetic Philly-distribution trace,
400 GPUs, 100 TB, 4 GB/s, as `silod experiment matrix` runs it) is simulated by the base revision
(checked out into a temporary git worktree) and by this checkout at the same time, one process per
core, so that both see the same machine: single runs on a shared 2-core VM drift by 10-25% within
an hour, more than most engine changes move them. Prints each cell's CPU seconds on both, their
ratio, and whether the cell's summary (every field but the timings) is the same to the last bit;
`--require-identical` exits 1 when one is not (an engine change meant to be exact).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("fifo", "sjf", "gavel")
CACHE_SYSTEMS = ("silod", "alluxio", "coordl", "quiver")

CHILD = r"""
import hashlib, json, sys, time
sys.path.insert(0, {root!r})
from scheduler.sim import experiments
from scheduler.sim.experiments import Run, TraceSource, _capacity, simulate_run
if not experiments.__file__.startswith({root!r}):  # an installed copy would shadow the tree
    raise SystemExit(f"imported {{experiments.__file__}}, not the tree at {root}")
c = time.process_time()
s = simulate_run(Run("{policy}/{cache}", "{policy}", "{cache}", _capacity()), TraceSource(None, None, 0), 360.0, 128).summary
cpu = time.process_time() - c
kept = {{k: s[k] for k in sorted(s) if not k.startswith("sim_")}}
print(json.dumps({{"cpu_s": cpu, "digest": hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()}}))
"""


def parse_cells(text: str) -> list[tuple[str, str]]:
    cells = []
    for item in text.split(","):
        policy, _, cache = item.strip().partition("/")
        if policy not in POLICIES or cache not in CACHE_SYSTEMS:
            raise argparse.ArgumentTypeError(
                f"cell {item.strip()!r} is not POLICY/CACHE with POLICY in {', '.join(POLICIES)} and CACHE in {', '.join(CACHE_SYSTEMS)}")
        cells.append((policy, cache))
    return cells


def resolve(rev: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise argparse.ArgumentTypeError(f"--base {rev!r} is not a commit of this repository (git rev-parse found none)")
    return out.stdout.strip()


def start(root: Path, policy: str, cache: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(root), policy=policy, cache=cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())


def result(proc: subprocess.Popen, which: str) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the {which} engine failed:\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def out_file(text: str) -> Path:
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"--out {text!r}: directory {str(path.parent)!r} does not exist; create it first")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=resolve, help="revision to compare against (e.g. main~3)")
    ap.add_argument("--cells", type=parse_cells, default=[(p, c) for p in POLICIES for c in CACHE_SYSTEMS],
                    help="comma-separated POLICY/CACHE cells (default: all 12)")
    ap.add_argument("--require-identical", action="store_true", help="exit 1 if any cell's summary differs")
    ap.add_argument("--out", type=out_file, help="write the figures as JSON")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="silod-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base), args.base], check=True)
        try:
            for policy, cache in args.cells:
                old, new = start(base, policy, cache), start(ROOT, policy, cache)
                a, b = result(old, "base"), result(new, "checked-out")
                same = a["digest"] == b["digest"]
                rows.append({"cell": f"{policy}/{cache}", "base_cpu_s": a["cpu_s"], "cpu_s": b["cpu_s"],
                             "ratio": b["cpu_s"] / a["cpu_s"], "identical": same})
                print(f"{policy + '/' + cache:<15} base {a['cpu_s']:6.1f} CPU s   this {b['cpu_s']:6.1f} CPU s   "
                      f"{b['cpu_s'] / a['cpu_s']:5.2f}x   {'identical' if same else 'DIFFERENT'}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    total_a, total_b = sum(r["base_cpu_s"] for r in rows), sum(r["cpu_s"] for r in rows)
    differ = [r["cell"] for r in rows if not r["identical"]]
    print(f"sum: base {total_a:.1f} CPU s, this {total_b:.1f} CPU s ({total_b / total_a:.3f}x); "
          f"{len(rows) - len(differ)} of {len(rows)} cells identical" + (f" (different: {', '.join(differ)})" if differ else ""))
    if args.out:
        args.out.write_text(json.dumps({"base": args.base, "cells": rows, "base_cpu_s": total_a, "cpu_s": total_b}, indent=2))
    return 1 if differ and args.require_identical else 0


if __name__ == "__main__":
    sys.exit(main())
