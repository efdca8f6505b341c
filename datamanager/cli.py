"""`silod datamanager --listen HOST:PORT --state DIR`: registered on the shared typer app."""

from __future__ import annotations

from pathlib import Path

import typer

from estimator.errors import UserError
from contract.log_level import parse_log_level


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--listen {text!r} is not HOST:PORT, e.g. 127.0.0.1:7070 or 0.0.0.0:7070")
    return host.strip("[]"), int(port)


def register(app: typer.Typer) -> None:
    @app.command("datamanager")
    def datamanager(
        listen: str = typer.Option("127.0.0.1:7070", "--listen", help="HOST:PORT to serve the API on."),
        state: Path = typer.Option(..., "--state", help="Directory for persisted allocations (state.json)."),
        log_level: str = typer.Option("warning", "--log-level"),
    ) -> None:
        """Run the data manager: cache/remote-IO allocation API for FUSE clients (SiloD Table 3)."""
        log_level = parse_log_level(log_level)
        from contract.placeholders import refuse_placeholders

        refuse_placeholders()
        host, port = parse_listen(listen)
        from http_guard.listen import listen_problem

        problem = listen_problem(host, port)
        if problem:
            raise UserError(f"--listen {listen}: {problem}")
        if state.exists() and not state.is_dir():
            raise UserError(f"--state {str(state)!r} is a file; give a directory (state.json is written inside it)")
        try:
            state.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--state {str(state)!r} cannot be created: {exc.strerror}") from exc
        if not state.is_dir():
            raise UserError(f"--state {str(state)!r} is not a directory")
        state_file = state / "state.json"
        if state_file.exists() and not state_file.is_file():
            kind = "a directory" if state_file.is_dir() else "not a regular file"
            raise UserError(f"--state {str(state)!r}: {str(state_file)!r} is {kind}; it must be a file (the data "
                            "manager's saved allocations): remove or rename it, or pass another --state")
        import ipaddress

        import uvicorn

        from datamanager.app import create_app
        from datamanager.auth import AGENT_SA_ENV, AGENT_TOKEN_ENV, AGENT_TOKENS_FILE_ENV, SCHEDULER_TOKEN_ENV, DataManagerAuth

        try:
            auth = DataManagerAuth.from_env()
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        if not auth.enabled:
            try:
                loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise UserError(
                    f"--listen {listen}: without {SCHEDULER_TOKEN_ENV} and {AGENT_TOKEN_ENV} the data manager is "
                    "unauthenticated and may only listen on a loopback address; set both tokens to listen elsewhere"
                )
        try:
            app_ = create_app(state, auth)
        except ValueError as exc:  # a corrupt state.json: say so instead of a traceback
            raise UserError(f"--state {str(state)!r}: state.json cannot be read ({exc})") from exc
        if not auth.enabled:  # after every check, so that an error is the first line on stderr
            typer.echo(f"silod datamanager: no {SCHEDULER_TOKEN_ENV}/{AGENT_TOKEN_ENV}: unauthenticated, loopback only", err=True)
        elif auth.agent_digest is not None:
            # Still accepted (the local backend's mounts use it), but its holder may act on every
            # node's clients and report figures for any of them (issue 20, finding 1).
            typer.echo(f"silod datamanager: warning: {AGENT_TOKEN_ENV} is one token for every node; whoever holds it may act "
                       f"on any node's mounts. Give each node its own ({AGENT_TOKENS_FILE_ENV}) or use the agent pods' "
                       f"service-account tokens ({AGENT_SA_ENV})", err=True)
        from http_guard.timeouts import HeaderTimeoutH11Protocol

        # h11 with a header read timeout: slow-header clients are cut off (http_guard/timeouts.py)
        uvicorn.run(app_, host=host, port=port, log_level=log_level, http=HeaderTimeoutH11Protocol)
