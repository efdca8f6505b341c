"""deploy/Dockerfile built for real (Debian's buildah, `.ci/build-image`) and its entry points run
in the built image: `silod --version`, the scheduler's and the data manager's /healthz, the node
agent's and the CSI controller's CSI Identity service (Probe, GetPluginInfo) on their sockets.

No registry is reachable here: `.ci/build-image` makes the Dockerfile's base (debian:bookworm-slim)
with debootstrap and builds offline from a wheelhouse this machine's pip fills. Containers run with
buildah's chroot isolation: the OCI runtime (crun) cannot create containers in this VM ("cgroups
in hybrid mode not supported, drop all controllers from cgroupv2"). Chroot isolation shares the
host's network, so the servers' ports on 127.0.0.1 are reached from here.

The build takes minutes (the whole CI budget allows it; the time is printed). SILOD_TEST_IMAGE=TAG
runs the entry-point checks against an image built before by `.ci/build-image TAG` instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
STORE = Path(os.environ.get("SILOD_IMAGE_STORE", "/var/tmp/silod-image"))
DRIVER = os.environ.get("SILOD_IMAGE_DRIVER", "overlay")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _buildah(*args: str) -> list[str]:
    return ["buildah", "--root", str(STORE / f"storage-{DRIVER}"), "--runroot", str(STORE / f"run-{DRIVER}"),
            "--storage-driver", DRIVER, *args]


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why} (CI=true: the image must be built; .ci/run installs buildah and debootstrap)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    tag = os.environ.get("SILOD_TEST_IMAGE")
    if not tag:
        if os.geteuid() != 0:
            _unavailable("building the image needs root (debootstrap, buildah's mounts)")
        for tool in ("buildah", "debootstrap"):
            if shutil.which(tool) is None:
                _unavailable(f"{tool} is not installed (Debian packages buildah, debootstrap)")
        tag = f"localhost/silod:test-{os.getpid()}"
        t0 = time.monotonic()
        r = subprocess.run([str(REPO / ".ci" / "build-image"), tag], cwd=REPO, capture_output=True, text=True,
                           timeout=2400, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        print(r.stdout[-2000:])
        assert r.returncode == 0, f"deploy/Dockerfile did not build:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        print(f"image built in {time.monotonic() - t0:.0f} s")
        try:
            yield tag
        finally:
            subprocess.run(_buildah("rmi", tag), capture_output=True)
        return
    yield tag


class Container:
    """One `buildah run` of the image (chroot isolation), its process group ended after."""

    def __init__(self, image: str, args: list[str], *, volumes: list[tuple[Path, str]] = (), user: str | None = None,
                 env: dict[str, str] | None = None):
        self.ctr = subprocess.run(_buildah("from", "-q", "--pull=never", image), capture_output=True, text=True,
                                  check=True).stdout.strip()
        cmd = _buildah("run", "--isolation", "chroot")
        for host, inside in volumes:
            cmd += ["-v", f"{host}:{inside}"]
        if user:
            cmd += ["--user", user]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        self.proc = subprocess.Popen([*cmd, self.ctr, "--", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)

    def output(self) -> str:
        return self.proc.stdout.read() if self.proc.stdout else ""

    def stop(self) -> str:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        out = self.output()
        subprocess.run(_buildah("rm", self.ctr), capture_output=True)
        return out


def _run(image: str, args: list[str], **kw) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    c = Container(image, args, **kw)
    try:
        c.proc.wait(300)
    finally:
        out = c.stop()
    return c.proc.returncode, out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(c: Container, url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.proc.poll() is not None:
            raise AssertionError(f"{url}: the process exited ({c.proc.returncode}): {c.stop()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never answered 200: {c.stop()[-3000:]}")


def _csi_identity(sock: Path, timeout: float = 180) -> tuple[str, bool]:
    import grpc

    from fuse_client.agent.csi import csi_pb2 as pb, csi_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    while not sock.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{sock} never appeared")
        time.sleep(0.5)
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = pb_grpc.IdentityStub(ch)
        info = stub.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=30)
        probe = stub.Probe(pb.ProbeRequest(), timeout=30)
    return info.name, probe.ready.value


def test_the_image_runs_silod_version_as_pyproject_says(image):
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    code, out = _run(image, ["silod", "--version"])
    assert code == 0 and out.strip().splitlines()[-1] == f"silod {version}", out
    code, out = _run(image, ["id", "-u"])
    assert out.strip() == "10001", out  # the scheduler, data manager and CSI controller run unprivileged


def test_the_scheduler_and_the_data_manager_in_the_image_become_healthy(image, tmp_path):
    port = _free_port()
    sched = Container(image, ["silod", "serve", "--backend", "local", "--listen", f"127.0.0.1:{port}",
                              "--state-dir", "/tmp/silod-state", "--gpus", "8", "--cache", "1TB", "--remote-io", "1GB/s"],
                      env={"SILOD_ADMIN_TOKEN": os.urandom(16).hex()})
    try:
        _wait_healthy(sched, f"http://127.0.0.1:{port}/healthz")
    finally:
        sched.stop()
    port = _free_port()
    dm = Container(image, ["silod", "datamanager", "--listen", f"127.0.0.1:{port}", "--state", "/tmp/dm"],
                   env={"SILOD_DM_SCHEDULER_TOKEN": os.urandom(16).hex()})
    try:
        _wait_healthy(dm, f"http://127.0.0.1:{port}/healthz")
    finally:
        dm.stop()


def test_the_agent_and_the_csi_controller_in_the_image_answer_csi_identity(image, tmp_path):
    csi = tmp_path / "csi"
    csi.mkdir()
    csi.chmod(0o777)  # the CSI controller runs as the image's user 10001
    (csi / "catalog.yaml").write_text("datasets: [{tenant: t, name: files, uri: 'https://example.com/files/'}]\n")
    ctl = Container(image, ["silod", "csi-controller", "--socket", "/csi/controller.sock", "--datasets",
                            "/csi/catalog.yaml"], volumes=[(csi, "/csi")])
    try:
        assert _csi_identity(csi / "controller.sock") == ("silod.io", True)
    finally:
        ctl.stop()
    agent = Container(image, ["silod", "agent", "--node", "n1", "--socket", "/csi/agent.sock", "--state-dir",
                              "/tmp/agent", "--kubelet-dir", "/tmp/kubelet", "--datasets", "/csi/catalog.yaml",
                              "--report-interval", "0"], volumes=[(csi, "/csi")], user="0")  # as agent.yaml: root
    try:
        assert _csi_identity(csi / "agent.sock") == ("silod.io", True)
    finally:
        agent.stop()
