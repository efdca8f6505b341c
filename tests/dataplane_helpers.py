"""Helpers for the data-plane tests: datasets in tmp dirs, real mounts, real servers.

Every mount is a real `silod mount` process; the fixture always unmounts (fusermount3 -u, then
lazy) and kills the process, so a failing test never leaves a mount behind. Under CI=true a
missing /dev/fuse fails the test instead of skipping it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_SILOD_SCRIPT = Path(sys.executable).parent / "silod"


def silod_cmd() -> list[str]:
    """The real `silod` console script of this venv (falls back to the same entry point)."""
    if _SILOD_SCRIPT.exists():
        return [str(_SILOD_SCRIPT)]
    return [sys.executable, "-c", "from scheduler.cli import main; main()"]


def require_fuse() -> None:
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse is missing")
    if shutil.which("fusermount3") is None:
        problems.append("fusermount3 is not installed (apt-get install fuse3)")
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        problems.append("/dev/fuse is not accessible")
    if problems:
        msg = "real FUSE mounts unavailable: " + "; ".join(problems)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- datasets ----------------------------------------------------------------------------------


@dataclass
class Dataset:
    root: Path
    sizes: dict[str, int]
    digests: dict[str, str]

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def make_dataset(root: Path, n_files: int = 200, min_size: int = 8_000, max_size: int = 32_000, seed: int = 0, subdirs: int = 4) -> Dataset:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    sizes, digests = {}, {}
    for i in range(n_files):
        rel = f"class{i % subdirs}/item{i:05d}.bin"
        data = rng.randbytes(rng.randint(min_size, max_size))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        sizes[rel] = len(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return Dataset(root, sizes, digests)


def read_epoch(mnt: Path, ds: Dataset, seed: int, verify: bool = True) -> None:
    """Read every item once in a random order, as a training epoch does; check the content."""
    order = sorted(ds.sizes)
    random.Random(seed).shuffle(order)
    for rel in order:
        data = (mnt / rel).read_bytes()
        if verify:
            assert len(data) == ds.sizes[rel], rel
            assert hashlib.sha256(data).hexdigest() == ds.digests[rel], f"content of {rel} differs"


# -- mounts ------------------------------------------------------------------------------------


def force_unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-u", str(path)], ["fusermount3", "-u", "-z", str(path)], ["umount", "-l", str(path)]):
        if not os.path.ismount(path):
            return
        subprocess.run(cmd, capture_output=True, timeout=10)


@dataclass
class Mount:
    mountpoint: Path
    stats_file: Path
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    def stats(self) -> dict:
        return json.loads(self.stats_file.read_text())

    def fresh_stats(self, timeout: float = 3.0) -> dict:
        """Stats written after this call (the file is rewritten every 0.5 s)."""
        t0 = time.time()
        deadline = t0 + timeout
        while time.time() < deadline:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                s = self.stats()
                if s["updated_at"] > t0 + 0.05:
                    return s
            time.sleep(0.05)
        raise AssertionError(f"stats file {self.stats_file} not rewritten within {timeout}s")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        force_unmount(self.mountpoint)
        return self.proc.returncode


def start_mount(
    mountpoint: Path, source: str, dataset: str, job: str, cache_dir: Path, *extra: str,
    stats_file: Path | None = None, env: dict | None = None, timeout: float = 30.0,
) -> Mount:
    require_fuse()
    mountpoint.mkdir(parents=True, exist_ok=True)
    stats_file = stats_file or mountpoint.parent / f"{mountpoint.name}.stats.json"
    log_path = mountpoint.parent / f"{mountpoint.name}.log"
    args = [*silod_cmd(), "mount", str(mountpoint), "--source", source, "--dataset", dataset, "--job", job,
            "--cache-dir", str(cache_dir), "--stats-file", str(stats_file), *extra]
    log_file = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    m = Mount(mountpoint, stats_file, proc, log_path, args)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"silod mount exited with {proc.returncode}:\n{m.log()}")
        if os.path.ismount(mountpoint) and stats_file.exists():
            return m
        time.sleep(0.05)
    m.stop()
    raise AssertionError(f"mount not ready after {timeout}s:\n{m.log()}")


@contextlib.contextmanager
def mounted(*args, **kwargs):
    m = start_mount(*args, **kwargs)
    try:
        yield m
    finally:
        m.stop()


def item_files(cache_dir: Path, dataset: str) -> list[Path]:
    return [p for p in (cache_dir / dataset / "items").glob("*/*") if p.is_file()]


# -- servers -----------------------------------------------------------------------------------


@dataclass
class DataManagerProcess:
    url: str
    state_dir: Path
    port: int
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    env: dict | None = None  # added to this environment (e.g. SILOD_DM_AGENT_TOKENS_FILE)

    def start(self, timeout: float = 20.0) -> "DataManagerProcess":
        import httpx

        self.log_path = self.state_dir.parent / f"datamanager-{self.port}.log"
        log_file = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [*silod_cmd(), "datamanager", "--listen", f"127.0.0.1:{self.port}", "--state", str(self.state_dir)],
            stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})},
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"data manager exited with {self.proc.returncode}: {self.log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=0.5).status_code == 200:
                    return self
            time.sleep(0.1)
        raise AssertionError("data manager did not become healthy")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)


def start_datamanager(state_dir: Path, env: dict | None = None) -> DataManagerProcess:
    port = free_port()
    return DataManagerProcess(url=f"http://127.0.0.1:{port}", state_dir=state_dir, port=port, env=env).start()


def wait_until(predicate, timeout: float, interval: float = 0.05, message: str = "condition"):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{message} not reached within {timeout}s (last value {last!r})")
