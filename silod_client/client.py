"""`Client`: every public route of the silod REST API as a typed method.

    from silod_client import Client

    with Client("http://127.0.0.1:8080", token) as silod:
        silod.datasets.register("imagenet", "s3://bucket/imagenet", "143GB")
        job = silod.jobs.submit("resnet", gpus=2, dataset="imagenet", epochs=3, ideal_throughput="400MB/s")
        silod.jobs.wait(job.id)

Retries. A request that never reached the server (connection refused, DNS) is retried whatever
its method. One that may have been processed (timeout, connection lost mid-answer, 502/503/504)
is retried only when repeating it cannot do anything twice: GET and PUT; POST /v1/jobs, because
it carries an `Idempotency-Key` (the same key and body return the same job); POST /v1/datasets
(re-registering identical fields is a no-op) and a job's report (only the latest is kept).
Cancelling a job, deleting and creating tokens or credentials are never retried after they may
have reached the server. A 503 waits its `Retry-After` (capped) before the next attempt.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

import silod_client.models as m
from silod_client.errors import ApiError, SilodError, TransportError, WaitTimeout, error_for

T = TypeVar("T")

#: (method, OpenAPI path) -> the client method that calls it; tests/test_sdk.py compares it with
#: the OpenAPI document of a real `silod serve`.
ROUTES: dict[tuple[str, str], str] = {}

RETRY_STATUSES = frozenset({502, 503, 504})
MAX_RETRY_AFTER_S = 30.0


def route(method: str, path: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    def mark(fn: Callable[..., T]) -> Callable[..., T]:
        ROUTES[(method, path)] = fn.__qualname__
        return fn
    return mark


def segment(value: str | int) -> str:
    """`value` as one URL path segment ('/', '?', '#', '%' encoded; '.' and '..' too, so that
    nothing between here and the server resolves them as dot segments)."""
    encoded = quote(str(value), safe="")
    return encoded.replace(".", "%2E") if encoded in (".", "..") else encoded


def _detail_text(detail: Any) -> str:
    if isinstance(detail, list):  # FastAPI's validation list: one problem per entry, naming its field
        parts = []
        for e in detail:
            loc = [str(p) for p in (e.get("loc") or [])[1:]] if isinstance(e, dict) else []
            msg = e.get("msg") if isinstance(e, dict) else e
            parts.append(f"{'.'.join(loc)}: {msg}" if loc else str(msg))
        return "; ".join(parts)
    return str(detail)


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class Client:
    """A silod server at `url` (e.g. http://127.0.0.1:8080), authenticated with `token`.

    `timeout`: seconds for each request (connect, read, write); `retries`: further attempts of
    a retry-safe request (module docstring); `backoff`: the first wait between attempts,
    doubled each time. `transport` is httpx's (tests, proxies). Use as a context manager, or
    call `close()`."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0, retries: int = 3, backoff: float = 0.25,
                 transport: httpx.BaseTransport | None = None, user_agent: str = "silod-client"):
        try:
            base = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"url {url!r} is not a valid URL ({exc}); e.g. http://127.0.0.1:8080") from None
        if base.scheme not in ("http", "https") or not base.host:
            raise ValueError(f"url {url!r} is not an http(s) URL with a host; e.g. http://127.0.0.1:8080")
        headers = {"User-Agent": user_agent}
        if token is not None:
            if not token or any(not " " <= ch <= "~" for ch in token):
                raise ValueError("token must be non-empty printable ASCII, as the tokens silod issues are")
            headers["Authorization"] = f"Bearer {token}"
        if retries < 0 or backoff < 0 or timeout <= 0:
            raise ValueError("retries and backoff must be >= 0 and timeout > 0")
        self.url = str(base).rstrip("/")
        self.retries, self.backoff = retries, backoff
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        self.datasets = Datasets(self)
        self.jobs = Jobs(self)
        self.credentials = Credentials(self)
        self.tokens = Tokens(self)
        self.quotas = Quotas(self)
        self.policy = PolicyApi(self)
        self.agents = Agents(self)

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                retry_safe: bool, headers: dict[str, str] | None = None, expect_json: bool = True,
                anonymous: bool = False) -> Any:
        """One API call with the retry rules of the module docstring; the decoded JSON answer
        (None for 204), or the text with `expect_json=False`; `anonymous`: without the token."""
        params = _drop_none(params or {})
        attempt = 0
        while True:
            wait = self.backoff * (2 ** attempt)
            try:
                req = self._http.build_request(method, path, json=json, params=params, headers=headers)
                if anonymous:
                    req.headers.pop("Authorization", None)
                response = self._http.send(req)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the server
                if attempt >= self.retries:
                    raise TransportError(f"{method} {self.url}{path}: cannot reach the silod server ({exc})",
                                         method=method, url=self.url + path) from exc
            except httpx.TimeoutException as exc:
                if not retry_safe or attempt >= self.retries:
                    raise TransportError(f"{method} {self.url}{path}: no answer in time ({type(exc).__name__})",
                                         method=method, url=self.url + path) from exc
            except httpx.TransportError as exc:
                if not retry_safe or attempt >= self.retries:
                    raise TransportError(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}",
                                         method=method, url=self.url + path) from exc
            else:
                if response.status_code < 400:
                    if response.status_code == 204 or not response.content:
                        return None
                    if not expect_json:
                        return response.text
                    try:
                        return response.json()
                    except ValueError:
                        raise SilodError(f"{method} {path}: the answer is not JSON (HTTP {response.status_code});"
                                         f" is {self.url} a silod server?") from None
                error = self._error(method, path, response)
                if response.status_code not in RETRY_STATUSES or not retry_safe or attempt >= self.retries:
                    raise error
                if error.retry_after is not None:
                    wait = max(wait, min(error.retry_after, MAX_RETRY_AFTER_S))
            attempt += 1
            time.sleep(wait)

    @staticmethod
    def _error(method: str, path: str, response: httpx.Response) -> ApiError:
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "detail" in body:
            detail, field = _detail_text(body["detail"]), body.get("field")
        else:
            detail, field = (response.text[:500] or response.reason_phrase), None
        retry_after = None
        with_suppress = response.headers.get("Retry-After")
        if with_suppress is not None:
            try:
                retry_after = float(with_suppress)
            except ValueError:
                retry_after = None
        return error_for(response.status_code)(response.status_code, detail, field=field if isinstance(field, str) else None,
                                               method=method, path=path, body=body, retry_after=retry_after)

    def _get(self, path: str, model: type[T] | Any, params: dict[str, Any] | None = None) -> T:
        return TypeAdapter(model).validate_python(self.request("GET", path, params=params, retry_safe=True))

    # ------------------------------------------------------------------ ops and cluster

    @route("GET", "/healthz")
    def health(self) -> m.Health:
        """The API and its database answer (no token needed). A 503 is raised as ServerError."""
        return self._get("/healthz", m.Health)

    @route("GET", "/readyz")
    def ready(self) -> m.Ready:
        """A live process holds the scheduling lease (503, raised, while none does)."""
        return self._get("/readyz", m.Ready)

    @route("GET", "/metrics")
    def metrics(self, *, per_job: bool = False) -> str:
        """Prometheus text: the cluster totals (sent without the token), or with `per_job` also the
        per-job and per-dataset series (the metrics or an admin's token; Forbidden otherwise)."""
        return self.request("GET", "/metrics", retry_safe=True, expect_json=False, anonymous=not per_job)

    @route("GET", "/v1/overview")
    def overview(self) -> m.Overview:
        """The queue (positions and reasons), running jobs, datasets, recent utilisation."""
        return self._get("/v1/overview", m.Overview)

    @route("GET", "/v1/cluster")
    def cluster(self) -> m.Cluster:
        return self._get("/v1/cluster", m.Cluster)

    @route("GET", "/v1/allocations")
    def allocations(self) -> m.Allocations:
        return self._get("/v1/allocations", m.Allocations)

    @route("GET", "/v1/allocations/history")
    def allocation_history(self, subject: str | None = None, limit: int = 100) -> list[m.Change]:
        """Admin: one row per changed allocation value, newest first (`subject`: a job id or dataset key)."""
        return self._get("/v1/allocations/history", list[m.Change], {"subject": subject, "limit": limit})

    @route("POST", "/v1/rounds")
    def run_round(self) -> m.Round:
        """Admin: a scheduling round now. Not retried once it may have reached the server."""
        return m.Round.model_validate(self.request("POST", "/v1/rounds", retry_safe=False))


