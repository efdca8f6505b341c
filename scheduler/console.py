"""The one way a CLI command makes the rich Console it prints tables with.

On a terminal, rich fits a table to the terminal's width. Piped or redirected (not a terminal,
no COLUMNS), rich assumes 80 columns and squeezes a wider table into them: cells are cut to
"ru…" and narrow columns shrink to nothing, so their neighbours' borders and text glue
together. Output that is not a terminal is read by a program or a wider window later, so there
every table is printed at its natural width. COLUMNS, when set, is still obeyed.
"""

from __future__ import annotations

import os
from typing import Any

#: The width of a console that is not a terminal: wide enough for any table at its own width
#: (a table does not expand to fill it; only a centred title is padded to the table's width).
UNBOUNDED = 100_000


def table_console(*, min_width: int | None = None, **kwargs: Any) -> Any:
    """A Console for tables. `min_width`: on a terminal narrower than this, print this wide
    anyway (lines wrap in the terminal rather than cells being cut; `--wide` tables)."""
    from rich.console import Console

    console = Console(**kwargs)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        return Console(width=UNBOUNDED, **kwargs)
    if min_width is not None and console.width < min_width:
        return Console(width=min_width, **kwargs)
    return console
