"""`python -m fuse_client mount ...`: the same command as `silod mount`, for slim containers."""

from __future__ import annotations

import sys

import typer

from estimator.errors import UserError


def main() -> None:
    from fuse_client.cli import register

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)
    register(app)

    @app.callback()
    def _root() -> None:
        """silod data plane."""

    try:
        app(standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