class _Api:
    def __init__(self, client: Client):
        self._c = client

    def _pages(self, fetch: Callable[[int, int], list[T]], page_size: int) -> Iterator[T]:
        offset = 0
        while True:
            page = fetch(page_size, offset)
            yield from page
            if len(page) < page_size:
                return
            offset += len(page)


class Datasets(_Api):
    @route("POST", "/v1/datasets")
    def register(self, name: str, uri: str, size: float | str, *, item_count: int | None = None,
                 credential: str | None = None) -> m.Dataset:
        """Register a dataset (`size`: bytes or e.g. "143GB"). Registering identical fields again
        returns the existing one; other fields are a Conflict."""
        body = _drop_none({"name": name, "uri": uri, "size": size, "item_count": item_count, "credential": credential})
        return m.Dataset.model_validate(self._c.request("POST", "/v1/datasets", json=body, retry_safe=True))

    @route("GET", "/v1/datasets/{name}")
    def get(self, name: str, *, owner: str | None = None) -> m.Dataset:
        """Yours, or `owner`'s when shared with you."""
        return self._c._get(f"/v1/datasets/{segment(name)}", m.Dataset, {"owner": owner})

    @route("GET", "/v1/datasets")
    def list(self, *, limit: int = 1000, offset: int = 0) -> list[m.Dataset]:
        """One page (at most 1,000), in (owner, name) order."""
        return self._c._get("/v1/datasets", list[m.Dataset], {"limit": limit, "offset": offset})

    def iter(self, *, page_size: int = 1000) -> Iterator[m.Dataset]:
        """Every dataset you can read, a page at a time."""
        return self._pages(lambda limit, offset: self.list(limit=limit, offset=offset), page_size)

    @route("PUT", "/v1/datasets/{name}/grants/{tenant}")
    def grant(self, name: str, tenant: str, *, owner: str | None = None) -> m.Dataset:
        """Share your dataset with `tenant` (its jobs read it with your credential, into the same cache)."""
        return m.Dataset.model_validate(self._c.request(
            "PUT", f"/v1/datasets/{segment(name)}/grants/{segment(tenant)}", params={"owner": owner}, retry_safe=True))

    @route("DELETE", "/v1/datasets/{name}/grants/{tenant}")
    def revoke(self, name: str, tenant: str, *, owner: str | None = None) -> m.Dataset:
        """Take a grant back (idempotent: revoking an absent grant answers the dataset)."""
        return m.Dataset.model_validate(self._c.request(
            "DELETE", f"/v1/datasets/{segment(name)}/grants/{segment(tenant)}", params={"owner": owner},
            retry_safe=True))

    @route("GET", "/v1/datasets/{name}/source-credential")
    def source_credential(self, name: str, *, owner: str) -> m.SourceCredential | None:
        """Node agents only: the credential a node's mount of `owner`'s dataset reads with (None: anonymous)."""
        body = self._c.request("GET", f"/v1/datasets/{segment(name)}/source-credential", params={"owner": owner},
                               retry_safe=True)
        cred = (body or {}).get("credential")
        return None if cred is None else m.SourceCredential.model_validate(cred)


