"""The placeholder secrets deploy/base/secret.yaml ships, refused wherever a process reads them.

Every value in that file is marked `change-me` (the Fernet key is base64 of a marked string), so an
operator who applies the manifests without generating the Secret gets a process that refuses to
start, naming the Secret key and the command that makes a real value, instead of a cluster whose
admin token, token HMAC key and sealing key are public. The scheduler (`silod serve`), the data
manager, the node agent and the CSI controller call `refuse_placeholders` at start; each looks at
every variable of `SECRET_ENV` that is set, plus the values it was given by flag or file.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping

from estimator.errors import UserError

MARKER = "change-me"
SECRET = "silod-secrets"  # the Secret of deploy/base/secret.yaml

# environment variable -> the key of Secret silod-secrets it comes from (deploy/base/*.yaml;
# tests/test_kubernetes_install.py checks this table against the manifests' secretKeyRefs)
SECRET_ENV: dict[str, str] = {
    "SILOD_ADMIN_TOKEN": "admin-token",
    "SILOD_TOKEN_KEY": "token-key",
    "SILOD_SECRET_KEYS": "secret-keys",
    "SILOD_DM_TOKEN": "dm-scheduler-token",
    "SILOD_DM_SCHEDULER_TOKEN": "dm-scheduler-token",
    "SILOD_AGENT_TOKEN": "agent-token",
    "DATABASE_URL": "database-url",
}

_HEX24 = "$(openssl rand -hex 24)"
GENERATE: dict[str, str] = {
    "admin-token": _HEX24,
    "agent-token": _HEX24,
    "dm-scheduler-token": _HEX24,
    "token-key": "$(openssl rand -hex 32)",
    "secret-keys": "$(python3 -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')",
    "database-url": "postgresql+psycopg://silod:PASSWORD@HOST:5432/silod (a password of your own)",
    "tokens": "agent:<the agent-token value>",
}


def is_placeholder(value: str) -> bool:
    if MARKER in value.lower():
        return True
    try:  # the sealing key placeholder is a valid Fernet key: base64 of a marked string
        decoded = base64.urlsafe_b64decode(value.strip().split(",")[0] + "==")
    except (binascii.Error, ValueError):
        return False
    return MARKER.encode() in decoded.lower()


def refuse_placeholders(given: Mapping[str, tuple[str, str | None]] | None = None,
                        environ: Mapping[str, str] | None = None) -> None:
    """UserError when a secret this process reads is one of deploy/base/secret.yaml's placeholders.

    `given`: what the process got other than through SECRET_ENV, as {what: (Secret key, value)},
    e.g. {"--db": ("database-url", url)}."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, str]] = [(var, key) for var, key in SECRET_ENV.items()
                                    if env.get(var) and is_placeholder(env[var])]
    found += [(what, key) for what, (key, value) in (given or {}).items() if value and is_placeholder(value)]
    if not found:
        return
    what, key = found[0]
    others = ", ".join(f"{k} ({w})" for w, k in found[1:])
    raise UserError(
        f"{what} holds the placeholder from deploy/base/secret.yaml (Secret {SECRET}, key {key}); refusing to start"
        f" with a public secret{'; also ' + others if others else ''}. Generate the Secret: kubectl -n silod-system"
        f" create secret generic {SECRET} --from-literal={key}={GENERATE.get(key, '<a value of your own>')} ..."
        f" (every key: docs/kubernetes.md, 'Secrets')")
