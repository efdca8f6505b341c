"""`silod serve` (the scheduler service) and the thin API clients `silod submit|jobs|cancel|datasets`.

FastAPI, uvicorn and SQLAlchemy are imported inside the commands, so `silod --help` and the
simulator do not pay for them. Every user mistake is a UserError: `error: ...`, exit code 2.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from estimator.errors import RuntimeFailure, UserError
from contract.log_level import parse_log_level

DEFAULT_SERVER = "http://127.0.0.1:8080"


def default_state_dir() -> Path:
    """Per-user state: $XDG_STATE_HOME/silod, else ~/.local/state/silod (XDG Base Directory spec).

    Never the current directory: running `silod serve` in a checkout must not leave files in it.
    """
    xdg = os.environ.get("XDG_STATE_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "state"
    return base / "silod"


def _prepare_state_dir(state_dir: Path) -> None:
    try:
        # 0700: it holds the database, the token and secret keys (an existing directory keeps
        # the operator's mode; the files in it are 0600 either way).
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--state-dir {str(state_dir)!r} cannot be created ({exc.strerror}); give a writable directory") from None
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise UserError(f"--state-dir {str(state_dir)!r} is not writable; give a writable directory")


def parse_listen(value: str, option: str = "--listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise UserError(f"{option} {value!r} must be HOST:PORT, e.g. 127.0.0.1:8080 or 0.0.0.0:8080")
    return host.strip("[]"), int(port)


def parse_free_listen(value: str, option: str = "--listen") -> tuple[str, int]:
    """HOST:PORT where a server can listen now: a port in use is one line (exit 2) here, not
    uvicorn's log line and exit code 3 after the other processes started."""
    from http_guard.listen import listen_problem

    host, port = parse_listen(value, option)
    problem = listen_problem(host, port)
    if problem:
        raise UserError(f"{option} {value}: {problem}")
    return host, port


#: The smallest --max-body: a plain job submission or dataset registration is a few hundred bytes.
MIN_MAX_BODY = 1024


def _must_be_file(path: Path, what: str) -> None:
    """`path`, when it exists, is a regular file (not a directory, socket ...): one clear error otherwise."""
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise UserError(f"{what} {str(path)!r} is {kind}; it must be a file: remove or rename it, or pass another "
                        f"--state-dir")


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
    from scheduler.service.scheduler_process import StoragePusher

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


def parse_quota(value: str | None) -> Any:
    """`gpus=8,cache=500GB,running=4,queued=100` -> TenantQuota (omitted keys: no limit, but
    `queued` is DEFAULT_QUEUED_JOBS unless given; `KEY=none`: no limit)."""
    from estimator.units import parse_rate, parse_size
    from scheduler.service.types import TenantQuota

    from scheduler.service.types import DEFAULT_QUOTA

    if not value:
        return DEFAULT_QUOTA
    names = {"gpus": "gpus", "cache": "cache_bytes", "running": "running_jobs", "queued": "queued_jobs",
             "fstar": "ideal_per_gpu", "min_work": "min_work", "max_work": "max_work"}
    out: dict[str, Any] = {"queued_jobs": DEFAULT_QUOTA.queued_jobs}
    for item in value.split(","):
        key, sep, val = item.strip().partition("=")
        if not sep or key not in names:
            raise UserError(f"--default-quota item {item!r} must be KEY=VALUE with KEY one of {', '.join(names)}")
        if val.strip() == "none":
            out[names[key]] = None  # no limit (jobs: still the object limit --object-limits jobs=N)
        elif key == "cache":
            out[names[key]] = float(parse_size(val, what="--default-quota cache"))
        elif key == "fstar":  # per GPU
            out[names[key]] = float(parse_rate(val, what="--default-quota fstar"))
        elif key in ("min_work", "max_work"):  # bytes a job declares (epochs x dataset size)
            out[names[key]] = float(parse_size(val, what=f"--default-quota {key}"))
        elif re.fullmatch(r"[0-9]+", val.strip()):  # ASCII digits only: str.isdigit() accepts '²'
            out[names[key]] = int(val)
        else:
            raise UserError(f"--default-quota {key}={val!r} must be a whole number >= 0")
    if (out.get("min_work") or 0.0) > (out.get("max_work") or float("inf")):
        raise UserError("--default-quota min_work is above max_work; give min_work <= max_work")
    return TenantQuota(**out)


def parse_object_limits(value: str | None) -> Any:
    """`datasets=10000,credentials=1000,grants=256` -> ObjectLimits (omitted keys: the default)."""
    from dataclasses import fields

    from scheduler.service.types import ObjectLimits

    if not value:
        return ObjectLimits()
    names = [f.name for f in fields(ObjectLimits)]
    out: dict[str, int] = {}
    for item in value.split(","):
        key, sep, val = item.strip().partition("=")
        if not sep or key not in names:
            raise UserError(f"--object-limits item {item!r} must be KEY=N with KEY one of {', '.join(names)}")
        if not re.fullmatch(r"[0-9]{1,9}", val.strip()) or int(val) < 1:
            raise UserError(f"--object-limits {key}={val!r} must be a whole number from 1 to 999999999")
        out[key] = int(val)
    return ObjectLimits(**out)


def make_token_store(engine: Any, state_dir: Path, tokens_file: Path | None, require_any: bool = True) -> Any:
    """Tokens for `silod serve`: the admin token from the environment, the tokens file imported
    into the database (revocable there), HMAC key from SILOD_TOKEN_KEY or state_dir/token.key."""
    from scheduler.service.api.auth import ADMIN_TOKEN_ENV, METRICS_TOKEN_ENV, TOKEN_KEY_ENV, TokenStore, load_token_key

    if not os.environ.get(TOKEN_KEY_ENV):
        _must_be_file(Path(state_dir) / "token.key", "the token key file")
    store = TokenStore(engine, load_token_key(state_dir), admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
                       metrics_token=os.environ.get(METRICS_TOKEN_ENV) or None)
    if tokens_file is not None:
        store.import_file(tokens_file)
    if require_any and not os.environ.get(ADMIN_TOKEN_ENV) and tokens_file is None and not store.list():
        raise UserError(f"no API tokens: set {ADMIN_TOKEN_ENV} and/or pass --tokens FILE (lines 'user:token')")
    return store


def parse_backend_opts(values: list[str] | None) -> dict[str, str]:
    opts: dict[str, str] = {}
    for item in values or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise UserError(f"--backend-opt {item!r} must be KEY=VALUE")
        opts[key.strip()] = val.strip()
    return opts


