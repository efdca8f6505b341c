"""Kubernetes backend: silod as a secondary scheduler for pods with `schedulerName: silod`.

See docs/kubernetes.md for the pod label/annotation contract and the manifests in deploy/.
`create_backend(config)` is what `scheduler.backends.base.load_backend("kubernetes", ...)` calls;
`python -m scheduler.backends.kubernetes` runs the pod-driven scheduling loop.
"""

from __future__ import annotations

from estimator.errors import UserError
from scheduler.backends.base import BackendConfig
from scheduler.backends.kubernetes.backend import (
    JobPlacement, KubernetesBackend, KubernetesScheduler, PodAllocation, RoundReport, Watcher,
)
from scheduler.backends.kubernetes.contract import AnnotationError

__all__ = [
    "AnnotationError", "JobPlacement", "KubernetesBackend", "KubernetesScheduler", "PodAllocation",
    "RoundReport", "Watcher", "create_backend", "load_api",
]


def load_api(kubeconfig: str | None = None, context: str | None = None):
    """A CoreV1Api: in-cluster service-account credentials when running in a pod, otherwise the
    kubeconfig (`kubeconfig` path, or $KUBECONFIG / ~/.kube/config)."""
    from kubernetes import client, config

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
            f"cannot configure the Kubernetes client ({exc}); run in a pod with a service account or "
            f"pass --kubeconfig FILE"
        ) from None
    return client.CoreV1Api()


def create_backend(config: BackendConfig) -> KubernetesBackend:
    """Options (`--backend-opt k=v`): namespace, kubeconfig, context."""
    opts = dict(config.options)
    api = load_api(opts.get("kubeconfig"), opts.get("context"))
    return KubernetesBackend(api, capacity=config.capacity, namespace=opts.get("namespace") or None)