class Jobs(_Api):
    @route("POST", "/v1/jobs")
    def submit(self, name: str, *, gpus: int, dataset: str, epochs: float | None = None, steps: int | None = None,
               step_bytes: float | str | None = None, ideal_throughput: float | str | None = None,
               model: str | None = None, priority: int | None = None, dataset_owner: str | None = None,
               access: str | dict[str, Any] | None = None, pod_template: m.PodTemplate | dict[str, Any] | None = None,
               cpu_rate: float | str | None = None, autocache_expansion: float | None = None,
               post_cpu_rate: float | str | None = None, program: dict[str, Any] | None = None,
               loader: m.Loader | dict[str, Any] | None = None, idempotency_key: str | None = None) -> m.Job:
        """Submit a job: `epochs`, or `steps` with `step_bytes`; `ideal_throughput` (f*, bytes/s or
        "114MB/s") or a catalog `model`. `access`: "epoch", "irregular" or {"kind": "curriculum", ...};
        `pod_template`: the pods on Kubernetes (`models.PodTemplate` or a dict: image, command, env,
        resources, tolerations, node_selector, affinity, ...); `program`: {"command": [...], "env": {...}}, what
        the local backend runs on the mounted dataset; `cpu_rate`/`autocache_expansion`/
        `post_cpu_rate`: the input pipeline; `loader`: the job's data loader (`models.Loader` or
        {"workers": 4, "item_bytes": "110KB"}), whose miss term the service's prediction then
        counts. Retried safely under one Idempotency-Key (a fresh
        one unless given): a lost answer never submits the job twice."""
        body = _drop_none({
            "name": name, "gpus": gpus, "dataset": dataset, "epochs": epochs, "steps": steps, "step_bytes": step_bytes,
            "ideal_throughput": ideal_throughput, "model": model, "priority": priority, "dataset_owner": dataset_owner,
            "access": access, "cpu_rate": cpu_rate,
            "pod_template": pod_template.to_json() if isinstance(pod_template, m.PodTemplate) else pod_template,
            "autocache_expansion": autocache_expansion, "post_cpu_rate": post_cpu_rate, "program": program,
            "loader": loader.to_json() if isinstance(loader, m.Loader) else loader,
        })
        key = idempotency_key or f"silod-client-{uuid.uuid4()}"
        return m.Job.model_validate(self._c.request("POST", "/v1/jobs", json=body, retry_safe=True,
                                                    headers={"Idempotency-Key": key}))

    @route("GET", "/v1/jobs/{job_id}")
    def get(self, job_id: str) -> m.Job:
        return self._c._get(f"/v1/jobs/{segment(job_id)}", m.Job)

    @route("GET", "/v1/jobs/{job_id}/allocations")
    def allocations(self, job_id: str, limit: int = 100) -> list[m.Change]:
        """Your job's allocation over time, newest first: one row per changed value (GPUs, GPU
        share, remote IO cap, cores), with the round that changed it."""
        return self._c._get(f"/v1/jobs/{segment(job_id)}/allocations", list[m.Change], {"limit": limit})

    @route("GET", "/v1/jobs")
    def list(self, *, state: str | None = None, owner: str | None = None, limit: int = 1000,
             offset: int = 0) -> list[m.Job]:
        """One page of your jobs (the admin: all, or `owner`'s); `state` may be "active"."""
        return self._c._get("/v1/jobs", list[m.Job], {"state": state, "owner": owner, "limit": limit, "offset": offset})

    def iter(self, *, state: str | None = None, owner: str | None = None, page_size: int = 1000) -> Iterator[m.Job]:
        """Every matching job, a page at a time (a job that changes state between pages may be
        seen twice or not at all when filtering by state)."""
        return self._pages(lambda limit, offset: self.list(state=state, owner=owner, limit=limit, offset=offset),
                           page_size)

    @route("DELETE", "/v1/jobs/{job_id}")
    def cancel(self, job_id: str) -> m.Job:
        """Cancel a job (Conflict when it already ended). Not retried once it may have reached the server."""
        return m.Job.model_validate(self._c.request("DELETE", f"/v1/jobs/{segment(job_id)}", retry_safe=False))

    @route("POST", "/v1/jobs/{job_id}/report")
    def report(self, job_id: str, *, step_seconds: float, batch_bytes: float) -> m.MeasuredParameters:
        """A running job's own figures: GPU seconds per step (without input waits) and source bytes
        per step. Training loops should use `silod_client.reporter`, which never raises."""
        body = {"step_seconds": float(step_seconds), "batch_bytes": float(batch_bytes)}
        return m.MeasuredParameters.model_validate(
            self._c.request("POST", f"/v1/jobs/{segment(job_id)}/report", json=body, retry_safe=True))

    def watch(self, job_id: str, *, interval: float = 1.0) -> Iterator[m.Job]:
        """The job each time its state, progress or message changed, until it ends (the last one yielded)."""
        last: tuple[Any, ...] | None = None
        while True:
            job = self.get(job_id)
            key = (job.state, job.consumed_bytes, job.message, job.allocated_gpus)
            if key != last:
                last = key
                yield job
            if job.done:
                return
            time.sleep(interval)

    def wait(self, job_id: str, states: Collection[str] = m.TERMINAL_STATES, *, timeout: float | None = None,
             interval: float = 1.0) -> m.Job:
        """Poll until the job is in one of `states` (default: ended); WaitTimeout after `timeout`
        seconds, and also when it ended in a state not waited for (it will never get there)."""
        wanted = frozenset(states)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job.state in wanted:
                return job
            if job.done:
                raise WaitTimeout(f"job {job_id} ended {job.state} ({job.message or 'no message'}), not in"
                                  f" {sorted(wanted)}", job)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id} is still {job.state} after {timeout:g}s", job)
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))


