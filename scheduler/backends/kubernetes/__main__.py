"""`python -m scheduler.backends.kubernetes`: run silod as a secondary Kubernetes scheduler.

    python -m scheduler.backends.kubernetes --policy fifo --cache 2TB --remote-io 1GB/s

Jobs are pods with `schedulerName: silod` and the silod.io/* label and annotations
(docs/kubernetes.md). Scheduling decisions come from the shared SchedulingCore.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from estimator.errors import UserError
from estimator.units import parse_rate, parse_size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler.backends.kubernetes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="fifo", help="fifo | sjf | gavel | greedy | a plug-in")
    parser.add_argument("--cache-system", default="silod", help="silod manages cache and remote IO; "
                        "anything else uses the storage-unaware estimator")
    parser.add_argument("--cache", default="0", help="cluster cache total, e.g. 2TB (node annotations "
                        "silod.io/cache-capacity win when present)")
    parser.add_argument("--remote-io", default="1GB/s", help="cluster egress from remote storage, e.g. 1GB/s")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between rounds")
    parser.add_argument("--namespace", default=None, help="only schedule silod pods of this namespace")
    parser.add_argument("--kubeconfig", default=None)
    parser.add_argument("--context", default=None)
    parser.add_argument("--preempt", action="store_true", help="delete the pods of running jobs the policy "
                        "no longer chooses (time-sharing policies; pods must be owned by a controller)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from policies.registry import estimator_for, get_policy
        from scheduler.backends.kubernetes import KubernetesBackend, KubernetesScheduler, Watcher, load_api

        cache = parse_size(args.cache, "--cache")
        remote_io = parse_rate(args.remote_io, "--remote-io")
        api = load_api(args.kubeconfig, args.context)
        backend = KubernetesBackend(api, namespace=args.namespace)
        scheduler = KubernetesScheduler(backend, get_policy(args.policy), estimator_for(args.cache_system),
                                        cache=cache, remote_io=remote_io, preempt=args.preempt)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (stop.set(), scheduler.wake.set()))
    watcher = Watcher(api, scheduler.wake)
    watcher.start()
    try:
        scheduler.run_forever(args.interval, stop)
    finally:
        watcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
