"""The ASGI app of one `silod serve` API worker (uvicorn imports it by name, once per worker
process): an ApiService over the database, the same routes as in-process, no scheduling loop.
`silod serve` passes its checked options in SILOD_SERVE_WORKER_CONFIG."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

from fastapi import FastAPI


def create_worker_app() -> FastAPI:
    from scheduler.service.api.app import create_app
    from scheduler.service.cli import WORKER_CONFIG_ENV, build_api_service, make_token_store, parse_quota

    raw = os.environ.get(WORKER_CONFIG_ENV)
    if not raw:
        raise RuntimeError(f"{WORKER_CONFIG_ENV} is not set: run API workers through `silod serve`")
    cfg = json.loads(raw)
    if cfg.get("serve_pid") and int(cfg["serve_pid"]) != os.getpid():
        # A worker process of `silod serve --workers N`: it must not outlive its parent (kill -9
        # left workers serving, headless, holding the port). With one worker uvicorn runs the
        # app in the parent itself.
        import signal

        from scheduler.service.lifeline import die_with_parent

        die_with_parent(int(cfg["serve_pid"]), signal.SIGKILL)
    build = dict(cfg["build"])
    if build.get("cluster_file"):
        build["cluster_file"] = Path(build["cluster_file"])
    service = build_api_service(**build, default_quota=parse_quota(cfg.get("default_quota")))
    tokens = make_token_store(service.engine, Path(cfg["state_dir"]), None, require_any=False)
    failures = None
    if cfg.get("auth_failures"):  # the failed-token table every worker of this server shares
        from http_guard.auth_limit import FailedAuthLimiter

        failures = FailedAuthLimiter(path=cfg["auth_failures"])
    app = create_app(service, tokens, run_loop=False, max_body=int(cfg["max_body"]), failures=failures)
    # What is built by now lives as long as the worker: frozen out of the cyclic GC's reach, a
    # full collection no longer walks it (~25 ms each over the modules and app a worker holds,
    # paid by whichever request set it off: GET's p99 at 16 clients was 1.6-2.1x the bare app's).
    gc.collect()
    gc.freeze()
    return app
