"""Issue 20 item 8 (a faster API path): what made requests slow, each checked without timing."""

from __future__ import annotations

import socket

from fastapi import FastAPI

from scheduler.service.api.server import ServerThread


def test_accepted_connections_have_nagle_off() -> None:
    """A listening socket made with socket.socket(AF_INET) (uvicorn's for --workers N, and
    ServerThread's) has proto 0, so asyncio left Nagle on for the connections it accepted: h11
    writes a response's head and body separately, and the body waited for the client's delayed
    ACK (~40 ms on Linux) on every request. The protocol turns Nagle off itself."""
    app = FastAPI()

    @app.get("/x")
    def x() -> dict:
        return {"ok": True}

    with ServerThread(app) as server:
        assert server.sock.proto == 0  # the case asyncio does not cover
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as c:
            c.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while not data.endswith(b'{"ok":true}'):
                chunk = c.recv(65536)
                assert chunk, data
                data += chunk
            connections = list(server.server.server_state.connections)
            assert len(connections) == 1
            sock = connections[0].transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