def _with_api_url(opts: dict[str, str], backend: str, host: str, port: int, tls: bool) -> dict[str, str]:
    """The local backend's jobs' programs report to this server (SILOD_SERVER) unless
    --backend-opt api_url=URL says otherwise (e.g. a proxy in front of it)."""
    if backend != "local" or "api_url" in opts:
        return opts
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in reach:
        reach = f"[{reach}]"
    return {**opts, "api_url": f"{'https' if tls else 'http'}://{reach}:{port}"}


def _agents(values: list[str] | None, service_accounts: list[str] | None = None,
            audience: str | None = None) -> dict[str, Any]:
    """--node-agent (static tokens) and --agent-service-account (agent pods' own tokens, checked
    with a TokenReview: the API server from SILOD_KUBE_API / SILOD_KUBE_TOKEN_FILE /
    SILOD_KUBE_CA_FILE, else the pod's in-cluster service account)."""
    from scheduler.service.types import ServiceError, parse_node_agents

    try:
        users, bound = parse_node_agents(values)
    except ServiceError as exc:
        raise UserError(str(exc)) from None
    out: dict[str, Any] = {"node_agents": users, "agent_nodes": bound}
    if service_accounts:
        from http_guard.agent_identity import DEFAULT_AUDIENCE, AgentReviewer, KubeAPI, parse_service_account

        try:
            accounts = frozenset(parse_service_account(a) for a in service_accounts)
            api = KubeAPI.from_env(dict(os.environ))
        except ValueError as exc:
            raise UserError(f"--agent-service-account: {exc}") from None
        out["agent_reviewer"] = AgentReviewer(api, accounts, audience or DEFAULT_AUDIENCE)
        out["node_agents"] = users | accounts  # they look datasets up for their pods, as --node-agent users do
    elif audience:
        raise UserError("--agent-audience goes with --agent-service-account")
    return out


