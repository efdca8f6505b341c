"""The admission webhook's caBundle, kept by silod itself.

deploy/base/webhook.yaml carries no `caBundle`: `kubectl apply` (client-side or server-side)
then never touches the field, and an upgrade that re-applies the manifests keeps admission
working. `silod serve --webhook-listen` writes the CA of its own serving certificate into its
MutatingWebhookConfiguration at start and checks it again every minute (a configuration
re-created, or re-applied from an older manifest that still had `caBundle: ""`, is repaired
within a minute).

Certificate rotation: the new CA goes first and the CAs already in the bundle stay while they are
valid (at most MAX_CAS), so replicas still serving the old certificate during a rolling restart
keep being trusted.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from pathlib import Path
from typing import Any

from estimator.errors import UserError

log = logging.getLogger("silod.webhook")

CONFIGURATION = "silod-suspend"  # deploy/base/webhook.yaml
MAX_CAS = 3
_BEGIN = b"-----BEGIN CERTIFICATE-----"


def _pem_certs(pem: bytes) -> list[bytes]:
    out, rest = [], pem
    while _BEGIN in rest:
        start = rest.index(_BEGIN)
        end = rest.index(b"-----END CERTIFICATE-----", start) + len(b"-----END CERTIFICATE-----")
        out.append(rest[start:end] + b"\n")
        rest = rest[end:]
    return out


def webhook_ca(cert: Path, ca: Path | None = None) -> bytes:
    """The CA the API server must trust for `cert`: `ca` when given, else `ca.crt` beside the
    certificate (a kubernetes.io/tls Secret from cert-manager or `kubectl create secret tls` with
    the CA added), else the certificate itself when it is self-signed."""
    from cryptography import x509

    candidates = [ca] if ca is not None else [cert.parent / "ca.crt"]
    for path in candidates:
        if path is not None and path.is_file():
            pem = path.read_bytes()
            if not _pem_certs(pem):
                raise UserError(f"--webhook-ca {path}: no PEM certificate in it")
            return b"".join(_pem_certs(pem))
    if ca is not None:
        raise UserError(f"--webhook-ca {ca} does not exist")
    leaf = x509.load_pem_x509_certificate(_pem_certs(cert.read_bytes())[0])
    if leaf.issuer != leaf.subject:
        raise UserError(f"--webhook-cert {cert} is issued by {leaf.issuer.rfc4514_string()}, and neither --webhook-ca"
                        f" nor {cert.parent / 'ca.crt'} gives that CA: silod writes it into the webhook's caBundle")
    return _pem_certs(cert.read_bytes())[0]


def merged_bundle(current_b64: str | None, ca_pem: bytes, now: float) -> bytes:
    """`ca_pem` first, then the still-valid CAs of the current bundle (at most MAX_CAS in all)."""
    from cryptography import x509

    keep = list(_pem_certs(ca_pem))
    try:
        current = base64.b64decode(current_b64 or "")
    except ValueError:
        current = b""
    for pem in _pem_certs(current):
        if pem in keep or len(keep) >= MAX_CAS:
            continue
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError:
            continue
        if cert.not_valid_after_utc.timestamp() > now:
            keep.append(pem)
    return b"".join(keep)


def publish_ca_bundle(api_client: Any, ca_pem: bytes, name: str = CONFIGURATION,
                      now: float | None = None) -> bool:
    """Make every webhook of MutatingWebhookConfiguration `name` trust `ca_pem`. True when it
    wrote, False when the bundle already held it. Raises the API's error (missing object, RBAC)."""
    from kubernetes import client

    api = client.AdmissionregistrationV1Api(api_client)
    cfg = api_client.sanitize_for_serialization(api.read_mutating_webhook_configuration(name))
    now = time.time() if now is None else now
    ours = _pem_certs(ca_pem)
    patch, version = [], cfg["metadata"]["resourceVersion"]
    for i, wh in enumerate(cfg.get("webhooks") or ()):
        current = (wh.get("clientConfig") or {}).get("caBundle")
        try:
            held = _pem_certs(base64.b64decode(current or ""))
        except ValueError:
            held = []
        if all(c in held for c in ours):
            continue
        bundle = base64.b64encode(merged_bundle(current, ca_pem, now)).decode()
        patch.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle})
    if not patch:
        return False
    # The resourceVersion test makes a concurrent edit (another replica, an apply) a conflict to
    # retry on the next check rather than a bundle written against an old list of webhooks.
    patch.insert(0, {"op": "test", "path": "/metadata/resourceVersion", "value": version})
    api.patch_mutating_webhook_configuration(name, patch, field_manager="silod")
    log.info("caBundle of MutatingWebhookConfiguration %s now trusts this replica's webhook CA", name)
    return True


class CaBundleKeeper:
    """Publishes the CA at start (`start`: an error then stops `silod serve`) and re-checks it
    every `interval_s` on its own thread."""

    def __init__(self, api_client: Any, ca_pem: bytes, name: str = CONFIGURATION, interval_s: float = 60.0):
        self.api_client, self.ca_pem, self.name = api_client, ca_pem, name
        self.interval_s = interval_s
        self.writes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> CaBundleKeeper:
        self.check()
        self._thread = threading.Thread(target=self._run, name="silod-cabundle", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def check(self) -> None:
        """One check. At start (`start`) a failure raises; later ones are logged and retried."""
        first = self._thread is None
        try:
            if publish_ca_bundle(self.api_client, self.ca_pem, self.name):
                self.writes += 1
        except Exception as exc:  # noqa: BLE001 - logged; the next check retries
            if first:
                raise UserError(f"cannot write the caBundle of MutatingWebhookConfiguration {self.name}"
                                f" (--webhook-configuration): {str(exc)[:300]}; apply deploy/base (its ClusterRole"
                                f" silod-scheduler grants get/patch on it), or pass --webhook-configuration none"
                                f" when cert-manager or you manage the caBundle") from None
            log.warning("cannot write the caBundle of MutatingWebhookConfiguration %s: %s", self.name,
                        str(exc)[:300])
