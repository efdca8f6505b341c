"""Which dataset a pod may mount: (namespace, dataset name) -> where its data is.

The namespace comes from kubelet (the `csi.storage.k8s.io/pod.namespace` volume context of a
driver with podInfoOnMount), never from the pod's own words; a namespace belongs to one tenant
(`<prefix><tenant>`), and a tenant mounts only its own datasets. Two sources:

- `CatalogResolver`: a YAML file an operator maintains (a ConfigMap in the DaemonSet),
  `datasets: [{tenant, name, uri, cache_size?, key?}]`;
- `SchedulerResolver`: the silod scheduler's REST API (`GET /v1/datasets/{name}`) with the
  agent's token; the dataset must be registered by the tenant that owns the namespace.

Either way a dataset comes with its storage key (contract/names.py): the one name of (tenant,
dataset) outside the scheduler's database. The node's mount registers with the data manager under
it (`silod mount --dataset KEY`), so the scheduler's cache allocations, which are keyed by it,
reach the mount, and two tenants' datasets of one name never share a data-manager entry or cache.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

from contract.credentials import SourceCredential
from estimator.errors import UserError
from estimator.units import UnitError, parse_size

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_CATALOG_BYTES = 4 * 1024 * 1024


class DatasetDenied(UserError):
    """The pod's tenant may not mount this dataset (or it does not exist for that tenant)."""


@dataclass(frozen=True, slots=True)
class DatasetSource:
    tenant: str
    name: str
    uri: str
    cache_size: int | None = None  # bytes; None = whatever the data manager allocates
    #: the storage key: the mount's name at the data manager and in the cache ("" = catalog_key)
    key: str = ""
    # The dataset owner's credential for `uri`; None: read anonymously, never with the node's
    # own cloud credentials (volumes.py hands it to the mount process only). Never recorded.
    credential: SourceCredential | None = field(default=None, repr=False, compare=False)


    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", catalog_key(self.tenant, self.name))


def catalog_key(tenant: str, name: str) -> str:
    """The storage key of a catalog entry that names none (an agent without a scheduler): unique
    per (tenant, name) and a valid name, and never of the scheduler's `d<id>-<name>` form."""
    digest = hashlib.sha256(f"{tenant}/{name}".encode()).hexdigest()[:12]
    return f"t{digest}-{name}"[:128]


class DatasetResolver(Protocol):
    def resolve(self, tenant: str, name: str, *, credential: bool = True) -> DatasetSource:
        """`credential=False`: whether the tenant has the dataset, without its credential (the CSI
        controller provisions PVCs and never mounts: its shared token is bound to no node)."""


def check_name(value: str, what: str) -> str:
    if not NAME_RE.match(value or "") or ".." in value:
        raise DatasetDenied(f"{what} {value!r} is not a valid silod name (letters, digits, '.', '_', '-')")
    return value


