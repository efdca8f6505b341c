"""deploy/base/secret.yaml's placeholders: every silod process that reads one refuses to start,
naming the Secret key and the command that generates a real value (contract/placeholders.py).
Before, silod accepted the public admin token, HMAC key and Fernet key without a word."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from contract.placeholders import SECRET, SECRET_ENV, is_placeholder

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _placeholders() -> dict[str, str]:
    doc = next(d for d in yaml.safe_load_all((DEPLOY / "base" / "secret.yaml").read_text()) if d)
    assert doc["metadata"]["name"] == SECRET
    return dict(doc["stringData"])


def _secret_refs() -> list[tuple[str, str, str]]:
    """(container, env var, Secret key) of every secretKeyRef to silod-secrets in deploy/base."""
    out = []
    for f in sorted((DEPLOY / "base").glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            spec = ((d or {}).get("spec") or {}).get("template", {}).get("spec") or {}
            for c in spec.get("containers", []):
                for e in c.get("env", []):
                    ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                    if ref and ref["name"] == SECRET:
                        out.append((c["name"], e["name"], ref["key"]))
    return out


def test_every_placeholder_is_recognised_and_every_secret_variable_is_checked():
    values = _placeholders()
    assert all(is_placeholder(v) for v in values.values()), values
    refs = _secret_refs()
    assert refs
    for container, var, key in refs:
        assert SECRET_ENV.get(var) == key, (container, var, key)
    from cryptography.fernet import Fernet

    assert not is_placeholder(Fernet.generate_key().decode()) and not is_placeholder(os.urandom(24).hex())


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


SERVE = ["serve", "--gpus", "8", "--cache", "1TB", "--remote-io", "1GB/s"]


def _run(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    """The command, otherwise well-formed, must exit with the error; one still running after
    60 s started with the placeholder (and is stopped)."""
    base = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "scheduler", *args], env={**base, **env}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{args[0]} started with a placeholder secret: {err[-500:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("var", ["SILOD_ADMIN_TOKEN", "SILOD_TOKEN_KEY", "SILOD_SECRET_KEYS", "SILOD_DM_TOKEN"])
def test_silod_serve_refuses_each_placeholder_naming_its_key(var, tmp_path):
    values = _placeholders()
    key = SECRET_ENV[var]
    env = {"SILOD_ADMIN_TOKEN": os.urandom(16).hex(), var: values[key]}  # otherwise a valid start
    r = _run([*SERVE, "--listen", _free_port(), "--state-dir", str(tmp_path / "s")], env, tmp_path)
    assert r.returncode != 0
    assert f"key {key}" in r.stderr and "deploy/base/secret.yaml" in r.stderr and "create secret generic" in r.stderr, r.stderr
    assert values[key] not in r.stderr  # the error names the key, not the value


def test_silod_serve_refuses_the_placeholder_database_url_and_tokens_file(tmp_path):
    values = _placeholders()
    r = _run([*SERVE, "--listen", _free_port(), "--db", values["database-url"], "--state-dir", str(tmp_path / "s")], {},
             tmp_path)
    assert r.returncode != 0 and "key database-url" in r.stderr, r.stderr
    tokens = tmp_path / "tokens"
    tokens.write_text(values["tokens"])
    r = _run([*SERVE, "--listen", _free_port(), "--tokens", str(tokens), "--state-dir", str(tmp_path / "s")], {},
             tmp_path)
    assert r.returncode != 0 and "key tokens" in r.stderr and "--tokens" in r.stderr, r.stderr


def test_the_data_manager_the_agent_and_the_csi_controller_refuse_placeholders(tmp_path):
    values = _placeholders()
    r = _run(["datamanager", "--listen", _free_port(), "--state", str(tmp_path / "dm")],
             {"SILOD_DM_SCHEDULER_TOKEN": values["dm-scheduler-token"]}, tmp_path)
    assert r.returncode != 0 and "key dm-scheduler-token" in r.stderr, r.stderr
    for cmd in (["csi-controller", "--socket", str(tmp_path / "c.sock")],
                ["agent", "--node", "n1", "--socket", str(tmp_path / "a.sock"), "--state-dir", str(tmp_path / "a")]):
        r = _run([*cmd, "--scheduler", "http://127.0.0.1:9"], {"SILOD_AGENT_TOKEN": values["agent-token"]}, tmp_path)
        assert r.returncode != 0 and "key agent-token" in r.stderr, (cmd, r.stderr)
        assert not (tmp_path / "c.sock").exists() and not (tmp_path / "a.sock").exists()
