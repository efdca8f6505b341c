"""`silod serve` (the scheduler service) and the thin API clients `silod submit|jobs|cancel|datasets`.

FastAPI, uvicorn and SQLAlchemy are imported inside the commands, so `silod --help` and the
simulator do not pay for them. Every user mistake is a UserError: `error: ...`, exit code 2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from estimator.errors import UserError

DEFAULT_SERVER = "http://127.0.0.1:8080"


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise UserError(f"--listen {value!r} must be HOST:PORT, e.g. 127.0.0.1:8080 or 0.0.0.0:8080")
    return host.strip("[]"), int(port)


_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*$")


def parse_duration(value: str, what: str = "--round") -> float:
    """Seconds from `360`, `5s`, `6m`, `1h`, `500ms`."""
    m = _DURATION_RE.match(value)
    if not m:
        raise UserError(f"{what} {value!r} is not a duration; write seconds or e.g. 5s, 6m, 1h")
    scale = {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}[m.group(2)]
    seconds = float(m.group(1)) * scale
    if not (0.05 <= seconds <= 86400):
        raise UserError(f"{what} {value!r} must be between 50ms and 24h")
    return seconds


def make_pusher(url: str) -> Any:
    """The data manager's client (datamanager.client), checked against the StoragePusher protocol."""
    from scheduler.service import StoragePusher

    try:
        import datamanager.client as dm_client
    except ModuleNotFoundError as exc:
        raise UserError(f"--datamanager needs datamanager.client, which is not available: {exc}") from exc
    cls = getattr(dm_client, "DataManagerClient", None)
    if cls is None:  # tolerate another class name as long as it has the three methods
        candidates = [
            obj for obj in vars(dm_client).values()
            if isinstance(obj, type) and obj.__module__ == dm_client.__name__
            and all(hasattr(obj, m) for m in ("allocate_cache_size", "allocate_remote_io", "status"))
        ]
        if not candidates:
            raise UserError("datamanager.client has no client class with allocate_cache_size/allocate_remote_io/status")
        cls = candidates[0]
    pusher = cls(url)
    if not isinstance(pusher, StoragePusher):
        raise UserError(f"{cls.__name__} does not implement allocate_cache_size/allocate_remote_io/status")
    return pusher


def parse_backend_opts(values: list[str] | None) -> dict[str, str]:
    opts: dict[str, str] = {}
    for item in values or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise UserError(f"--backend-opt {item!r} must be KEY=VALUE")
        opts[key.strip()] = val.strip()
    return opts


def build_service(
    *,
    db: str,
    backend: str,
    policy: str | None,
    round_s: float,
    cluster_file: Path | None = None,
    gpus: str | None = None,
    gpus_per_node: str | None = None,
    cache: str | None = None,
    remote_io: str | None = None,
    gpu_speed: str | None = None,
    datamanager: str | None = None,
    state_dir: Path = Path("silod-state"),
    backend_opts: dict[str, str] | None = None,
):  # type: ignore[no-untyped-def]
    """Everything `silod serve` assembles, minus HTTP (the benchmarks and tests reuse it)."""
    from policies.registry import available_policies
    from scheduler.backends.base import BackendConfig, load_backend
    from scheduler.cluster import load_cluster
    from scheduler.db import open_database
    from scheduler.service import SchedulerService, ServiceConfig

    if policy is not None and policy not in available_policies():
        raise UserError(f"unknown policy {policy!r}; choose one of: {', '.join(available_policies())}")
    capacity, speed = load_cluster(
        cluster_file, gpus=gpus, gpus_per_node=gpus_per_node, cache=cache, remote_io=remote_io, gpu_speed=gpu_speed
    )
    pusher = make_pusher(datamanager) if datamanager else None
    state_dir.mkdir(parents=True, exist_ok=True)
    cluster_backend = load_backend(
        backend, BackendConfig(capacity=capacity, state_dir=state_dir, datamanager_url=datamanager, options=backend_opts or {})
    )
    engine = open_database(db)
    if pusher is not None and backend == "local":
        from scheduler.backends.local import LocalBackend, WorkConservingPusher

        if isinstance(cluster_backend, LocalBackend):
            # Link capacity the policy's caps leave unused goes to running jobs that want more
            # (e.g. while their cache fills), from the workers' measured demand.
            pusher = WorkConservingPusher(pusher, cluster_backend, capacity.remote_io)
    config = ServiceConfig(capacity=capacity, policy=policy, round_seconds=round_s, gpu_speed=speed)
    service = SchedulerService(engine, cluster_backend, config, pusher=pusher, datamanager_url=datamanager)
    attach = getattr(cluster_backend, "attach", None)  # backends that also feed the queue (kubectl workloads)
    if callable(attach):
        attach(service)
    return service


