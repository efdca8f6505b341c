"""A check of a listening address made before a server starts.

uvicorn reports a port in use as a logged `[Errno 98] error while attempting to bind` and exits
with code 3, after the service has already started its other processes. Binding once here,
first, lets the command print one line naming the option, with exit code 2 (bad input).
"""

from __future__ import annotations

import errno
import socket


def listen_problem(host: str, port: int) -> str | None:
    """Why nothing can listen on host:port now (in use, not an address here), or None.
    Bound with SO_REUSEADDR, as uvicorn binds, so a port in TIME_WAIT is not reported."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "the port is in use (is another server running?); stop it or choose another port"
        if exc.errno == errno.EACCES:
            return "permission denied (ports below 1024 need root); choose a port above 1023"
        return f"cannot listen there ({exc.strerror or exc}); give an address of this machine"
    return None
