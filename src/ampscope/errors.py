"""The one exception type users see.

An `AmpscopeError` carries a one-line message that says what went wrong and what to do. The CLI
prints it and exits with status 2; any other exception is a bug (or comes from the user's model)
and is reported as such, with the traceback only under `--debug`.
"""


class AmpscopeError(Exception):
    """Bad input or an impossible request, explained in one line."""