class Credentials(_Api):
    @route("POST", "/v1/credentials")
    def add(self, name: str, *, access_key_id: str, secret_access_key: str, endpoint_url: str | None = None,
            region: str | None = None, kind: str = "s3") -> m.Credential:
        """A store credential your datasets read with (the secret is never answered back)."""
        body = _drop_none({"name": name, "kind": kind, "access_key_id": access_key_id,
                           "secret_access_key": secret_access_key, "endpoint_url": endpoint_url, "region": region})
        return m.Credential.model_validate(self._c.request("POST", "/v1/credentials", json=body, retry_safe=False))

    @route("GET", "/v1/credentials")
    def list(self, *, limit: int = 1000, offset: int = 0) -> list[m.Credential]:
        return self._c._get("/v1/credentials", list[m.Credential], {"limit": limit, "offset": offset})

    @route("DELETE", "/v1/credentials/{name}")
    def delete(self, name: str) -> None:
        self._c.request("DELETE", f"/v1/credentials/{segment(name)}", retry_safe=False)


class Tokens(_Api):
    @route("POST", "/v1/tokens")
    def create(self, owner: str, *, admin: bool = False, expires_in_s: float | None = None,
               label: str = "") -> m.NewToken:
        """Admin: a new token for `owner`; the plain token is in this answer only."""
        body = _drop_none({"owner": owner, "admin": admin, "expires_in_s": expires_in_s, "label": label})
        return m.NewToken.model_validate(self._c.request("POST", "/v1/tokens", json=body, retry_safe=False))

    @route("GET", "/v1/tokens")
    def list(self) -> list[m.Token]:
        return self._c._get("/v1/tokens", list[m.Token])

    @route("DELETE", "/v1/tokens/{token_id}")
    def revoke(self, token_id: int) -> m.Token:
        return m.Token.model_validate(self._c.request("DELETE", f"/v1/tokens/{int(token_id)}", retry_safe=True))


