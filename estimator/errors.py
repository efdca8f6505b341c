"""The one exception type for mistakes a user can make (bad trace row, unknown name, bad size).

It lives in the lowest package so that every layer (estimator, policies, scheduler, data plane)
can raise it, and every entry point (CLI, REST API) can turn it into a clear message with exit
code 2 or an HTTP 4xx instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class UserError(ValueError):
    """Bad input from a user. The message names the input and says how to fix it."""


class RuntimeFailure(RuntimeError):
    """The command was right but something outside it failed (a server that does not answer, a
    store that is down). Entry points print the message as one line and exit with code 1."""


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    """' (did you mean 'fifo'?)' for the closest of `choices` to a mistyped `given`, or ''.

    One rule for every name a user types (policies, cache systems, trace columns): case is
    ignored when comparing, and only a close match is suggested (difflib's ratio >= 0.6)."""
    import difflib

    by_folded = {c.casefold(): c for c in choices}
    close = difflib.get_close_matches(given.casefold(), list(by_folded), n=1, cutoff=0.6)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


def resolve_name(kind: str, given: str, choices: Iterable[str]) -> str:
    """The canonical spelling of `given` among `choices`, matched without regard to case (so
    `FIFO` and `fifo` mean the same in every command and in the API); UserError naming the
    closest choice and listing them all otherwise."""
    names = list(choices)
    if given in names:
        return given
    folded = [c for c in names if c.casefold() == given.casefold()]
    if len(folded) == 1:
        return folded[0]
    raise UserError(f"unknown {kind} {given!r}{did_you_mean(given, names)}; choose one of: {', '.join(names)}")
