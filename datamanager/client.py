"""Typed Python client of the data manager, used by the scheduler to push allocations.

    dm = DataManagerClient("http://127.0.0.1:7070")
    dm.allocate_cache_size("imagenet", 143e9)
    dm.allocate_remote_io("job-17", 200e6, workers=4)
    dm.status()

`allocate_*` declare the dataset/job first (idempotent PUT) unless `declare=False`, because the
scheduler allocates before a job's mounts exist; the HTTP API itself answers 404 for names it
has never seen, so a typo in another client cannot silently allocate to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import os

import httpx


class DataManagerError(RuntimeError):
    """The manager rejected a request (4xx/5xx); `status_code` and the manager's `detail`."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"data manager answered {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


@dataclass(frozen=True)
class DatasetAllocation:
    name: str
    uri: str | None
    cache_bytes: int | None
    cache_mode: str | None = None


@dataclass(frozen=True)
class JobAllocation:
    id: str
    dataset: str | None
    bytes_per_s: float | None
    workers: int


class DataManagerClient:
    def __init__(self, base_url: str, timeout: float = 5.0, transport: httpx.BaseTransport | None = None,
                 token: str | None = None) -> None:
        # The scheduler's token (datamanager/auth.py); from SILOD_DM_TOKEN when not given.
        token = token or os.environ.get("SILOD_DM_TOKEN") or None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "DataManagerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, json: dict | None = None) -> Any:
        r = self._http.request(method, path, json=json)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise DataManagerError(r.status_code, str(detail))
        return r.json()

    def declare_dataset(self, name: str, uri: str | None = None) -> DatasetAllocation:
        return DatasetAllocation(**self._call("PUT", f"/v1/datasets/{name}", {"uri": uri}))

    def declare_job(self, job_id: str, dataset: str | None = None, workers: int | None = None) -> JobAllocation:
        return JobAllocation(**self._call("PUT", f"/v1/jobs/{job_id}", {"dataset": dataset, "workers": workers}))

    def allocate_cache_size(self, dataset: str, nbytes: int | float, declare: bool = True) -> DatasetAllocation:
        """allocateCacheSize(dataset, bytes) of SiloD Table 3."""
        if declare:
            self._call("PUT", f"/v1/datasets/{dataset}", {})
        return DatasetAllocation(**self._call("PUT", f"/v1/datasets/{dataset}/cache", {"bytes": nbytes}))

    def set_cache_mode(self, dataset: str, mode: str, declare: bool = True) -> DatasetAllocation:
        """uniform | lru for the dataset's cache (irregular jobs read from LRU caches)."""
        if declare:
            self._call("PUT", f"/v1/datasets/{dataset}", {})
        return DatasetAllocation(**self._call("PUT", f"/v1/datasets/{dataset}/cache-mode", {"mode": mode}))

    def allocate_remote_io(self, job_id: str, bytes_per_s: float, workers: int = 1, declare: bool = True) -> JobAllocation:
        """allocateRemoteIO(job, bytes/s) of SiloD Table 3; split evenly among `workers` mounts."""
        if declare:
            self._call("PUT", f"/v1/jobs/{job_id}", {})
        body = {"bytes_per_s": bytes_per_s, "workers": workers}
        return JobAllocation(**self._call("PUT", f"/v1/jobs/{job_id}/remote-io", body))

    def delete_job(self, job_id: str) -> None:
        self._call("DELETE", f"/v1/jobs/{job_id}")

    def set_placements(self, nodes: dict[str, list[str]]) -> dict[str, Any]:
        """node -> the storage keys it has a reason to mount: node-bound agents register only those."""
        return self._call("PUT", "/v1/placements", {"nodes": nodes})

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")
