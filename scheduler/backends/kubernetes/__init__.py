"""Kubernetes backend: silod admits Job/JobSet/PyTorchJob workloads by suspension (docs/kubernetes.md).

`create_backend(config)` is what `scheduler.backends.base.load_backend("kubernetes", ...)` calls.
Options (`silod serve --backend kubernetes --backend-opt KEY=VALUE`):

- `server=URL`: talk to this API server URL (e.g. `kubectl proxy`'s http://127.0.0.1:8001),
  without credentials or with the bearer token in `token-file=FILE`; otherwise in-cluster
  service-account credentials, else the kubeconfig (`kubeconfig=FILE`, `context=NAME`);
- `namespace-prefix=P`: user U's jobs live in namespace P+U (default: no prefix);
- `queue=NAME`: the queue label of Jobs created for REST submissions (default "default");
- `unschedulable-timeout=1h`: a job no node can take (silod's fit check, or kube-scheduler's
  Unschedulable on its admitted pods) fails after this long;
- `unschedulable-grace=2m`: how long kube-scheduler may keep an admitted job's pods Unschedulable
  before the job is suspended and goes back to the queue;
- `extended-resource-toleration=true`: the API server runs the ExtendedResourceToleration
  admission plugin (pods requesting nvidia.com/gpu tolerate nvidia.com/gpu taints): placement
  assumes the toleration too;
- `api-url=URL`: where the pods' step reporters reach this API (deploy/base:
  http://silod-scheduler.silod-system.svc). With it, silod writes each admitted job's report
  token into a per-job Secret that the pods read as SILOD_TOKEN (docs/kubernetes.md, "Step
  reports from pods"); without it pods get no token;
- `leader-election=true`, `lease-namespace=NS`, `lease-name=NAME`, `identity=ID`, `lease-seconds=15`: only the holder
  of the coordination.k8s.io Lease runs the scheduling loop (several replicas; see leader.py).
"""

from __future__ import annotations

import os
from typing import Any

from estimator.errors import UserError
from scheduler.backends.base import BackendConfig
from scheduler.backends.kubernetes.backend import KubernetesBackend
from scheduler.backends.kubernetes.leader import LeaderElector
from scheduler.backends.kubernetes.workloads import PodTemplate, WorkloadError

__all__ = ["KubernetesBackend", "LeaderElector", "PodTemplate", "WorkloadError", "create_backend", "load_api_client"]


def load_api_client(server: str | None = None, kubeconfig: str | None = None, context: str | None = None,
                    token_file: str | None = None) -> Any:
    """An ApiClient: `server` (with the bearer token of `token_file`, if any), else in-cluster,
    else the kubeconfig."""
    from kubernetes import client, config

    if server:
        cfg = client.Configuration()
        cfg.host = server.rstrip("/")
        if token_file:
            try:
                token = open(token_file).read().strip()
            except OSError as exc:
                raise UserError(f"--backend-opt token-file={token_file}: {exc.strerror}") from None
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)
    if token_file:
        raise UserError("--backend-opt token-file needs --backend-opt server=URL")
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, context=context)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config(context=context)
    except Exception as exc:  # noqa: BLE001 - every config failure is the same user-facing problem
        raise UserError(
            f"cannot configure the Kubernetes client ({exc}); run in a pod with a service account, pass"
            f" --backend-opt kubeconfig=FILE, or --backend-opt server=URL (e.g. kubectl proxy)"
        ) from None
    return client.ApiClient()


def create_backend(config: BackendConfig) -> KubernetesBackend:
    opts = dict(config.options)
    known = {"server", "token-file", "kubeconfig", "context", "namespace-prefix", "queue", "leader-election", "lease-namespace",
             "lease-name", "identity", "lease-seconds", "unschedulable-timeout", "unschedulable-grace",
             "extended-resource-toleration", "api-url"}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise UserError(f"unknown --backend-opt {', '.join(unknown)} for the kubernetes backend; known: {', '.join(sorted(known))}")
    timeout = _duration(opts, "unschedulable-timeout", 3600.0,
                        "how long a job no node can take waits before it fails")
    grace = _duration(opts, "unschedulable-grace", 120.0,
                      "how long kube-scheduler may keep an admitted job's pods Unschedulable before the job goes back"
                      " to the queue")
    ert = opts.get("extended-resource-toleration", "false").lower()
    if ert not in ("true", "false"):
        raise UserError(f"--backend-opt extended-resource-toleration={opts['extended-resource-toleration']!r}: true"
                        f" when the API server runs the ExtendedResourceToleration admission plugin, else false")
    api_url = _api_url(opts.get("api-url"))
    # Every option is checked before the cluster is reached: a typo is named even where no cluster is.
    api = load_api_client(opts.get("server"), opts.get("kubeconfig"), opts.get("context"), opts.get("token-file"))
    backend = KubernetesBackend(api, capacity=config.capacity, namespace_prefix=opts.get("namespace-prefix", ""),
                                default_queue=opts.get("queue") or "default", unschedulable_timeout_s=timeout,
                                pending_grace_s=grace, extended_resource_toleration=ert == "true",
                                api_url=api_url)
    if config.datamanager_url:
        from datamanager.client import DataManagerClient

        backend.storage = DataManagerClient(config.datamanager_url)
    if opts.get("leader-election", "false").lower() in ("1", "true", "yes"):
        backend.elector = LeaderElector(
            api, namespace=opts.get("lease-namespace") or os.environ.get("POD_NAMESPACE") or "silod-system",
            name=opts.get("lease-name") or "silod-scheduler",
            identity=opts.get("identity") or os.environ.get("POD_NAME") or os.uname().nodename,
            **_lease_timing(opts.get("lease-seconds")),
        )
    return backend


def _api_url(value: str | None) -> str | None:
    """`api-url=URL`: an http(s) URL with a host and nothing after the port (the reporter appends
    /v1/jobs/{id}/report)."""
    if value is None:
        return None
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value.strip())
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/") \
            and not parts.query and not parts.fragment and not parts.username and (parts.port or 1) > 0
    except ValueError:
        ok = False
    if not ok:
        raise UserError(f"--backend-opt api-url={value!r}: give the URL pods reach silod's API at, e.g."
                        f" http://silod-scheduler.silod-system.svc (http or https, a host, no path)")
    return value.strip().rstrip("/")


def _duration(opts: dict[str, str], key: str, default: float, what: str) -> float:
    """`KEY=30m`-style option (s, m, h, d; bare numbers are seconds), between 1 s and 30 days."""
    if not opts.get(key):
        return default
    text = opts[key].strip().lower()
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(text[-1:], None)
    try:
        value = float(text[:-1]) * unit if unit else float(text)
    except ValueError:
        value = -1.0
    if not 1 <= value <= 30 * 86400:
        raise UserError(f"--backend-opt {key}={opts[key]!r}: give a duration between 1s and 30d (e.g. 30m), {what}")
    return value


def _lease_timing(value: str | None) -> dict[str, float]:
    """`lease-seconds=N`: the Lease duration; renew deadline 2/3 of it, retries every 2/15 (the
    client-go defaults are 15 s, 10 s, 2 s)."""
    if value is None:
        return {}
    try:
        lease = float(value)
    except ValueError:
        lease = -1.0
    if not 1.0 <= lease <= 3600.0:
        raise UserError(f"--backend-opt lease-seconds={value!r} must be a number of seconds between 1 and 3600")
    return {"lease_s": lease, "renew_deadline_s": lease * 2 / 3, "retry_s": lease * 2 / 15}
