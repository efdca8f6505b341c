"""Bearer-token authentication.

The admin token comes from the environment (SILOD_ADMIN_TOKEN), never from a file in the
repository; user tokens come from a file given with `--tokens FILE`, one `user:token` per line:

    # comments and blank lines are ignored
    alice:3f9c0a8e5b7d41c2
    bob:b7e2d5a1c9f04e38

Tokens are kept as SHA-256 digests and looked up by digest, so a lookup does not compare the
presented token character by character against the stored ones.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from estimator.errors import UserError
from scheduler.service import ADMIN, Principal

ADMIN_TOKEN_ENV = "SILOD_ADMIN_TOKEN"
MIN_TOKEN_LEN = 8
_USER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class TokenStore:
    admin_digest: str | None = None
    users: dict[str, str] = field(default_factory=dict)  # digest -> user name

    @classmethod
    def load(cls, admin_token: str | None, tokens_file: Path | None) -> TokenStore:
        store = cls()
        if admin_token:
            if len(admin_token) < MIN_TOKEN_LEN:
                raise UserError(f"{ADMIN_TOKEN_ENV} is shorter than {MIN_TOKEN_LEN} characters; use a long random token")
            store.admin_digest = _digest(admin_token)
        if tokens_file is not None:
            store.users = parse_tokens_file(tokens_file)
            if store.admin_digest in store.users:
                raise UserError(f"{tokens_file}: a user token equals {ADMIN_TOKEN_ENV}; give the admin its own token")
        if store.admin_digest is None and not store.users:
            raise UserError(f"no API tokens: set {ADMIN_TOKEN_ENV} and/or pass --tokens FILE (lines 'user:token')")
        return store

    def authenticate(self, token: str) -> Principal | None:
        d = _digest(token)
        if self.admin_digest is not None and d == self.admin_digest:
            return Principal(ADMIN, is_admin=True)
        user = self.users.get(d)
        return Principal(user) if user is not None else None


def parse_tokens_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read tokens file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise UserError(f"tokens file {path} is not UTF-8 text; write one 'user:token' per line") from None
    users: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, token = line.partition(":")
        user, token = user.strip(), token.strip()
        where = f"{path}:{lineno}"
        if not sep or not user or not token:
            raise UserError(f"{where}: expected 'user:token'")
        if not _USER_RE.match(user):
            raise UserError(f"{where}: user name {user!r} may use letters, digits, '.', '_', '-' (max 64)")
        if user == ADMIN:
            raise UserError(f"{where}: 'admin' is reserved for the {ADMIN_TOKEN_ENV} token")
        if len(token) < MIN_TOKEN_LEN:
            raise UserError(f"{where}: the token of {user!r} is shorter than {MIN_TOKEN_LEN} characters")
        d = _digest(token)
        if d in users:
            raise UserError(f"{where}: the token of {user!r} is already used by {users[d]!r}")
        users[d] = user
    return users
