"""A real `silod serve` (subprocess) for the SDK, reporter and PyTorch-job tests, and a tiny
misbehaving HTTP server (a real server on 127.0.0.1 answering 5xx, slowly, or recording what it
got): silod itself cannot be made to fail on cue, and the client's retry and the reporter's
never-fail rules are about exactly those failures."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

SILOD = [sys.executable, "-c", "from scheduler.cli import main; main()"]
ADMIN_TOKEN = "sdk-admin-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update(extra)
    return env


def wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{what} exited: {out}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"{what} did not become healthy at {url}")


class Served:
    """`silod serve` on a free loopback port; `url`, the admin token, tenants' tokens."""

    def __init__(self, tmp: Path, *extra: str, backend: str = "null", tokens: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, admin: str = ADMIN_TOKEN, ready: str = "/healthz",
                 timeout: float = 90.0):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tokens = tokens or {"alice": "alice-sdk-token-0123", "bob": "bob-sdk-token-01234"}
        (tmp / "tokens").write_text("".join(f"{u}:{t}\n" for u, t in self.tokens.items()))
        # "{url}" in an argument is this server's own URL (e.g. --backend-opt api-url={url}).
        extra = tuple(a.replace("{url}", self.url) for a in extra)
        cmd = [*SILOD, "serve", "--listen", f"127.0.0.1:{self.port}", "--db", f"sqlite:///{tmp / 'silod.db'}",
               "--backend", backend, "--tokens", str(tmp / "tokens"), "--state-dir", str(tmp / "state"), *extra]
        if "--gpus" not in extra:
            cmd += ["--gpus", "8", "--gpus-per-node", "4", "--cache", "200GB", "--remote-io", "1GB/s"]
        if "--round" not in extra:
            cmd += ["--round", "1s"]
        self.log = open(tmp / "serve.log", "w")
        # Its own process group: stop() ends the API workers and the scheduling process with it.
        self.proc = subprocess.Popen(cmd, env=clean_env(SILOD_ADMIN_TOKEN=admin, **(env or {})),
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            wait_healthy(f"{self.url}{ready}", self.proc, "silod serve", timeout)
        except AssertionError:
            self.stop()
            raise AssertionError(f"silod serve did not start: {self.log_tail()}") from None

    def log_tail(self, n: int = 3000) -> str:
        return (self.tmp / "serve.log").read_text()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


class Misbehaving:
    """A real HTTP server on 127.0.0.1 whose answers come from `answer(method, path, headers,
    body) -> (status, headers, body, delay_s)`; every request is recorded."""

    def __init__(self, answer: Callable[[str, str, dict, bytes], tuple[int, dict, bytes, float]]):
        self.requests: list[tuple[str, str, dict, bytes]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                outer.requests.append((self.command, self.path, headers, body))
                status, extra, out, delay = answer(self.command, self.path, headers, body)
                if delay:
                    time.sleep(delay)
                try:
                    self.send_response(status)
                    for k, v in {"Content-Type": "application/json", **extra}.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, *_args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def jbody(obj: object) -> bytes:
    return json.dumps(obj).encode()
