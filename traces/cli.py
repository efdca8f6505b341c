"""`silod trace fetch|path`: where the public traces are, and the download of those silod does not
ship (traces/public.py, traces/fetch.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

BASE_URL_ENV = "SILOD_TRACE_BASE_URL"


def register(trace_app: typer.Typer) -> None:
    """Adds `fetch` and `path` to the `silod trace` group (scheduler/sim/cli.py makes it)."""

    @trace_app.command("fetch")
    def fetch(
        name: Annotated[str, typer.Argument(help="the trace: alibaba-openb")],
        dest: Annotated[Path | None, typer.Option("--dest", help="folder to put it in [default: $SILOD_TRACES_DIR/NAME or ~/.cache/silod/traces/NAME]")] = None,
        force: Annotated[bool, typer.Option("--force", help="replace files of the trace already in --dest")] = False,
        base_url: Annotated[str | None, typer.Option("--base-url", envvar=BASE_URL_ENV,
                                                     help="download from this folder URL instead of GitHub at the pinned commit "
                                                          "(a mirror of the same files; they are checked against the same SHA-256s)")] = None,
    ) -> None:
        """Download a public trace from its repository at a pinned commit; every file's size and SHA-256 are checked,
        and nothing is written unless all match."""
        from traces.fetch import fetch_trace, resolve

        trace = resolve(name)
        out = fetch_trace(name, dest, force=force, base_url=base_url, progress=lambda line: typer.echo(line, err=True))
        typer.echo(f"{trace.name}: {len(trace.files)} files checked (SHA-256, commit {trace.commit[:12]}) in {out}")
        typer.echo(f"use it with: silod simulate --trace {out} --format {trace.name} (or silod experiment alibaba --trace {out})")

    @trace_app.command("path")
    def path(name: Annotated[str, typer.Argument(help="gavel-msr | alibaba-openb")]) -> None:
        """Print the folder that holds a public trace (shipped, or where `silod trace fetch` put it)."""
        from estimator.errors import UserError, did_you_mean
        from traces.public import FETCHABLE, SHIPPED_GAVEL_DIR, default_fetch_dir

        if name == "gavel-msr":
            typer.echo(str(SHIPPED_GAVEL_DIR))
            return
        if name not in FETCHABLE:
            raise UserError(f"unknown trace {name!r}{did_you_mean(name, ['gavel-msr', *FETCHABLE])}; "
                            f"known: gavel-msr, {', '.join(FETCHABLE)}")
        folder = default_fetch_dir(name)
        if not all((folder / f.name).is_file() for f in FETCHABLE[name].files):
            raise UserError(f"{name} has not been fetched into {folder}; run `silod trace fetch {name}` first")
        typer.echo(str(folder))
