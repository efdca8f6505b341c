"""Bearer tokens: who is calling, from a token, before anything else about the request is read.

Where tokens come from:
- the bootstrap admin token, from the environment variable SILOD_ADMIN_TOKEN (never a file in
  the repository); it is kept in memory only, as a digest;
- a tokens file (`--tokens FILE`, one `tenant:token` per line), imported into the database at
  start so that its tokens can be revoked like the others;
- the admin API (`POST /v1/tokens`): random 256-bit tokens with an owner (the tenant they act
  for), an optional expiry and an admin flag, shown once at creation.

Tokens are stored only as HMAC-SHA256(server key, token). The key comes from SILOD_TOKEN_KEY or a
0600 key file next to the service's state (`token.key`), so a copy of the database alone does
not allow checking guesses offline. A lookup is by digest (no character-by-character compare).

Revocation and expiry take effect without a restart: a token's state is cached in each process
for at most `cache_ttl_s` (2 s) so that authentication costs no database round trip per request;
the process that revokes a token drops it from its cache at once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from estimator.errors import UserError
from scheduler.service.db.models import ApiToken
from scheduler.service.types import ADMIN, NotFoundError, Principal, ServiceError

ADMIN_TOKEN_ENV = "SILOD_ADMIN_TOKEN"
TOKEN_KEY_ENV = "SILOD_TOKEN_KEY"
METRICS_TOKEN_ENV = "SILOD_METRICS_TOKEN"
MIN_TOKEN_LEN = 8
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_CACHE_MAX = 10_000  # distinct tokens remembered per process (bad ones included), then cleared


def load_token_key(state_dir: Path | None) -> bytes:
    """The HMAC key: SILOD_TOKEN_KEY (>= 16 characters), else `state_dir/token.key`, created
    with 32 random bytes and mode 0600 when missing. Several workers on one host share the file."""
    env = os.environ.get(TOKEN_KEY_ENV)
    if env:
        if len(env) < 16:
            raise UserError(f"{TOKEN_KEY_ENV} is shorter than 16 characters; use e.g. `openssl rand -hex 32`")
        return env.encode()
    if state_dir is None:
        raise UserError(f"no token key: set {TOKEN_KEY_ENV} or give a state directory for token.key")
    path = Path(state_dir) / "token.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) < 16:
            raise UserError(f"token key file {path} is shorter than 16 bytes; delete it to make a new one") from None
        return key
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path.read_bytes()


def check_tenant(value: str, what: str = "owner") -> str:
    if not isinstance(value, str) or not TENANT_RE.match(value) or ".." in value:
        raise ServiceError(
            f"{what} {value!r} is not a valid tenant name: 1-64 letters, digits, '.', '_', '-', no '..'", field=what
        )
    return value


@dataclass(frozen=True, slots=True)
class TokenRecord:
    id: int
    owner: str
    is_admin: bool
    label: str
    source: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


@dataclass(frozen=True, slots=True)
class _Cached:
    principal: Principal | None  # None: unknown or revoked
    expires_at: float | None
    checked_at: float


class TokenStore:
    def __init__(self, engine: Engine | None, key: bytes, admin_token: str | None = None,
                 metrics_token: str | None = None, cache_ttl_s: float = 2.0):
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False) if engine is not None else None
        self._key = key
        for name, tok in ((ADMIN_TOKEN_ENV, admin_token), (METRICS_TOKEN_ENV, metrics_token)):
            if tok is not None and len(tok) < MIN_TOKEN_LEN:
                raise UserError(f"{name} is shorter than {MIN_TOKEN_LEN} characters; use a long random token")
        self._admin_digest = self.digest(admin_token) if admin_token else None
        self._metrics_digest = self.digest(metrics_token) if metrics_token else None
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, _Cached] = {}
        self._lock = threading.Lock()

    @property
    def protects_metrics(self) -> bool:
        return self._metrics_digest is not None

    def digest(self, token: str) -> str:
        return hmac.new(self._key, token.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    # ---------------------------------------------------------------- authentication

    def cached(self, token: str, now: float | None = None) -> tuple[bool, Principal | None]:
        """(hit, principal) from memory only: the API's middleware calls this on the event loop
        and goes to the database (in a worker thread) only on a miss."""
        now = time.time() if now is None else now
        d = self.digest(token)
        if self._admin_digest is not None and hmac.compare_digest(d, self._admin_digest):
            return True, Principal(ADMIN, is_admin=True)
        entry = self._cache.get(d)
        if entry is None or now - entry.checked_at > self.cache_ttl_s:
            return False, None
        if entry.expires_at is not None and now >= entry.expires_at:
            return True, None
        return True, entry.principal

    def authenticate(self, token: str, now: float | None = None) -> Principal | None:
        """The caller for a bearer token, or None (unknown, revoked or expired)."""
        now = time.time() if now is None else now
        hit, who = self.cached(token, now)
        if hit or self.sessions is None:
            return who
        d = self.digest(token)
        with self.sessions() as s:
            row = s.scalar(select(ApiToken).where(ApiToken.digest == d))
        if row is None or row.revoked_at is not None:
            entry = _Cached(None, None, now)
        else:
            entry = _Cached(Principal(row.owner, is_admin=row.is_admin and row.job_id is None,
                                      job_id=None if row.job_id is None else str(row.job_id)), row.expires_at, now)
        with self._lock:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()  # bounded: random bad tokens cannot grow memory
            self._cache[d] = entry
        if entry.expires_at is not None and now >= entry.expires_at:
            return None
        return entry.principal

    def is_metrics_token(self, token: str) -> bool:
        return self._metrics_digest is not None and hmac.compare_digest(self.digest(token), self._metrics_digest)

    # ---------------------------------------------------------------- administration

    def _require_db(self) -> sessionmaker:
        if self.sessions is None:
            raise ServiceError("this token store has no database")
        return self.sessions

    def create(self, owner: str, *, is_admin: bool = False, expires_at: float | None = None, label: str = "",
               now: float | None = None, job_id: int | None = None) -> tuple[TokenRecord, str]:
        """A new random token for `owner`; the plain token is returned once and never stored.
        With `job_id` it is that job's report token: it may post the job's step reports only."""
        check_tenant(owner)
        if job_id is not None and is_admin:
            raise ServiceError("a job's report token cannot be an admin token", field="is_admin")
        now = time.time() if now is None else now
        if expires_at is not None and expires_at <= now:
            raise ServiceError("expires_at is in the past; give a future time or expires_in_s > 0", field="expires_at")
        token = "silod_" + secrets.token_urlsafe(32)
        with self._require_db().begin() as s:
            row = ApiToken(digest=self.digest(token), owner=owner, is_admin=is_admin, label=label[:128], source="api",
                           created_at=now, expires_at=expires_at, revoked_at=None, job_id=job_id)
            s.add(row)
            s.flush()
            return _record(row), token

    def revoke(self, token_id: int, now: float | None = None) -> TokenRecord:
        now = time.time() if now is None else now
        with self._require_db().begin() as s:
            row = s.get(ApiToken, token_id)
            if row is None:
                raise NotFoundError(f"no token with id {token_id}", field="token_id")
            if row.revoked_at is None:
                row.revoked_at = now
            with self._lock:
                self._cache.pop(row.digest, None)
            return _record(row)

    def mint_job_token(self, owner: str, job_id: str, ttl_s: float, now: float | None = None) -> str:
        """The report token of one start of job `job_id` (owned by `owner`): it may post that
        job's step reports (POST /v1/jobs/{id}/report) and nothing else, and expires after
        `ttl_s`. The job's earlier report tokens are revoked (one live token per job: the pods
        or program of an earlier start are gone); all are revoked when the job ends
        (catalogue.revoke_job_tokens). The local backend hands it to the job's program as
        SILOD_TOKEN, the Kubernetes backend to its pods through a Secret."""
        now = time.time() if now is None else now
        pk = int(job_id)
        with self._require_db().begin() as s:
            revoke_job_tokens(s, pk, now)
        _record, token = self.create(owner, expires_at=now + ttl_s, label=f"job {job_id} report", now=now, job_id=pk)
        return token

    def list(self) -> list[TokenRecord]:
        with self._require_db()() as s:
            return [_record(r) for r in s.scalars(select(ApiToken).order_by(ApiToken.id))]

    def import_file(self, path: Path, now: float | None = None) -> int:
        """Tokens from a `tenant:token` file into the database. A token already known (also a
        revoked one) is left as it is, so a restart does not bring a revoked token back."""
        entries = parse_tokens_file(path)
        now = time.time() if now is None else now
        added = 0
        sessions = self._require_db()
        for owner, token in entries:
            d = self.digest(token)
            if self._admin_digest is not None and d == self._admin_digest:
                raise UserError(f"{path}: a user token equals {ADMIN_TOKEN_ENV}; give the admin its own token")
            try:
                with sessions.begin() as s:
                    known = s.scalar(select(ApiToken.owner).where(ApiToken.digest == d))
                    if known is not None:
                        if known != owner:
                            raise UserError(f"{path}: the token of {owner!r} is already the token of {known!r}")
                        continue
                    s.add(ApiToken(digest=d, owner=owner, is_admin=False, label="tokens file", source="file",
                                   created_at=now, expires_at=None, revoked_at=None))
                    added += 1
            except IntegrityError:  # another worker imported it at the same moment
                continue
        return added


def revoke_job_tokens(s: Any, job_pk: int, now: float) -> int:
    """Revoke, in session `s`, every live report token of job `job_pk` (the job ended, or a new
    start minted its successor). Other processes' caches forget them within their TTL (2 s)."""
    from sqlalchemy import update

    result = s.execute(update(ApiToken).where(ApiToken.job_id == job_pk, ApiToken.revoked_at.is_(None))
                       .values(revoked_at=now))
    return int(result.rowcount or 0)


