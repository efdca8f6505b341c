"""The `silod` command. Each subsystem registers its own commands; this module only wires them.

Commands import their heavy dependencies (FUSE, FastAPI, cvxpy) lazily, so `silod --help` and
`silod simulate` stay fast and work without the data-plane libraries loaded.
"""

from __future__ import annotations

import sys

import typer

from estimator.errors import UserError

app = typer.Typer(
    name="silod",
    help="SiloD: co-scheduling GPUs, dataset cache and remote IO for deep-learning clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from scheduler import cli_sim

    cli_sim.register(app)
    for module_name in ("fuse_client.cli", "datamanager.cli", "scheduler.service_cli", "scheduler.demo",
                        "fuse_client.agent.cli"):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(app)


_register_all()


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2, never a traceback."""
    try:
        app(standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # click usage errors arrive here in standalone_mode=False
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise
