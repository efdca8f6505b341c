"""`silod serve` as processes: API workers apart from the one scheduling process, talking
through the database; one leader among several `silod serve` on one database; a killed server's
scheduling process gives the lease up so another takes over. Real processes, real HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import pytest
import sqlalchemy as sa

from scheduler.service import control
from scheduler.service.db import open_database
from scheduler.service.db.models import Lease

from dataplane_helpers import silod_cmd  # noqa: I001 - sibling test helper

ADMIN = "admin-token-procs-0123"
H = {"Authorization": f"Bearer {ADMIN}"}
IMAGENET = {"name": "imagenet", "uri": "s3://datasets/imagenet", "size": "143GB"}
JOB = {"name": "j", "gpus": 1, "dataset": "imagenet", "epochs": 1, "ideal_throughput": "100MB/s"}


def test_leader_lease(tmp_path) -> None:
    engine = open_database(f"sqlite:///{tmp_path / 'l.db'}")
    sessions = sa.orm.sessionmaker(engine)
    try:
        assert control.try_lead(sessions, "a", 10, now=100.0)
        assert not control.try_lead(sessions, "b", 10, now=105.0)  # a's lease runs until 110
        assert control.try_lead(sessions, "a", 10, now=108.0)  # renewed until 118
        assert not control.try_lead(sessions, "b", 10, now=115.0)
        assert control.try_lead(sessions, "b", 10, now=119.0)  # a stopped renewing
        control.release_lead(sessions, "a")  # not a's any more: no effect
        assert not control.try_lead(sessions, "a", 10, now=120.0)
        control.release_lead(sessions, "b")
        assert control.try_lead(sessions, "a", 10, now=121.0)
    finally:
        engine.dispose()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path, port: int, workers: int) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    log = open(tmp_path / f"serve-{port}.log", "ab")
    return subprocess.Popen(
        [*silod_cmd(), "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path / 'p.db'}",
         "--backend", "null", "--gpus", "8", "--gpus-per-node", "4", "--cache", "200GB", "--remote-io", "1GB/s",
         "--round", "360", "--workers", str(workers), "--state-dir", str(tmp_path / "state"), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SILOD_ADMIN_TOKEN": ADMIN}, start_new_session=True,
    )


def _wait_up(url: str, proc: subprocess.Popen, tmp_path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, "silod serve exited"
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail("silod serve did not come up")


def _holder(tmp_path) -> str | None:  # type: ignore[no-untyped-def]
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        with engine.connect() as c:
            return c.execute(sa.select(Lease.holder)).scalar()
    finally:
        engine.dispose()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_api_workers_and_one_scheduling_leader(tmp_path) -> None:
    p1, p2 = _port(), _port()
    a = _serve(tmp_path, p1, workers=2)
    b = None
    try:
        url = f"http://127.0.0.1:{p1}"
        _wait_up(url, a, tmp_path)
        with httpx.Client(base_url=url, headers=H, timeout=60) as c:
            assert c.post("/v1/datasets", json=IMAGENET).status_code == 201
            ids = [c.post("/v1/jobs", json={**JOB, "name": f"j{i}"}).json()["id"] for i in range(10)]
            # A forced round is run by the scheduling process and its summary comes back.
            r = c.post("/v1/rounds")
            assert r.status_code == 200, r.text
            # fifo, 8 GPUs: the first 8 (jobs an earlier, activity-triggered round started come
            # first in the summary, so compare the set)
            assert sorted(r.json()["running"], key=int) == ids[:8]
            # Any worker serves any request; the policy reaches the scheduling process.
            assert c.put("/v1/policy", json={"name": "sjf"}).json()["name"] == "sjf"
            assert all(c.get("/v1/policy").json()["name"] == "sjf" for _ in range(6))
            cluster = c.get("/v1/cluster").json()
            assert cluster["backend"] == "null" and len(cluster["nodes"]) == 2 and cluster["gpus"]["used"] == 8
            # The scheduling process notices a cancel made through an API worker by itself.
            c.delete(f"/v1/jobs/{ids[0]}")
            deadline = time.time() + 20
            while c.get(f"/v1/jobs/{ids[8]}").json()["state"] != "running":
                assert time.time() < deadline, "no round after the cancel"
                time.sleep(0.3)
        leader = _holder(tmp_path)
        assert leader is not None
        # A second server on the same database serves requests but does not schedule.
        b = _serve(tmp_path, p2, workers=1)
        _wait_up(f"http://127.0.0.1:{p2}", b, tmp_path)
        time.sleep(3)
        assert _holder(tmp_path) == leader
        assert len(httpx.get(f"http://127.0.0.1:{p2}/v1/jobs", headers=H).json()) == 10
        # kill -9 of the first server: its scheduling process notices and gives the lease up;
        # the second server's takes over without waiting for the lease to expire.
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        deadline = time.time() + 12
        while _holder(tmp_path) in (leader, None):
            assert time.time() < deadline, "no new leader after the first server was killed"
            time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{p2}/v1/rounds", headers=H, timeout=60)
        assert r.status_code == 200 and r.json()["active"] == 9
    finally:
        for proc in (a, b):
            if proc is not None:
                _stop(proc)


def _self_signed(tmp_path):  # type: ignore[no-untyped-def]
    """A throwaway certificate for 127.0.0.1 (cryptography comes with the test extras via moto)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return tmp_path / "cert.pem", tmp_path / "key.pem"


@pytest.mark.slow
def test_serve_over_tls(tmp_path) -> None:
    import ssl

    cert, key = _self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    port = _port()
    proc = subprocess.Popen(
        [*silod_cmd(), "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path / 't.db'}",
         "--backend", "null", "--gpus", "8", "--cache", "1TB", "--remote-io", "1GB/s", "--state-dir", str(tmp_path / "s"),
         "--tls-cert", str(cert), "--tls-key", str(key), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "SILOD_ADMIN_TOKEN": ADMIN},
        start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, "silod serve --tls-cert did not come up"
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/v1/jobs", headers=H, verify=trust, timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert r.status_code == 200 and r.json() == []
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        _stop(proc)
    r = subprocess.run([*silod_cmd(), "serve", "--tls-cert", str(cert), "--db", f"sqlite:///{tmp_path / 'u.db'}",
                        "--backend", "null", "--gpus", "8", "--cache", "1TB", "--remote-io", "1GB/s"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "SILOD_ADMIN_TOKEN": ADMIN})
    assert r.returncode == 2 and "--tls-key" in r.stderr
