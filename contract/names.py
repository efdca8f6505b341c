"""Dataset names and job ids as both planes spell them: their validation (`silod mount`, the data
manager API) and the storage key, a tenant's dataset's one name outside the scheduler's database.

Names become directory names in the cache and path segments in URLs, so anything that could
escape a directory (`/`, `..`) or confuse a URL is rejected with a message naming the input.
"""

from __future__ import annotations

import hashlib
import re

from estimator.errors import UserError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
NAME_HELP = "use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit (no '/' and no '..')"


def validate_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise UserError(f"{what} {value!r} is not a valid name; {NAME_HELP}")
    return value


def storage_key(dataset_id: int, name: str) -> str:
    """The dataset's name outside the database (policy snapshots, the data manager, cache
    directories, backends): names are unique per tenant only, so two tenants' `imagenet` must
    not share a cache. The id prefix makes the key unique (and a valid name) even when cut."""
    return f"d{dataset_id}-{name}"[:128]


def dataset_id_of_key(key: str) -> int | None:
    head = key.split("-", 1)[0]
    return int(head[1:]) if head.startswith("d") and head[1:].isdigit() else None


def node_mount_job(node: str, key: str) -> str:
    """The data-manager job id of a node agent's mount of the dataset with storage key `key` on
    `node`: the scheduler's Kubernetes backend allocates it remote IO (the sum over the jobs
    admitted on the node that read the dataset) and the agent's mount registers under it
    (fuse_client/agent/volumes.py). Built from the storage key, not the tenant's dataset name, so
    two tenants' `files` on one node are two jobs. `_` cannot occur in a node name (RFC 1123), so
    the id splits back unambiguously. Ids are names (at most 128 characters): a longer one (node
    names go up to 253) takes a digest of the node instead, still one id per (node, key)."""
    job = f"node-{node}_{key}"
    if len(job) <= 128:
        return job
    digest = hashlib.sha256(node.encode()).hexdigest()[:16]
    return f"node-{digest}_{key}"[:128]
