"""The `silod` command. Each subsystem registers its own commands; this module only wires them
and turns every error into one or two lines a person can act on.

Commands import their heavy dependencies (FUSE, FastAPI, cvxpy) lazily, so `silod --help` and
`silod simulate` stay fast and work without the data-plane libraries loaded.

Exit codes, as kubectl, uv and ruff use them:
  0  success
  1  a runtime failure: the command was right but something outside it failed (a file that
     cannot be written, a server that does not answer, a bug in silod)
  2  a usage error: a missing or bad option, an unknown command, bad input (a trace row, a
     size out of range); the message names the input and the fix
  130 interrupted (Ctrl-C)
No traceback is printed unless `silod --debug ...` or SILOD_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated, NoReturn

import typer

from estimator.errors import RuntimeFailure, UserError

DEBUG_ENV = "SILOD_DEBUG"

app = typer.Typer(
    name="silod",
    help="SiloD: co-scheduling GPUs, dataset cache and remote IO for deep-learning clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def installed_version() -> str:
    """The version pip installed (package metadata, so it is pyproject.toml's and cannot drift)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("silod")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed; pip install -e .)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"silod {installed_version()}")
        raise typer.Exit(0)


@app.callback()
def _global_options(
    debug: Annotated[bool, typer.Option("--debug", help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")] = False,
    _version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                           help="print the installed version and exit")] = False,
) -> None:
    if debug:
        # Through the environment, so subprocesses (mounts, workers, the data manager) inherit it.
        os.environ[DEBUG_ENV] = "1"


def _register_all() -> None:
    from scheduler.sim import cli as cli_sim

    cli_sim.register(app)
    for module_name in ("fuse_client.cli", "datamanager.cli", "scheduler.service.cli", "scheduler.demo",
                        "fuse_client.agent.cli"):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(app)


_register_all()


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _click_exception_types() -> tuple[type[BaseException], ...]:
    """Typer >= 0.20 raises its bundled copy of click's exceptions; older typer raises click's."""
    types: list[type[BaseException]] = []
    try:
        from typer._click.exceptions import ClickException as BundledClickException

        types.append(BundledClickException)
    except ImportError:
        pass
    try:
        import click

        types.append(click.ClickException)
    except ImportError:
        pass
    return tuple(types)


def _is_http_error(exc: BaseException) -> bool:
    httpx = sys.modules.get("httpx")  # only loaded by the commands that talk HTTP
    return httpx is not None and isinstance(exc, httpx.HTTPError)


def _fail(code: int, message: str, hint: str | None = None) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(hint, err=True)
    sys.exit(code)


def _os_error_message(exc: OSError) -> str:
    what = exc.strerror or str(exc)
    if exc.filename is not None:
        target = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
        return f"{target}: {what}"
    return what


def _usage_hint(exc: BaseException) -> str | None:
    ctx = getattr(exc, "ctx", None)
    if ctx is None or ctx.parent is None:
        return "Run 'silod --help' for the commands."
    return f"Run '{ctx.command_path} --help' for its options."


def handle_error(exc: BaseException) -> NoReturn:
    """Print `exc` as one or two lines and exit with its code (see the module docstring)."""
    click_types = _click_exception_types()
    if debug_enabled() and not isinstance(exc, (typer.Exit, SystemExit)):
        traceback.print_exception(exc)
    if isinstance(exc, UserError):
        _fail(2, str(exc))
    if isinstance(exc, RuntimeFailure):
        _fail(1, str(exc))
    if isinstance(exc, KeyboardInterrupt):
        _fail(130, "interrupted")
    if isinstance(exc, typer.Abort):
        _fail(130, "aborted")
    if click_types and isinstance(exc, click_types):
        code = int(getattr(exc, "exit_code", 1))
        if type(exc).__name__ == "NoArgsIsHelpError":  # `silod` or a group alone: its help
            typer.echo(exc.format_message())  # type: ignore[attr-defined]
            sys.exit(code)
        message = exc.format_message()  # type: ignore[attr-defined]
        _fail(code, message, _usage_hint(exc) if code == 2 else None)
    if isinstance(exc, UnicodeDecodeError):
        _fail(2, f"input is not text ({exc.reason} at byte {exc.start}); give a UTF-8 text file")
    if isinstance(exc, OSError):
        _fail(1, _os_error_message(exc))
    if _is_http_error(exc):
        _fail(1, f"HTTP request failed: {exc}")
    hint = None if debug_enabled() else f"This is a bug in silod; rerun with --debug (or {DEBUG_ENV}=1) for the traceback."
    _fail(1, f"{type(exc).__name__}: {exc}", hint)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `silod` console script."""
    try:
        rv = app(args=argv, prog_name="silod", standalone_mode=False)
    except typer.Exit as exc:  # raised before invoke returns in some typer versions
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 -- every error becomes a message and an exit code
        handle_error(exc)
    # Without standalone mode typer returns the code of `raise typer.Exit(code)` instead of exiting.
    sys.exit(rv if isinstance(rv, int) else 0)