def _webhook_server(listen: str | None, cert: Path | None, key: Path | None, client_ca: Path | None,
                    backend: str, admitters: list[str] | None = None,
                    backend_opt: list[str] | None = None):  # type: ignore[no-untyped-def]
    """The admission webhook's HTTPS server (not started yet), or None without --webhook-listen."""
    if listen is None:
        if cert or key or client_ca:
            raise UserError("--webhook-cert/--webhook-key/--webhook-client-ca need --webhook-listen HOST:PORT")
        return None
    if backend != "kubernetes":
        raise UserError("--webhook-listen is for --backend kubernetes (it suspends Kubernetes workloads)")
    if cert is None or key is None:
        raise UserError("--webhook-listen needs --webhook-cert and --webhook-key: the API server calls webhooks over"
                        " HTTPS only (docs/kubernetes.md: the webhook certificate)")
    for flag, f in (("--webhook-cert", cert), ("--webhook-key", key), ("--webhook-client-ca", client_ca)):
        if f is not None and not f.is_file():
            raise UserError(f"{flag} {str(f)!r} does not exist")
    from scheduler.backends.kubernetes import load_api_client
    from scheduler.backends.kubernetes.webhook import NodeCache, WebhookServer

    host, port = parse_listen(listen)
    opts = dict(parse_backend_opts(backend_opt))
    # The cluster's nodes: a workload whose nodeSelector / affinity no node matches is refused.
    nodes = NodeCache(load_api_client(opts.get("server"), opts.get("kubeconfig"), opts.get("context"),
                                      opts.get("token-file")))
    try:
        default = f"system:serviceaccount:{os.environ.get('POD_NAMESPACE') or 'silod-system'}:silod-scheduler"
        return WebhookServer(host, port, cert, key, client_ca, admitters=frozenset(admitters or [default]), nodes=nodes)
    except OSError as exc:
        raise UserError(f"--webhook-listen {listen}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - a bad certificate or key is the operator's to fix
        raise UserError(f"--webhook-cert/--webhook-key: {exc}") from None


def _ca_keeper(webhook: Any, cert: Path | None, ca: Path | None, configuration: str,
               backend_opt: list[str] | None):  # type: ignore[no-untyped-def]
    """What keeps the webhook configuration's caBundle trusting our certificate (cabundle.py), or
    None without a webhook or with --webhook-configuration none."""
    if webhook is None or configuration.lower() == "none" or cert is None:
        if ca is not None and webhook is None:
            raise UserError("--webhook-ca needs --webhook-listen")
        return None
    from scheduler.backends.kubernetes import load_api_client
    from scheduler.backends.kubernetes.cabundle import CaBundleKeeper, webhook_ca

    opts = dict(parse_backend_opts(backend_opt))
    api = load_api_client(opts.get("server"), opts.get("kubeconfig"), opts.get("context"), opts.get("token-file"))
    return CaBundleKeeper(api, webhook_ca(cert, ca), configuration)


def build_api_service(
    *,
    db: str,
    cluster_file: Path | None = None,
    gpus: str | None = None,
    gpus_per_node: str | None = None,
    cache: str | None = None,
    remote_io: str | None = None,
    gpu_speed: str | None = None,
    irregular_share: str | None = None,
    cpus_per_node: str | None = None,
    cpu_allocation: str | None = None,
    allowed_uris: list[str] | None = None,
    default_quota: Any = None,
    object_limits: str | None = None,
    node_agents: list[str] | None = None,
    agent_service_accounts: list[str] | None = None,
    agent_audience: str | None = None,
    backend: str | None = None,
    backend_opts: dict[str, str] | None = None,
    state_dir: Path | str | None = None,
    **_scheduler_only: Any,
):  # type: ignore[no-untyped-def]
    """The API worker's side (scheduler/service/api_process.py): catalogue and views, no backend, no rounds.
    The schema must already be migrated (the serving process does it once, before workers start).
    With the kubernetes backend it holds a second backend object used only to create a REST
    job's Job from its pod_template (no polling, no leader election, no admission)."""
    from contract.uri_policy import UriPolicy
    from scheduler.service.api_process import ApiService
    from scheduler.core.cluster import load_cluster
    from scheduler.service.db.engine import make_engine
    from scheduler.service.scheduler_process import ServiceConfig
    from scheduler.service.types import DEFAULT_QUOTA

    capacity, speed = load_cluster(
        cluster_file, gpus=gpus, gpus_per_node=gpus_per_node, cache=cache, remote_io=remote_io, gpu_speed=gpu_speed,
        irregular_share=irregular_share, cpus_per_node=cpus_per_node, cpu_allocation=cpu_allocation,
    )
    from scheduler.service.sealed import load_secret_box

    config = ServiceConfig(capacity=capacity, gpu_speed=speed, uri_policy=UriPolicy.parse(allowed_uris),
                           default_quota=default_quota or DEFAULT_QUOTA, objects=parse_object_limits(object_limits),
                           **_agents(node_agents, agent_service_accounts, agent_audience),
                           secrets=load_secret_box(Path(state_dir or default_state_dir())))
    workloads = None
    if backend == "kubernetes":
        from scheduler.backends.base import BackendConfig, load_backend

        opts = {k: v for k, v in (backend_opts or {}).items() if k != "leader-election"}
        workloads = load_backend(backend, BackendConfig(capacity=capacity, state_dir=Path(state_dir or default_state_dir()),
                                                        options=opts, allowed_uris=config.uri_policy.allowed))
    return ApiService(make_engine(db), config, workloads=workloads)


def run_scheduler_process(build_kwargs: dict[str, Any], log_level: str = "info", parent_pid: int | None = None) -> None:
    """The scheduling process of `silod serve`: the backend, the data-manager pushes and the
    rounds, apart from the API workers (no shared GIL). It takes the leader lease before
    scheduling; SIGTERM stops it cleanly."""
    import logging
    import signal
    import threading

    # Ctrl-C in the terminal reaches every process of the group: `silod serve` stops this one
    # with SIGTERM (it starts with SIGINT ignored, _SchedulerSupervisor._spawn), so it must not
    # die of the SIGINT half-way through its start (a traceback, and the supervisor "starting it
    # again"). The backend's own workers are stopped by this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    done = threading.Event()
    warming = threading.Event()

    def on_sigterm(*_: Any) -> None:
        done.set()
        if warming.is_set():  # stop a compile at once rather than after its minute (nothing held yet)
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    # `silod serve` killed with -9 cannot stop us: the kernel (PR_SET_PDEATHSIG) and a watcher
    # send us SIGTERM, and we stop, releasing the lease for the next `silod serve` (instead of an
    # orphan renewing it for ever). scheduler/service/lifeline.py
    from scheduler.service.lifeline import die_with_parent

    die_with_parent(parent_pid, signal.SIGTERM, grace_s=30.0)
    # Requests first: when the API workers and a round (or the kernels' compile at start) compete
    # for the CPU, the round waits (it is seconds long anyway; a request is milliseconds).
    try:
        os.nice(SCHEDULER_NICE)
    except OSError:
        pass
    service = build_service(**build_kwargs)
    try:
        warming.set()
        try:
            warm_up(service)
        finally:
            warming.clear()
        if done.is_set():
            return
        elector = getattr(service.backend, "elector", None)
        if elector is None:
            service.start()
        else:
            # Kubernetes with several replicas: schedule only while holding the Lease (the
            # process exits when it loses it, and the supervisor starts it again as a candidate).
            from scheduler.backends.kubernetes.leader import run_when_leading

            run_when_leading(elector, service)
        done.wait()
    finally:
        service.close()


def warm_up(service: Any) -> None:
    """Compile (or load) every built-in policy's kernels before this process contends for the
    lease (scheduler/service/warmup.py), saying so in the log and in the activity record that
    `/readyz`, wait reasons and `silod top` read."""
    import logging
    import threading
    import time

    from scheduler.service.warmup import warm_policies

    log = logging.getLogger("silod.serve")
    runner = service.runner
    runner.activity.set("compiling policy kernels")
    runner.keeper.start()  # writes the activity record; takes no lease before contend()
    log.info("scheduler: compiling the policies' kernels before taking the lease "
             "(the first start after an install or upgrade takes 10-60 s; later starts load them from the cache)")
    start = time.monotonic()

    def report() -> None:  # progress on a busy node, where a cold compile takes a minute
        while not finished.wait(10.0):
            log.info("scheduler: still compiling policy kernels, %.0f s", time.monotonic() - start)

    finished = threading.Event()
    threading.Thread(target=report, name="silod-warmup-progress", daemon=True).start()
    try:
        seconds = warm_policies(service.config.capacity, progress=log.warning)
    finally:
        finished.set()
    log.info("scheduler: policy kernels ready in %.1f s (%s)", time.monotonic() - start,
             ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    runner.activity.set("waiting for the scheduling lease")


def build_service(
    *,
    db: str | None,
    backend: str,
    policy: str | None,
    round_s: float,
    cluster_file: Path | None = None,
    gpus: str | None = None,
    gpus_per_node: str | None = None,
    cache: str | None = None,
    remote_io: str | None = None,
    gpu_speed: str | None = None,
    irregular_share: str | None = None,
    cpus_per_node: str | None = None,
    cpu_allocation: str | None = None,
    datamanager: str | None = None,
    state_dir: Path | None = None,
    backend_opts: dict[str, str] | None = None,
    allowed_uris: list[str] | None = None,
    default_quota: Any = None,
    object_limits: str | None = None,
    node_agents: list[str] | None = None,
    agent_service_accounts: list[str] | None = None,
    agent_audience: str | None = None,
):  # type: ignore[no-untyped-def]
    """Everything `silod serve` assembles, minus HTTP (the benchmarks and tests reuse it).

    `state_dir` defaults to default_state_dir(); `db` may be None for a SQLite file in it.
    """
    from policies.registry import resolve_policy_name
    from scheduler.backends.base import BackendConfig, load_backend
    from scheduler.core.cluster import load_cluster
    from scheduler.service.db import open_database
    from contract.uri_policy import UriPolicy
    from scheduler.service.scheduler_process import SchedulerService, ServiceConfig
    from scheduler.service.types import DEFAULT_QUOTA

    if policy is not None:
        policy = resolve_policy_name(policy)
    capacity, speed = load_cluster(
        cluster_file, gpus=gpus, gpus_per_node=gpus_per_node, cache=cache, remote_io=remote_io, gpu_speed=gpu_speed,
        irregular_share=irregular_share, cpus_per_node=cpus_per_node, cpu_allocation=cpu_allocation,
    )
    pusher = make_pusher(datamanager) if datamanager else None
    state_dir = default_state_dir() if state_dir is None else state_dir
    _prepare_state_dir(state_dir)
    if db is None:
        db = f"sqlite:///{state_dir / 'silod.db'}"
    cluster_backend = load_backend(
        backend, BackendConfig(capacity=capacity, state_dir=state_dir, datamanager_url=datamanager, options=backend_opts or {},
                               allowed_uris=UriPolicy.parse(allowed_uris).allowed)
    )
    engine = open_database(db)
    if pusher is not None and backend == "local":
        from scheduler.backends.local import LocalBackend, WorkConservingPusher

        if isinstance(cluster_backend, LocalBackend):
            # Link capacity the policy's caps leave unused goes to running jobs that want more
            # (e.g. while their cache fills), from the workers' measured demand.
            pusher = WorkConservingPusher(pusher, cluster_backend, capacity.remote_io)
    from scheduler.service.sealed import load_secret_box, seal_plaintext

    secrets = load_secret_box(state_dir)
    seal_plaintext(engine, secrets)  # rows stored before secrets were sealed (idempotent)
    config = ServiceConfig(
        capacity=capacity, policy=policy, round_seconds=round_s, gpu_speed=speed,
        uri_policy=UriPolicy.parse(allowed_uris), default_quota=default_quota or DEFAULT_QUOTA,
        objects=parse_object_limits(object_limits),
        **_agents(node_agents, agent_service_accounts, agent_audience), secrets=secrets,
        tenant_namespace_prefix=(backend_opts or {}).get("namespace-prefix", ""),
    )
    service = SchedulerService(engine, cluster_backend, config, pusher=pusher, datamanager_url=datamanager)
    if backend in ("local", "kubernetes"):  # the backends whose jobs' code can report its steps
        service.job_tokens = job_token_minter(engine, state_dir)
    attach = getattr(cluster_backend, "attach", None)  # backends that also feed the queue (kubectl workloads)
    if callable(attach):
        attach(service)
    return service


#: How long a job's report token stays valid (a new one is minted at every start; revoked when
#: the job ends).
REPORT_TOKEN_TTL_S = 7 * 86400.0


def job_token_minter(engine: Any, state_dir: Path) -> Any:
    """A function minting, per start of a job, its report token (TokenStore.mint_job_token): a
    token that may post that one job's step reports and nothing else. The local backend gives it
    to the job's program as SILOD_TOKEN; the Kubernetes backend to the job's pods through a
    per-job Secret. It expires after REPORT_TOKEN_TTL_S and is revoked when the job ends."""
    from scheduler.service.api.auth import TokenStore, load_token_key

    store = TokenStore(engine, load_token_key(state_dir))
    return lambda spec: store.mint_job_token(spec.owner, spec.job_id, REPORT_TOKEN_TTL_S)


def _open_service_state(db: str | None, state_dir: Path) -> Any:
    """The database of an existing `silod serve` for `silod secrets`: the key file (unless the
    keys come from SILOD_SECRET_KEYS) and the database must exist already. Nothing is created
    when they do not (a new key and an empty database would report success and re-seal nothing)."""
    from sqlalchemy import inspect, make_url
    from sqlalchemy.exc import SQLAlchemyError

    from scheduler.service.db import open_database
    from scheduler.service.db.engine import make_engine, normalize_url
    from scheduler.service.sealed import SECRET_KEYS_ENV, key_file

    fix = "pass the --db and --state-dir of the running `silod serve`"
    if not os.environ.get(SECRET_KEYS_ENV, "").strip():
        keys = key_file(state_dir)
        if not keys.is_file():
            problem = "is not a file" if keys.exists() else "does not exist"
            raise UserError(f"secret key file {str(keys)!r} {problem} (--state-dir {str(state_dir)!r}); {fix}")
    url = normalize_url(db or f"sqlite:///{state_dir / 'silod.db'}")
    shown = url
    if url.startswith("sqlite"):
        path = make_url(url).database or ""
        if not path or path == ":memory:" or not Path(path).expanduser().is_file():
            where = f"database {path!r}" if path else f"database {url!r}"
            raise UserError(f"{where} does not exist{'' if db else ' (the default in --state-dir)'}; {fix}")
    engine = make_engine(url)
    try:
        shown = engine.url.render_as_string(hide_password=True)
        has_schema = inspect(engine).has_table("credentials")
    except SQLAlchemyError as exc:
        engine.dispose()
        raise UserError(f"cannot open database {shown}: {getattr(exc, 'orig', None) or exc}") from None
    engine.dispose()
    if not has_schema:
        raise UserError(f"database {shown} has no silod tables (not a silod serve database); {fix}")
    return open_database(url)


# ---------------------------------------------------------------- HTTP client side


def _check_token(token: str, option: str) -> str:
    """A bearer token goes into an HTTP header: printable ASCII only (the token itself is never echoed)."""
    for i, ch in enumerate(token):
        if not " " <= ch <= "~":
            raise UserError(f"{option} must be printable ASCII (letters, digits, punctuation), as the tokens silod "
                            f"issues are; it has {('a control' if ch.isascii() else 'a non-ASCII')} character at "
                            f"position {i + 1}; pass the token exactly as you were given it")
    return token


def _check_server(server: str, option: str) -> str:
    import httpx

    example = "e.g. http://127.0.0.1:8080"
    try:
        url = httpx.URL(server)
    except httpx.InvalidURL as exc:
        raise UserError(f"{option} {server!r} is not a valid URL ({exc}); {example}") from None
    if url.scheme not in ("http", "https"):
        raise UserError(f"{option} {server!r} is not an http(s) URL; {example}")
    if not url.host:
        raise UserError(f"{option} {server!r} is not a valid URL (no host); {example}")
    return server


def _path_segment(value: str) -> str:
    """`value` as one URL path segment (the SDK's encoding: silod_client.client.segment)."""
    from silod_client.client import segment

    return segment(value)


def _split_command(text: str) -> list[str]:
    """--program "python train.py --epochs 2" as the argument list the local backend runs."""
    import shlex

    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise UserError(f"--program {text!r} is not a command line ({exc}); quote it as a shell would") from None
    if not argv:
        raise UserError("--program is empty; give the command that trains, e.g. --program 'python train.py'")
    return argv


def _client(server: str | None, token: str | None):  # type: ignore[no-untyped-def]
    """The SDK's client (silod_client) for --server/--token or SILOD_SERVER/SILOD_TOKEN: the CLI's
    REST commands and Python programs share one client."""
    from silod_client import Client

    server_option = "--server" if server else ("SILOD_SERVER" if os.environ.get("SILOD_SERVER") else "--server")
    token_option = "--token" if token else "SILOD_TOKEN"
    server = server or os.environ.get("SILOD_SERVER") or DEFAULT_SERVER
    token = token or os.environ.get("SILOD_TOKEN")
    if not token:
        raise UserError("no API token: pass --token or set SILOD_TOKEN")
    _check_token(token, token_option)
    _check_server(server, server_option)
    # Two retries: a command run by hand should say quickly that the server is not there.
    return Client(server, token, timeout=30.0, retries=2)


def _call(server: str | None, token: str | None, call: Any, *, not_found: str | None = None) -> Any:
    """`call(client)` with the SDK's errors as the CLI's: a 4xx is the user's (exit 2; `not_found`
    replaces the server's text for a 404, e.g. "no job with id '7'"), a 5xx or no answer a
    runtime failure (exit 1)."""
    from silod_client.errors import ApiError, SilodError, TransportError

    with _client(server, token) as client:
        try:
            return call(client)
        except TransportError as exc:
            raise RuntimeFailure(f"{exc}; is `silod serve` running there? (set --server or SILOD_SERVER)") from exc
        except ApiError as exc:
            where = f"{exc.method} {exc.path}"
            if exc.status >= 500:
                raise RuntimeFailure(f"{where}: the server failed (HTTP {exc.status}): {exc.detail}") from None
            if exc.status == 404 and not_found is not None:
                raise UserError(f"{where}: HTTP 404: {not_found}") from None
            raise UserError(f"{where}: HTTP {exc.status}: {exc.detail}") from None
        except SilodError as exc:  # an answer that is not silod's (not JSON, not the schema)
            raise RuntimeFailure(f"{exc}") from None
        except ValueError as exc:  # pydantic: the answer does not have the schema's shape
            raise RuntimeFailure(f"the server's answer is not what silod answers ({exc}); is --server a silod"
                                 f" server?") from None


ServerOpt = Annotated[str | None, typer.Option("--server", help="API base URL [env SILOD_SERVER, default http://127.0.0.1:8080]")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="bearer token [env SILOD_TOKEN]")]


def _rate_or_number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


WORKER_CONFIG_ENV = "SILOD_SERVE_WORKER_CONFIG"
SCHEDULER_NICE = 10  # the scheduling process's CPU priority below the API workers


class _SchedulerSupervisor:
    """Keeps the scheduling process alive while the API serves (restarted if it dies)."""

    def __init__(self, ctx: Any, build_kwargs: dict[str, Any], log_level: str):
        import threading

        self.ctx, self.kwargs, self.log_level = ctx, build_kwargs, log_level
        self.proc: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="silod-scheduler-supervisor", daemon=True)

    def _spawn(self) -> None:
        import signal

        self.proc = self.ctx.Process(target=run_scheduler_process, args=(self.kwargs, self.log_level, os.getpid()),
                                     name="silod-scheduler")
        # Born with SIGINT ignored (an ignored signal stays ignored across exec, and Python keeps
        # it so), so a Ctrl-C in the terminal cannot interrupt its start-up with a traceback; we
        # stop it with SIGTERM. (Only the main thread may set a handler; a restart from the
        # watcher thread spawns as it is.)
        import threading

        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.proc.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, old)

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _watch(self) -> None:
        import logging

        while not self._stop.wait(2.0):
            if self.proc is not None and not self.proc.is_alive() and not self._stop.is_set():
                logging.getLogger("silod.serve").error(
                    "the scheduling process exited (code %s); starting it again", self.proc.exitcode)
                self._spawn()

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()  # SIGTERM: it closes the service and releases the lease
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