def _record(r: ApiToken) -> TokenRecord:
    return TokenRecord(r.id, r.owner, bool(r.is_admin), r.label, r.source, r.created_at, r.expires_at, r.revoked_at)


def parse_tokens_file(path: Path) -> list[tuple[str, str]]:
    """(tenant, token) pairs from a `tenant:token` file; errors name the file and line."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is not part of the first user
    except OSError as exc:
        raise UserError(f"cannot read tokens file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise UserError(f"tokens file {path} is not UTF-8 text; write one 'user:token' per line") from None
    out: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, token = line.partition(":")
        user, token = user.strip(), token.strip()
        where = f"{path}:{lineno}"
        if not sep or not user or not token:
            raise UserError(f"{where}: expected 'user:token'")
        if not TENANT_RE.match(user) or ".." in user:
            raise UserError(f"{where}: user name {user!r} may use letters, digits, '.', '_', '-' (max 64)")
        if user.lower() == ADMIN:
            raise UserError(f"{where}: {user!r}: 'admin' (in any case) is reserved for the {ADMIN_TOKEN_ENV} token")
        if len(token) < MIN_TOKEN_LEN:
            raise UserError(f"{where}: the token of {user!r} is shorter than {MIN_TOKEN_LEN} characters")
        if token in seen:
            raise UserError(f"{where}: the token of {user!r} is already used by {seen[token]!r}")
        seen[token] = user
        out.append((user, token))
    return out


__all__ = [
    "ADMIN_TOKEN_ENV", "METRICS_TOKEN_ENV", "TOKEN_KEY_ENV", "TokenRecord", "TokenStore",
    "check_tenant", "load_token_key", "parse_tokens_file", "revoke_job_tokens",
]
