"""The data path reads a tenant's dataset only as that tenant, and keeps what it read private:
credentials reach the mount through its environment (never argv, never the cluster's own keys),
cache directories are 0700 and cached files 0600, and the URI allow-list also runs at mount
time with the host resolved."""

from __future__ import annotations

import os
import stat

import pytest

from estimator.errors import UserError
from fuse_client.cache_store import DatasetCache
from contract.credentials import ANONYMOUS_ENV, SourceCredential
from fuse_client.remote import storage_options
from contract.uri_policy import UriPolicy, UriRejected
from scheduler.backends.base import DatasetInfo
from scheduler.backends.local import source_env


def test_cache_directory_and_files_are_private(tmp_path) -> None:
    os.umask(0o022)
    cache = DatasetCache(tmp_path / "cache", "d1-imagenet")
    assert stat.S_IMODE(os.stat(cache.root).st_mode) == 0o700
    fd, path = cache.new_staging_file("k1")
    os.close(fd)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # An existing, too open directory is tightened when the cache opens it again.
    os.chmod(cache.root, 0o755)
    DatasetCache(tmp_path / "cache", "d1-imagenet")
    assert stat.S_IMODE(os.stat(cache.root).st_mode) == 0o700


def test_credentials_reach_the_mount_by_environment_only() -> None:
    cred = SourceCredential("AKIA1", "s3cr3t", "https://s3.example.com", "eu-west-1")
    assert "s3cr3t" not in repr(cred)
    env = source_env(DatasetInfo("d1-x", "s3://b/x", 1e9, credential=cred))
    assert env["SILOD_SOURCE_SECRET_ACCESS_KEY"] == "s3cr3t" and ANONYMOUS_ENV not in env
    assert SourceCredential.from_env(env) == cred
    opts = storage_options("s3://b/x", SourceCredential.from_env(env))
    assert opts == {"key": "AKIA1", "secret": "s3cr3t",
                    "client_kwargs": {"endpoint_url": "https://s3.example.com", "region_name": "eu-west-1"}}
    # Without a tenant credential: anonymous, and nothing inherited from the service's environment.
    env = source_env(DatasetInfo("d2-x", "s3://b/x", 1e9))
    assert env[ANONYMOUS_ENV] == "1" and all(env[k] == "" for k in env if k != ANONYMOUS_ENV)
    assert SourceCredential.from_env(env) is None
    assert storage_options("s3://b/x", None, anonymous=True) == {"anon": True}


def test_service_secrets_never_reach_a_job(monkeypatch) -> None:
    for name, value in (("SILOD_ADMIN_TOKEN", "admin-secret-1"), ("SILOD_TOKEN_KEY", "hmac-key-0123456789"),
                        ("SILOD_DM_TOKEN", "scheduler-dm-token"), ("SILOD_DM_AGENT_TOKEN", "agent-dm-token-x")):
        monkeypatch.setenv(name, value)
    env = source_env(DatasetInfo("d1-x", "s3://b/x", 1e9))
    assert env["SILOD_ADMIN_TOKEN"] == "" and env["SILOD_TOKEN_KEY"] == ""
    assert env["SILOD_DM_TOKEN"] == "agent-dm-token-x"  # the mount may register and heartbeat, nothing more
    assert "scheduler-dm-token" not in env.values() and "agent-dm-token-x" not in (env["SILOD_DM_AGENT_TOKEN"],)


def test_mount_time_check_resolves_the_host(monkeypatch) -> None:
    """A name that looked public at registration but resolves to the metadata service (DNS
    rebinding) is refused when the mount resolves it. The resolver is replaced: these machines
    may have no DNS, and the rule, not the network, is under test."""
    import socket

    answers = {"data.example.com": "93.184.216.34", "rebind.example.com": "169.254.169.254", "lo.example.com": "::1"}

    def fake_getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        addr = answers[host]
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (addr, port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    policy = UriPolicy()
    assert policy.check("https://rebind.example.com/x") == "https://rebind.example.com/x"  # no lookup at registration
    assert policy.check("https://data.example.com/x", resolve=True) == "https://data.example.com/x"
    for host, rule in (("rebind.example.com", "link-local"), ("lo.example.com", "loopback")):
        with pytest.raises(UriRejected, match=rule):
            policy.check(f"https://{host}/x", resolve=True)


def test_allow_list_configuration_errors() -> None:
    for bad in (("file",), ("http",), ("s3://bucket",), ("s3:/x/",)):
        with pytest.raises(UserError):
            UriPolicy(bad)
    assert UriPolicy.parse("s3, https://data.example.com/public/").allowed == ("s3", "https://data.example.com/public/")
    assert UriPolicy.parse("").allowed == ("s3", "https")