# ---------------------------------------------------------------- HTTP client side


def _client(server: str | None, token: str | None):  # type: ignore[no-untyped-def]
    import httpx

    server = server or os.environ.get("SILOD_SERVER") or DEFAULT_SERVER
    token = token or os.environ.get("SILOD_TOKEN")
    if not token:
        raise UserError("no API token: pass --token or set SILOD_TOKEN")
    return httpx.Client(base_url=server, headers={"Authorization": f"Bearer {token}"}, timeout=30.0)


def _call(server: str | None, token: str | None, method: str, path: str, **kwargs: Any) -> Any:
    import httpx

    with _client(server, token) as client:
        try:
            response = client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise UserError(f"cannot reach the silod server at {client.base_url}: {exc}") from exc
    if response.status_code >= 400:
        raise UserError(f"{method} {path}: HTTP {response.status_code}: {_error_text(response)}")
    return response.json()


def _error_text(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    detail = body.get("detail") if isinstance(body, dict) else body
    if isinstance(detail, list):  # FastAPI validation errors: name each field
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', [])[1:])}: {e.get('msg')}" for e in detail)
    return str(detail)


ServerOpt = Annotated[str | None, typer.Option("--server", help="API base URL [env SILOD_SERVER, default http://127.0.0.1:8080]")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="bearer token [env SILOD_TOKEN]")]


