"""The one exception type for mistakes a user can make (bad trace row, unknown name, bad size).

It lives in the lowest package so that every layer (estimator, policies, scheduler, data plane)
can raise it, and every entry point (CLI, REST API) can turn it into a clear message with exit
code 2 or an HTTP 4xx instead of a traceback.
"""


class UserError(ValueError):
    """Bad input from a user. The message names the input and says how to fix it."""


class RuntimeFailure(RuntimeError):
    """The command was right but something outside it failed (a server that does not answer, a
    store that is down). Entry points print the message as one line and exit with code 1."""