class Quotas(_Api):
    @route("GET", "/v1/quotas/{tenant}")
    def get(self, tenant: str) -> m.Quota:
        return self._c._get(f"/v1/quotas/{segment(tenant)}", m.Quota)

    @route("PUT", "/v1/quotas/{tenant}")
    def set(self, tenant: str, *, gpus: int | None = None, cache_bytes: float | str | None = None,
            running_jobs: int | None = None, queued_jobs: int | None = None,
            ideal_per_gpu: float | str | None = None, min_work: float | str | None = None,
            max_work: float | str | None = None) -> m.Quota:
        """Admin: a tenant's limits (None: no limit; `ideal_per_gpu`: the most f* per GPU its jobs
        may declare, `min_work`/`max_work`: the least/most work in bytes they may declare; None for
        these: the service's default)."""
        body = {"gpus": gpus, "cache_bytes": cache_bytes, "running_jobs": running_jobs, "queued_jobs": queued_jobs,
                "ideal_per_gpu": ideal_per_gpu, "min_work": min_work, "max_work": max_work}
        return m.Quota.model_validate(self._c.request("PUT", f"/v1/quotas/{segment(tenant)}", json=body, retry_safe=True))


class PolicyApi(_Api):
    @route("GET", "/v1/policy")
    def get(self) -> m.Policy:
        return self._c._get("/v1/policy", m.Policy)

    @route("PUT", "/v1/policy")
    def set(self, name: str) -> m.Policy:
        """Admin: the scheduling policy (fifo, sjf, gavel, greedy or a plug-in)."""
        return m.Policy.model_validate(self._c.request("PUT", "/v1/policy", json={"name": name}, retry_safe=True))


class Agents(_Api):
    @route("POST", "/v1/agents/{node}/consumption")
    def report_consumption(self, node: str, pods: list[dict[str, Any]]) -> m.ConsumptionResult:
        """A node agent's cumulative per-pod read counters (counters only rise, so a repeat is harmless)."""
        return m.ConsumptionResult.model_validate(self._c.request(
            "POST", f"/v1/agents/{segment(node)}/consumption", json={"pods": pods}, retry_safe=True))


__all__ = ["Client", "ROUTES", "segment"]