def _rate_or_number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        listen: Annotated[str, typer.Option(help="HOST:PORT to listen on")] = "127.0.0.1:8080",
        db: Annotated[str, typer.Option(help="sqlite:///FILE or postgresql+psycopg://USER@HOST/DB")] = "sqlite:///silod.db",
        backend: Annotated[str, typer.Option(help="where jobs run: local | kubernetes")] = "local",
        gpus: Annotated[str | None, typer.Option(help="GPUs in the cluster")] = None,
        gpus_per_node: Annotated[str | None, typer.Option("--gpus-per-node", help="GPUs per node")] = None,
        cache: Annotated[str | None, typer.Option(help="cluster cache, e.g. 2TB")] = None,
        remote_io: Annotated[str | None, typer.Option("--remote-io", help="remote storage bandwidth, e.g. 1GB/s")] = None,
        gpu_speed: Annotated[str | None, typer.Option("--gpu-speed", help="GPU speed vs a V100 (scales catalog f*)")] = None,
        cluster: Annotated[Path | None, typer.Option("--cluster", help="YAML file with the cluster keys")] = None,
        policy: Annotated[str | None, typer.Option(help="fifo | sjf | gavel | greedy | plug-in [default: last used, else fifo]")] = None,
        tokens: Annotated[Path | None, typer.Option("--tokens", help="user tokens, one 'user:token' per line")] = None,
        datamanager: Annotated[str | None, typer.Option("--datamanager", help="data manager URL (cache and IO enforcement)")] = None,
        round_: Annotated[str, typer.Option("--round", help="round length, e.g. 360, 5s, 6m")] = "360",
        state_dir: Annotated[Path, typer.Option("--state-dir", help="directory the backend may use")] = Path("silod-state"),
        backend_opt: Annotated[list[str] | None, typer.Option("--backend-opt", help="backend option KEY=VALUE (repeatable)")] = None,
        log_level: Annotated[str, typer.Option("--log-level")] = "info",
    ) -> None:
        """Run the scheduler service: REST API under /v1, /docs, /healthz, /metrics."""
        import logging

        host, port = parse_listen(listen)
        round_s = parse_duration(round_)
        from scheduler.api.auth import ADMIN_TOKEN_ENV, TokenStore

        token_store = TokenStore.load(os.environ.get(ADMIN_TOKEN_ENV), tokens)
        service = build_service(
            db=db, backend=backend, policy=policy, round_s=round_s, cluster_file=cluster, gpus=gpus,
            gpus_per_node=gpus_per_node, cache=cache, remote_io=remote_io, gpu_speed=gpu_speed,
            datamanager=datamanager, state_dir=state_dir, backend_opts=parse_backend_opts(backend_opt),
        )
        import uvicorn

        from scheduler.api.app import create_app

        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        elector = getattr(service.backend, "elector", None)
        app = create_app(service, token_store, run_loop=elector is None)
        if elector is not None:
            from scheduler.backends.kubernetes.leader import run_when_leading

            run_when_leading(elector, service)
        typer.echo(
            f"silod serve: http://{host}:{port} (docs at /docs), db {service.engine.url.render_as_string(hide_password=True)}, "
            f"backend {backend}, policy {service.policy_name}, round {round_s:g}s",
            err=True,
        )
        try:
            uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), access_log=False)
        finally:
            service.close()

    @app.command()
    def submit(
        name: Annotated[str, typer.Option(help="job name")],
        gpus: Annotated[int, typer.Option(help="GPUs the job needs")],
        dataset: Annotated[str, typer.Option(help="a registered dataset")],
        epochs: Annotated[float | None, typer.Option(help="passes over the dataset")] = None,
        steps: Annotated[int | None, typer.Option(help="instead of --epochs, with --step-bytes")] = None,
        step_bytes: Annotated[str | None, typer.Option("--step-bytes", help="bytes per step, e.g. 32MB")] = None,
        ideal_throughput: Annotated[str | None, typer.Option("--ideal-throughput", help="f*, e.g. 114MB/s")] = None,
        model: Annotated[str | None, typer.Option(help="catalog model instead of --ideal-throughput")] = None,
        priority: Annotated[int, typer.Option()] = 0,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Submit a training job; prints its id."""
        body: dict[str, Any] = {"name": name, "gpus": gpus, "dataset": dataset, "priority": priority}
        for key, value in (("epochs", epochs), ("steps", steps), ("model", model)):
            if value is not None:
                body[key] = value
        if step_bytes is not None:
            body["step_bytes"] = _rate_or_number(step_bytes)
        if ideal_throughput is not None:
            body["ideal_throughput"] = _rate_or_number(ideal_throughput)
        job = _call(server, token, "POST", "/v1/jobs", json=body)
        typer.echo(job["id"])

    @app.command()
    def jobs(
        state: Annotated[str | None, typer.Option(help="filter: queued, running, finished, failed, cancelled, active")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """List your jobs (all jobs with the admin token)."""
        params = {"state": state} if state else {}
        rows = _call(server, token, "GET", "/v1/jobs", params=params)
        if as_json:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        from estimator.units import format_rate, format_size

        table = Table("id", "name", "owner", "state", "gpus", "dataset", "progress", "remote IO")
        for j in rows:
            progress = j["consumed_bytes"] / j["total_bytes"] if j["total_bytes"] else 0.0
            io = "-" if j["remote_io"] is None else format_rate(j["remote_io"])
            table.add_row(
                j["id"], j["name"], j["owner"], j["state"], f"{j['allocated_gpus']}/{j['gpus']}", j["dataset"],
                f"{progress:.1%} of {format_size(j['total_bytes'])}", io,
            )
        Console().print(table)

    @app.command()
    def cancel(
        job_id: Annotated[str, typer.Argument(help="job id (from `silod submit` or `silod jobs`)")],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Cancel a job."""
        job = _call(server, token, "DELETE", f"/v1/jobs/{job_id}")
        typer.echo(f"{job['id']} {job['state']}")

    @app.command("dataset-add")
    def dataset_add(
        name: Annotated[str, typer.Argument(help="dataset name")],
        uri: Annotated[str, typer.Option(help="remote source, e.g. s3://bucket/prefix")],
        size: Annotated[str, typer.Option(help="bytes or with a unit, e.g. 143GB")],
        item_count: Annotated[int | None, typer.Option("--item-count")] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Register a dataset with the scheduler."""
        body: dict[str, Any] = {"name": name, "uri": uri, "size": _rate_or_number(size)}
        if item_count is not None:
            body["item_count"] = item_count
        ds = _call(server, token, "POST", "/v1/datasets", json=body)
        typer.echo(f"{ds['name']} {ds['size']:.0f} bytes")
