"""The credential hand-over between the control plane and a mount process.

A backend (local workers, the node agent) starts `silod mount` for a tenant's dataset and hands
it that tenant's credential in environment variables set for that process only -- never a
command-line argument, which other users can read in /proc. Both sides import the names from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CREDENTIAL_ENV = {
    "access_key_id": "SILOD_SOURCE_ACCESS_KEY_ID",
    "secret_access_key": "SILOD_SOURCE_SECRET_ACCESS_KEY",
    "endpoint_url": "SILOD_SOURCE_ENDPOINT_URL",
    "region": "SILOD_SOURCE_REGION",
}
ANONYMOUS_ENV = "SILOD_SOURCE_ANONYMOUS"  # "1": read s3 anonymously, never with ambient credentials


@dataclass(frozen=True)
class SourceCredential:
    """A tenant's credential for its dataset's store. The secret never appears in a repr."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    endpoint_url: str | None = None
    region: str | None = None

    def to_env(self) -> dict[str, str]:
        return {CREDENTIAL_ENV[k]: v for k, v in (("access_key_id", self.access_key_id),
                ("secret_access_key", self.secret_access_key), ("endpoint_url", self.endpoint_url),
                ("region", self.region)) if v}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "SourceCredential | None":
        import os

        env = dict(os.environ) if env is None else env
        key, secret = env.get(CREDENTIAL_ENV["access_key_id"]), env.get(CREDENTIAL_ENV["secret_access_key"])
        if not key or not secret:
            return None
        return cls(key, secret, env.get(CREDENTIAL_ENV["endpoint_url"]) or None, env.get(CREDENTIAL_ENV["region"]) or None)
