"""Tenants' secrets at rest: sealed with a server key kept outside the database.

A credential's secret (`POST /v1/credentials`) is stored as `fernet:` + a Fernet token
(AES-128-CBC + HMAC-SHA256, the `cryptography` package) under the service's current key; the
database, its WAL and its backups then hold no usable secret (issue 20: user `nobody` read one
from the world-readable `-wal` file). Only the scheduling process opens a secret, to hand it to
the data path of a starting job; no API returns it.

Where the keys come from, in order:
- `SILOD_SECRET_KEYS`: comma-separated Fernet keys (e.g. from a Kubernetes Secret), the first
  current, the others still accepted for opening;
- else `STATE_DIR/secret.keys`: one key per line, the first current; created 0600 with a fresh
  key when missing (every process of one `silod serve` shares it).

Rotation (docs/service.md "Secrets at rest"): `silod secrets rotate` puts a new key first in the
file and re-seals every stored secret with it (MultiFernet.rotate); the old keys stay accepted
until `silod secrets rotate --retire` (after every process was restarted) drops them. With
SILOD_SECRET_KEYS, put the new key first yourself, restart, then `silod secrets reseal`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import sessionmaker

from estimator.errors import UserError

SECRET_KEYS_ENV = "SILOD_SECRET_KEYS"
KEY_FILE = "secret.keys"
PREFIX = "fernet:"


class SecretUnavailable(Exception):
    """A stored secret none of the server's keys opens (a key was retired too early, or the
    keys are not this database's)."""


class SecretBox:
    def __init__(self, keys: Sequence[bytes], source: str = "keys"):
        if not keys:
            raise UserError(f"no secret key in {source}; give at least one (Fernet.generate_key())")
        try:
            self._fernets = [Fernet(k) for k in keys]
        except (ValueError, TypeError):
            raise UserError(f"{source} holds a key that is not a Fernet key (32 url-safe base64 bytes; make one with"
                            " `python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'`)") from None
        self._multi = MultiFernet(self._fernets)
        self.keys = tuple(keys)
        self.source = source

    @staticmethod
    def is_sealed(stored: str) -> bool:
        return stored.startswith(PREFIX)

    def seal(self, secret: str) -> str:
        return PREFIX + self._multi.encrypt(secret.encode("utf-8")).decode("ascii")

    def open(self, stored: str) -> str:
        """The secret. A value stored before sealing existed (no prefix) is returned as it is:
        `seal_plaintext` seals such rows when the service starts."""
        if not self.is_sealed(stored):
            return stored
        try:
            return self._multi.decrypt(stored[len(PREFIX):].encode("ascii")).decode("utf-8")
        except InvalidToken:
            raise SecretUnavailable(f"a stored secret opens with none of the keys in {self.source}") from None

    def reseal(self, stored: str) -> str:
        """`stored` sealed under the current (first) key."""
        if not self.is_sealed(stored):
            return self.seal(stored)
        try:
            return PREFIX + self._multi.rotate(stored[len(PREFIX):].encode("ascii")).decode("ascii")
        except InvalidToken:
            raise SecretUnavailable(f"a stored secret opens with none of the keys in {self.source}") from None


def _parse_keys(text: str, sep: str = "\n") -> list[bytes]:
    """Keys one per line (the file; `#` starts a comment line) or comma-separated (the env)."""
    return [k.strip().encode("ascii", "replace") for k in text.split(sep) if k.strip() and not k.strip().startswith("#")]


def _write_keys(path: Path, keys: Sequence[bytes]) -> None:
    """Atomically: a 0600 temporary file in the same directory, renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=".secret.keys.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# silod secret keys: the first seals, all open (docs/service.md, Secrets at rest)\n")
            f.write("".join(k.decode("ascii") + "\n" for k in keys))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def key_file(state_dir: Path) -> Path:
    return Path(state_dir) / KEY_FILE


def load_secret_box(state_dir: Path | None) -> SecretBox:
    env = os.environ.get(SECRET_KEYS_ENV, "").strip()
    if env:
        return SecretBox(_parse_keys(env, ","), SECRET_KEYS_ENV)
    if state_dir is None:
        raise UserError(f"no secret key: set {SECRET_KEYS_ENV} or give a state directory for {KEY_FILE}")
    path = key_file(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        # Written whole into a 0600 temporary file, then linked into place: a process starting
        # at the same moment reads either no file or the whole key, never an empty one, and
        # only one key wins (link fails when the name exists).
        fd, tmp = tempfile.mkstemp(prefix=".secret.keys.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write("# silod secret keys: the first seals, all open (docs/service.md, Secrets at rest)\n")
                f.write(Fernet.generate_key().decode("ascii") + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            Path(tmp).unlink(missing_ok=True)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"secret key file {path} cannot be read ({exc.strerror})") from None
    return SecretBox(_parse_keys(text), str(path))


def seal_plaintext(engine: Engine, box: SecretBox) -> int:
    """Seal the secrets stored before sealing existed (the migration of existing rows); run when
    the service starts, idempotent. Returns how many rows it sealed."""
    return _reseal(engine, box, only_plain=True)


def reseal_all(engine: Engine, box: SecretBox) -> int:
    """Every stored secret sealed under the box's current key (after a rotation)."""
    return _reseal(engine, box, only_plain=False)


def _reseal(engine: Engine, box: SecretBox, only_plain: bool) -> int:
    from scheduler.service.db.models import Credential

    sessions = sessionmaker(engine)
    n = 0
    with sessions.begin() as s:
        for cid, stored in s.execute(select(Credential.id, Credential.secret_access_key)).all():
            if only_plain and box.is_sealed(stored):
                continue
            s.execute(update(Credential).where(Credential.id == cid).values(secret_access_key=box.reseal(stored)))
            n += 1
    return n


def rotate_key_file(state_dir: Path, retire: bool) -> SecretBox:
    """A new current key first in STATE_DIR/secret.keys (the old ones kept), or with `retire`
    only the current key kept. Returns the new box."""
    if os.environ.get(SECRET_KEYS_ENV, "").strip():
        raise UserError(f"the keys come from {SECRET_KEYS_ENV}: put the new key first there, restart, then run"
                        " `silod secrets reseal`")
    old = load_secret_box(state_dir)
    keys = [old.keys[0]] if retire else [Fernet.generate_key(), *old.keys]
    _write_keys(key_file(state_dir), keys)
    return SecretBox(keys, str(key_file(state_dir)))