class CatalogResolver:
    def __init__(self, path: Path):
        import yaml

        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise UserError(f"--datasets {str(path)!r}: {exc.strerror}") from None
        if len(raw) > MAX_CATALOG_BYTES:
            raise UserError(f"--datasets {str(path)!r} is larger than 4 MiB")
        try:
            doc = yaml.safe_load(raw) or {}
        except yaml.YAMLError as exc:
            raise UserError(f"--datasets {str(path)!r} is not YAML: {exc}") from None
        entries = doc.get("datasets") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise UserError(f"--datasets {str(path)!r} needs a top-level list `datasets:` of {{tenant, name, uri}}")
        self.entries: dict[tuple[str, str], DatasetSource] = {}
        for i, e in enumerate(entries):
            where = f"--datasets {path} entry {i}"
            if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in ("tenant", "name", "uri")):
                raise UserError(f"{where}: needs string fields tenant, name and uri")
            size = None
            if e.get("cache_size") is not None:
                try:
                    size = int(parse_size(str(e["cache_size"]), f"{where} cache_size"))
                except UnitError as exc:
                    raise UserError(str(exc)) from None
            key = e.get("key")
            if key is not None and not isinstance(key, str):
                raise UserError(f"{where}: key must be a string (the dataset's storage key in silod, e.g. d12-imagenet)")
            src = DatasetSource(check_name(e["tenant"], f"{where} tenant"), check_name(e["name"], f"{where} name"),
                                e["uri"], size, key=check_name(key, f"{where} key") if key else "")
            clash = next((o for o in self.entries.values() if o.key == src.key and (o.tenant, o.name) != (src.tenant, src.name)), None)
            if clash is not None:
                raise UserError(f"{where}: key {src.key!r} is also the key of {clash.tenant}/{clash.name}; one storage"
                                f" key per (tenant, dataset)")
            self.entries[(src.tenant, src.name)] = src

    def resolve(self, tenant: str, name: str, *, credential: bool = True) -> DatasetSource:
        src = self.entries.get((tenant, name))
        if src is None:
            raise DatasetDenied(f"tenant {tenant} has no dataset {name!r} in the agent's catalog")
        return src


class SchedulerResolver:
    """Datasets (and the owner's credential, when the dataset names one) from the scheduler's
    API with the node agents' token. `client`: an httpx.Client to use (tests)."""

    def __init__(self, url: str, token: str | Callable[[], str], timeout: float = 10.0, client: Any = None):
        """`token`: the token, or a function giving it at each call (a rotated token file)."""
        self.url, self.timeout = url.rstrip("/"), timeout
        self._token = token if callable(token) else (lambda: token)
        self.client = client

    def _get(self, path: str, params: dict[str, str]) -> Any:
        import httpx

        headers = {"Authorization": f"Bearer {self._token()}"}
        try:
            if self.client is not None:
                return self.client.get(f"{self.url}{path}", params=params, headers=headers, timeout=self.timeout)
            return httpx.get(f"{self.url}{path}", params=params, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as exc:
            raise UserError(f"cannot reach the silod scheduler at {self.url}: {exc}") from None

    def resolve(self, tenant: str, name: str, *, credential: bool = True) -> DatasetSource:
        r = self._get(f"/v1/datasets/{name}", {"owner": tenant})
        if r.status_code == 404:
            raise DatasetDenied(f"tenant {tenant} has no dataset {name!r} registered in silod")
        if r.status_code >= 400:
            raise UserError(f"the silod scheduler answered HTTP {r.status_code} for dataset {name!r}")
        body: dict[str, Any] = r.json()
        if body.get("owner") != tenant:
            raise DatasetDenied(f"dataset {name!r} belongs to another tenant than {tenant}")
        source_credential = None
        if credential and body.get("credential"):
            c = self._get(f"/v1/datasets/{name}/source-credential", {"owner": tenant})
            if c.status_code >= 400:
                try:
                    why = str(c.json().get("detail") or "")[:300]
                except ValueError:
                    why = ""
                # 403: this node has no reason to mount it yet (the scheduler records a job's pod on
                # the node within seconds of its binding; kubelet retries the publish), or the
                # token is not a node-bound agent's (silod serve --node-agent USER=NODE).
                raise UserError(f"the silod scheduler answered HTTP {c.status_code} for the credential of dataset"
                                f" {name!r}: {why or 'no detail'}")
            got = c.json().get("credential")
            if got:
                source_credential = SourceCredential(str(got["access_key_id"]), str(got["secret_access_key"]),
                                              got.get("endpoint_url") or None, got.get("region") or None)
        key = body.get("key")
        if not isinstance(key, str) or not NAME_RE.match(key):
            raise UserError(f"the silod scheduler gave no valid storage key for dataset {name!r} (got {key!r});"
                            f" the agent needs a scheduler that answers `key` in GET /v1/datasets/{{name}}")
        return DatasetSource(tenant, name, str(body["uri"]), key=key, credential=source_credential)