def _refuse_placeholder_secrets(db: str | None, tokens: Path | None) -> None:
    """deploy/base/secret.yaml's placeholders (SILOD_* variables, --db, the --tokens file) stop the start."""
    from contract.placeholders import refuse_placeholders

    given: dict[str, tuple[str, str | None]] = {"--db": ("database-url", db)}
    if tokens is not None and tokens.is_file():
        from scheduler.service.api.auth import parse_tokens_file

        try:
            entries = parse_tokens_file(tokens)
        except (OSError, UserError, ValueError):
            entries = []  # the token store reports a bad file with its own message
        for user, token in entries:
            given[f"--tokens {tokens} (user {user})"] = ("tokens", token)
    refuse_placeholders(given)


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        listen: Annotated[str, typer.Option(help="HOST:PORT to listen on")] = "127.0.0.1:8080",
        db: Annotated[str | None, typer.Option(help="sqlite:///FILE or postgresql+psycopg://USER@HOST/DB [default: sqlite:///STATE_DIR/silod.db]")] = None,
        backend: Annotated[str, typer.Option(help="where jobs run: local | kubernetes")] = "local",
        gpus: Annotated[str | None, typer.Option(help="GPUs in the cluster")] = None,
        gpus_per_node: Annotated[str | None, typer.Option("--gpus-per-node", help="GPUs per node")] = None,
        cache: Annotated[str | None, typer.Option(help="cluster cache, e.g. 2TB")] = None,
        remote_io: Annotated[str | None, typer.Option("--remote-io", help="remote storage bandwidth, e.g. 1GB/s")] = None,
        gpu_speed: Annotated[str | None, typer.Option("--gpu-speed", help="GPU speed vs a V100 (scales catalog f*)")] = None,
        cluster: Annotated[Path | None, typer.Option("--cluster", help="YAML file with the cluster keys (traces/cluster.example.yaml); a flag given too overrides its key, with a note")] = None,
        irregular_share: Annotated[str | None, typer.Option("--irregular-share", help="pin the irregular partition's fraction of cache and remote IO [default: by demand]")] = None,
        cpus_per_node: Annotated[str | None, typer.Option("--cpus-per-node", help="CPU cores per node for input pipelines [default: CPU not constrained]")] = None,
        cpu_allocation: Annotated[str | None, typer.Option("--cpu-allocation", help="with --cpus-per-node: model (cores by the estimator) | gpu-proportional [default: model]")] = None,
        policy: Annotated[str | None, typer.Option(help="fifo | fifo-strict | sjf | gavel | greedy | plug-in [default: last used, else fifo]")] = None,
        tokens: Annotated[Path | None, typer.Option("--tokens", help="user tokens, one 'user:token' per line")] = None,
        datamanager: Annotated[str | None, typer.Option("--datamanager", help="data manager URL (cache and IO enforcement)")] = None,
        round_: Annotated[str, typer.Option("--round", help="round length, e.g. 360, 5s, 6m")] = "360",
        workers: Annotated[int, typer.Option("--workers", help="API worker processes (the scheduling loop runs in one more)")] = 1,
        state_dir: Annotated[Path | None, typer.Option("--state-dir", help="state of the backend (and the default SQLite db) [default: $XDG_STATE_HOME/silod or ~/.local/state/silod]")] = None,
        backend_opt: Annotated[list[str] | None, typer.Option("--backend-opt", help="backend option KEY=VALUE (repeatable)")] = None,
        allow_uri: Annotated[list[str] | None, typer.Option("--allow-uri", help="allowed dataset URI scheme or prefix (repeatable) [default: s3, https]")] = None,
        node_agent: Annotated[list[str] | None, typer.Option("--node-agent", help="user whose tokens belong to node agents: may look up any tenant's dataset; USER=NODE also binds the user to NODE, whose consumption reports it then may send (repeatable)")] = None,
        agent_service_account: Annotated[list[str] | None, typer.Option("--agent-service-account", help="NAMESPACE:NAME of the node agents' service account: an agent pod's projected token, bound to its pod, identifies the agent of the node that pod runs on (checked with a TokenReview; repeatable)")] = None,
        agent_audience: Annotated[str | None, typer.Option("--agent-audience", help="audience the agents' projected tokens are minted for [default: silod]")] = None,
        default_quota: Annotated[str | None, typer.Option("--default-quota", help="per-tenant limits, e.g. gpus=8,cache=500GB,running=4,queued=100,fstar=1GB/s (KEY=none: no limit; queued defaults to 1000, fstar, the most f* per GPU a job may declare, to 1GB/s x --gpu-speed; min_work=SIZE,max_work=SIZE bound the work a job may declare, default none)")] = None,
        object_limits: Annotated[str | None, typer.Option("--object-limits", help="objects one tenant may hold, e.g. datasets=10000,credentials=1000,grants=256,jobs=10000 (grants: tenants one dataset is shared with; jobs: active jobs) [default: those]")] = None,
        max_body: Annotated[str, typer.Option("--max-body", help="largest request body accepted (413 beyond)")] = "1MiB",
        tls_cert: Annotated[Path | None, typer.Option("--tls-cert", help="serve HTTPS with this certificate (PEM)")] = None,
        tls_key: Annotated[Path | None, typer.Option("--tls-key", help="private key of --tls-cert (PEM)")] = None,
        webhook_listen: Annotated[str | None, typer.Option("--webhook-listen", help="HOST:PORT of the mutating admission webhook (HTTPS; --backend kubernetes): suspends labelled workloads at creation")] = None,
        webhook_cert: Annotated[Path | None, typer.Option("--webhook-cert", help="the webhook's serving certificate (PEM; the caBundle of the MutatingWebhookConfiguration trusts it)")] = None,
        webhook_key: Annotated[Path | None, typer.Option("--webhook-key", help="private key of --webhook-cert (PEM)")] = None,
        webhook_client_ca: Annotated[Path | None, typer.Option("--webhook-client-ca", help="accept only callers with a client certificate from this CA (the API server's webhook client certificate)")] = None,
        webhook_ca: Annotated[Path | None, typer.Option("--webhook-ca", help="CA of --webhook-cert, written into the webhook configuration's caBundle [default: ca.crt beside --webhook-cert, else the certificate itself when self-signed]")] = None,
        webhook_configuration: Annotated[str, typer.Option("--webhook-configuration", help="MutatingWebhookConfiguration whose caBundle silod keeps trusting --webhook-ca (at start, then every minute); 'none': cert-manager or you manage it")] = "silod-suspend",
        webhook_admitter: Annotated[list[str] | None, typer.Option("--webhook-admitter", help="user (as the API server authenticates it) allowed to unsuspend queued workloads: silod's service account (repeatable) [default: system:serviceaccount:$POD_NAMESPACE:silod-scheduler, namespace silod-system when unset]")] = None,
        log_level: Annotated[str, typer.Option("--log-level")] = "info",
    ) -> None:
        """Run the scheduler service: REST API under /v1, /docs, /healthz, /metrics."""
        import logging

        from estimator.units import parse_size

        log_level = parse_log_level(log_level)
        _refuse_placeholder_secrets(db, tokens)
        host, port = parse_free_listen(listen)
        round_s = parse_duration(round_)
        body_cap = int(parse_size(max_body, what="--max-body"))
        if body_cap < MIN_MAX_BODY:
            raise UserError(f"--max-body {max_body!r} is below 1KiB: every job submission would be refused (413); "
                            "the default is 1MiB")
        if (tls_cert is None) != (tls_key is None):
            raise UserError("--tls-cert and --tls-key go together")
        for f in (tls_cert, tls_key):
            if f is not None and not f.is_file():
                raise UserError(f"TLS file {f} does not exist")
        if workers < 1 or workers > 64:
            raise UserError(f"--workers {workers} must be between 1 and 64")
        webhook = _webhook_server(webhook_listen, webhook_cert, webhook_key, webhook_client_ca, backend,
                                  webhook_admitter, backend_opt)
        ca_keeper = _ca_keeper(webhook, webhook_cert, webhook_ca, webhook_configuration, backend_opt)
        # Resolved once here, so the API workers and the scheduling process use the same paths.
        state_dir = default_state_dir() if state_dir is None else state_dir
        _prepare_state_dir(state_dir)
        if db is None:
            db = f"sqlite:///{state_dir / 'silod.db'}"
        build_kwargs: dict[str, Any] = dict(
            db=db, backend=backend, policy=policy, round_s=round_s, cluster_file=cluster, gpus=gpus,
            gpus_per_node=gpus_per_node, cache=cache, remote_io=remote_io, gpu_speed=gpu_speed,
            irregular_share=irregular_share, cpus_per_node=cpus_per_node, cpu_allocation=cpu_allocation, datamanager=datamanager, state_dir=state_dir, backend_opts=_with_api_url(parse_backend_opts(backend_opt), backend, host, port, tls_cert is not None),
            allowed_uris=allow_uri, default_quota=parse_quota(default_quota), node_agents=node_agent,
            object_limits=object_limits,
            agent_service_accounts=agent_service_account, agent_audience=agent_audience,
        )
        # Check everything once, here, so that a mistake is one clear error before any process
        # starts: the schedule side (backend, cluster, policy) and the database (migrated here).
        # (The backend itself is only built in the scheduling process: building it here too would
        # make a second object adopt the local backend's running workers.)
        import importlib

        from scheduler.backends.base import BACKEND_NAMES
        from scheduler.service.db import open_database

        if backend not in BACKEND_NAMES and backend != "null":
            raise UserError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKEND_NAMES)}")
        try:
            importlib.import_module(f"scheduler.backends.{backend}")
        except ImportError as exc:
            raise UserError(f"backend {backend!r} cannot be loaded: {exc}") from exc
        if datamanager:
            make_pusher(datamanager)
        probe = build_api_service(**build_kwargs)  # cluster flags, URIs, quotas
        try:
            if probe.workloads is not None:
                probe.workloads.describe()  # an unreachable Kubernetes API is one clear error here
        finally:
            probe.close()
        engine = open_database(db)  # migrated once, before any worker starts
        engine_url = engine.url.render_as_string(hide_password=True)
        try:
            from policies.registry import resolve_policy_name

            if policy is not None:
                policy = resolve_policy_name(policy)
            make_token_store(engine, state_dir, tokens)
            from sqlalchemy.orm import sessionmaker

            from scheduler.service import control

            if policy is not None:  # the scheduling process reads it at start, the workers at once
                control.write_setting(sessionmaker(engine), "policy", policy)
            policy_name = control.read_setting(sessionmaker(engine), "policy") or "fifo"
        finally:
            engine.dispose()
        import json
        import multiprocessing

        import uvicorn

        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from http_guard.auth_limit import FailedAuthLimiter

        # Failed tokens are counted per client network in one table all API workers map (a
        # table per worker allowed --workers times the guessing rate); new at every start.
        auth_failures = FailedAuthLimiter.create_table(state_dir / "api-auth-failures")
        os.environ[WORKER_CONFIG_ENV] = json.dumps({
            "build": {k: (str(v) if isinstance(v, Path) else v) for k, v in build_kwargs.items()
                      if k not in ("default_quota",)},
            "default_quota": default_quota, "state_dir": str(state_dir), "max_body": body_cap,
            "serve_pid": os.getpid(),  # the workers die with it (lifeline.py)
            "auth_failures": str(auth_failures),
        })
        from scheduler.core.cluster import cluster_overrides

        for note in cluster_overrides(cluster, gpus=gpus, gpus_per_node=gpus_per_node, cache=cache, remote_io=remote_io,
                                      gpu_speed=gpu_speed, irregular_share=irregular_share, cpus_per_node=cpus_per_node,
                                      cpu_allocation=cpu_allocation):
            typer.echo(f"note: {note}", err=True)
        scheme = "https" if tls_cert else "http"
        # Short lines (a terminal may be 80 columns): where to reach it, then what it runs with.
        typer.echo(f"silod serve: {scheme}://{host}:{port} (API docs at /docs)", err=True)
        typer.echo(f"  db {engine_url}", err=True)
        typer.echo(f"  backend {backend}, policy {policy_name}, round {round_s:g}s", err=True)
        typer.echo(f"  {workers} API worker(s) + 1 scheduling process", err=True)
        scheduler = _SchedulerSupervisor(multiprocessing.get_context("spawn"), build_kwargs, log_level)
        scheduler.start()
        if webhook is not None:
            webhook.start()
            typer.echo(f"  admission webhook {webhook.url}", err=True)
        if ca_keeper is not None:
            try:
                ca_keeper.start()
            except UserError:
                if webhook is not None:
                    webhook.stop()
                scheduler.stop()
                raise
            typer.echo(f"  caBundle of MutatingWebhookConfiguration {ca_keeper.name} kept", err=True)
        try:
            from http_guard.timeouts import HeaderTimeoutH11Protocol
            from scheduler.service.api_workers import ApiWorkerPool, WorkerSpec

            # h11 with a header read timeout (slow-header clients are cut off; http_guard/timeouts.py)
            spec = WorkerSpec(app="scheduler.service.api.worker:create_worker_app", host=host, port=port,
                              log_level=log_level.lower(), http=HeaderTimeoutH11Protocol,
                              ssl_certfile=str(tls_cert) if tls_cert else None,
                              ssl_keyfile=str(tls_key) if tls_key else None)
            if workers == 1:
                uvicorn.run(spec.app, factory=True, host=host, port=port, log_level=spec.log_level, access_log=False,
                            http=spec.http, ssl_certfile=spec.ssl_certfile, ssl_keyfile=spec.ssl_keyfile)
            else:  # one listening socket per worker, so that connections spread over them (api_workers.py)
                pool = ApiWorkerPool(spec, workers)
                pool.run()
                if pool.failed:
                    raise typer.Exit(3)
        finally:
            if ca_keeper is not None:
                ca_keeper.stop()
            if webhook is not None:
                webhook.stop()
            scheduler.stop()

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
        cpu_rate: Annotated[str | None, typer.Option("--cpu-rate", help="source bytes/s one CPU core preprocesses, e.g. 35MB/s [default: the catalog model's, else not CPU-bound]")] = None,
        program: Annotated[str | None, typer.Option("--program", help="local backend: the command that trains, run with the dataset mounted at $SILOD_DATA (e.g. 'python train.py'); default: the built-in stand-in")] = None,
        loader_workers: Annotated[int | None, typer.Option("--loader-workers", help="the job's data loader worker processes (a DataLoader's num_workers): its predicted speed then counts the time its mount takes per miss")] = None,
        loader_item_bytes: Annotated[str | None, typer.Option("--loader-item-bytes", help="with --loader-workers: one item's size, e.g. 110KB [default: the mean missed item the mount measures]")] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Submit a training job; prints its id."""
        from estimator.units import parse_gpus, parse_rate, parse_size

        parse_gpus(gpus, "--gpus")  # bad values fail here, before any network call
        if epochs is not None and not (math.isfinite(epochs) and epochs > 0):
            raise UserError(f"--epochs {epochs:g} must be a finite number > 0, e.g. --epochs 2 or --epochs 0.5")
        if step_bytes is not None:
            parse_size(step_bytes, "--step-bytes")
        if ideal_throughput is not None:
            parse_rate(ideal_throughput, "--ideal-throughput")
        body: dict[str, Any] = {"name": name, "gpus": gpus, "dataset": dataset, "priority": priority}
        if loader_item_bytes is not None and loader_workers is None:
            raise UserError("--loader-item-bytes describes the job's loader: give --loader-workers N with it")
        if loader_workers is not None:
            from scheduler.service.types import JobLoader

            item = None if loader_item_bytes is None else parse_size(loader_item_bytes, "--loader-item-bytes")
            try:
                JobLoader(loader_workers, item)
            except UserError as exc:
                flag = "--loader-workers" if "workers" in str(exc) else "--loader-item-bytes"
                raise UserError(f"{flag}: {exc}") from None
            body["loader"] = {"workers": loader_workers, **({} if item is None else {"item_bytes": item})}
        if program is not None:
            body["program"] = {"command": _split_command(program)}
        for key, value in (("epochs", epochs), ("steps", steps), ("model", model)):
            if value is not None:
                body[key] = value
        if step_bytes is not None:
            body["step_bytes"] = _rate_or_number(step_bytes)
        if ideal_throughput is not None:
            body["ideal_throughput"] = _rate_or_number(ideal_throughput)
        if cpu_rate is not None:
            parse_rate(cpu_rate, "--cpu-rate")
            body["cpu_rate"] = _rate_or_number(cpu_rate)
        job = _call(server, token, lambda c: c.jobs.submit(**body))
        typer.echo(job.id)

    @app.command()
    def jobs(
        state: Annotated[str | None, typer.Option(help="filter: queued, running, finished, failed, cancelled, active")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
        wide: Annotated[bool, typer.Option("--wide", help="all columns (owner, dataset); wider than 80")] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """List your jobs (all jobs with the admin token)."""
        rows = [j.model_dump(mode="json") for j in _call(server, token, lambda c: list(c.jobs.iter(state=state or None)))]
        if as_json:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from scheduler.console import table_console
        from rich.table import Table

        from estimator.units import format_rate, format_size

        # The default columns fit 80 columns; owner, dataset and cores only with --wide.
        columns = ["id", "name", *(["owner"] if wide else []), "state", "gpus", *(["dataset", "cores"] if wide else []),
                   "progress", "remote IO", "f* (measured)", "bound"]
        table = Table(*columns)
        table.columns[columns.index("f* (measured)")].no_wrap = True

        def short_rate(v: float) -> str:  # a rate says /s, also in a narrow column ("1MB/s (477KB/s)")
            return format_rate(v).replace(" ", "")

        for j in rows:
            progress = j["consumed_bytes"] / j["total_bytes"] if j["total_bytes"] else 0.0
            io = "-" if j["remote_io"] is None else format_rate(j["remote_io"])
            # Declared f*, and what planning uses now once the data plane measured it.
            m = j.get("measured_parameters")
            fstar = short_rate(j["ideal_throughput"])
            if m is not None and abs(m["ideal_throughput"] - j["ideal_throughput"]) > 0.005 * j["ideal_throughput"]:
                fstar += f" ({short_rate(m['ideal_throughput'])})"
            bound = (j.get("bottleneck") or {}).get("bound") or "-"
            cells = {"id": j["id"], "name": j["name"], "owner": j["owner"], "state": j["state"],
                     "gpus": f"{j['allocated_gpus']}/{j['gpus']}", "dataset": j["dataset"],
                     "progress": f"{progress:.0%} of {format_size(j['total_bytes'])}", "remote IO": io,
                     "cores": "-" if j.get("allocated_cpus") is None else f"{j['allocated_cpus']:.1f}",
                     "f* (measured)": fstar, "bound": bound.replace("remote_io", "io")}
            table.add_row(*(cells[c] for c in columns))
        # --wide is wider than 80 columns: it is not squeezed into a narrow terminal (lines wrap).
        console = table_console(min_width=150 if wide else None)
        console.print(table)
        # Why a queued job cannot start (the backend's reason, e.g. no node can take its pods).
        for j in rows:
            if j["state"] == "queued" and str(j.get("message") or "").startswith("unschedulable"):
                console.print(f"job {j['id']}: {j['message']}", highlight=False, soft_wrap=True)

    @app.command()
    def top(
        once: Annotated[bool, typer.Option("--once", help="print the view once and exit (scripts, tests)")] = False,
        interval: Annotated[float, typer.Option(help="seconds between refreshes")] = 2.0,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """The cluster at a glance, refreshing: running jobs (allocation, hit ratio, throughput),
        the queue (position, why each job waits), datasets, GPU use. Your jobs only, unless admin."""
        from scheduler.service.top import run_top

        if not 0.2 <= interval <= 3600:
            raise UserError(f"--interval {interval:g} must be between 0.2 and 3600 seconds")
        try:  # the first fetch happens before anything is drawn: a bad token or server is one error line
            run_top(lambda: _call(server, token, lambda c: c.overview().model_dump(mode="json")), once, interval)
        except KeyboardInterrupt:
            pass  # Ctrl-C is how one leaves top

    @app.command()
    def cancel(
        job_id: Annotated[str, typer.Argument(help="job id (from `silod submit` or `silod jobs`)")],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Cancel a job."""
        if not job_id.strip():
            raise UserError("JOB_ID is empty; give the id of a job (the first column of `silod jobs`)")
        job = _call(server, token, lambda c: c.jobs.cancel(job_id),
                    not_found=f"no job with id {job_id!r}; `silod jobs` lists your jobs")
        typer.echo(f"{job.id} {job.state}")

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
        from estimator.units import parse_size

        parse_size(size, "--size")  # bad values fail here, before any network call
        ds = _call(server, token, lambda c: c.datasets.register(name, uri, _rate_or_number(size), item_count=item_count))
        typer.echo(f"{ds.name} {ds.size:.0f} bytes")

    secrets_app = typer.Typer(help="Tenants' secrets at rest: rotate the server key that seals them.",
                              no_args_is_help=True)
    app.add_typer(secrets_app, name="secrets")

    @secrets_app.command("rotate")
    def secrets_rotate(
        db: Annotated[str | None, typer.Option("--db", help="database URL [default: sqlite:///STATE_DIR/silod.db]")] = None,
        state_dir: Annotated[Path | None, typer.Option("--state-dir", help="where secret.keys is [default: as silod serve]")] = None,
        retire: Annotated[bool, typer.Option("--retire", help="re-seal under the current key, then drop the older keys (after every process was restarted)")] = False,
    ) -> None:
        """A new current key first in STATE_DIR/secret.keys and every stored secret re-sealed with it."""
        from scheduler.service.sealed import load_secret_box, reseal_all, rotate_key_file

        state_dir = default_state_dir() if state_dir is None else state_dir
        engine = _open_service_state(db, state_dir)
        try:
            if retire:
                n = reseal_all(engine, load_secret_box(state_dir))  # first: nothing may stay under a dropped key
                rotate_key_file(state_dir, retire=True)
                typer.echo(f"{n} secrets sealed under the current key; older keys dropped")
            else:
                n = reseal_all(engine, rotate_key_file(state_dir, retire=False))
                typer.echo(f"new key in place; {n} secrets re-sealed (restart silod serve, then `silod secrets rotate --retire`)")
        finally:
            engine.dispose()

    @secrets_app.command("reseal")
    def secrets_reseal(
        db: Annotated[str | None, typer.Option("--db", help="database URL [default: sqlite:///STATE_DIR/silod.db]")] = None,
        state_dir: Annotated[Path | None, typer.Option("--state-dir", help="where secret.keys is [default: as silod serve]")] = None,
    ) -> None:
        """Re-seal every stored secret under the current key (the first of SILOD_SECRET_KEYS or secret.keys)."""
        from scheduler.service.sealed import load_secret_box, reseal_all

        state_dir = default_state_dir() if state_dir is None else state_dir
        engine = _open_service_state(db, state_dir)
        try:
            typer.echo(f"{reseal_all(engine, load_secret_box(state_dir))} secrets re-sealed")
        finally:
            engine.dispose()
