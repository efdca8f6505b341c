"""Run an ASGI app on a real uvicorn server in a background thread (integration tests,
benchmarks). The socket is bound before the server starts, so the port is known and cannot be
taken by someone else in between."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any


class ServerThread:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 header_timeout_s: float | None = None):
        import uvicorn

        from http_guard.timeouts import HeaderTimeoutH11Protocol, header_timeout_protocol

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        http = HeaderTimeoutH11Protocol if header_timeout_s is None else header_timeout_protocol(header_timeout_s)
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", backlog=2048, http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
