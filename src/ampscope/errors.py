"""The exceptions users see: `AmpscopeError`, and its `DtypeMismatchError` with a diagnosis;
`first_line`, what a one-line error quotes of another.

An `AmpscopeError` carries a one-line message that says what went wrong and what to do. The CLI
prints it and exits with status 2; any other exception is a bug (or comes from the user's model)
and is reported as such, with the traceback only under `--debug`.
"""


class AmpscopeError(Exception):
    """Bad input or an impossible request, explained in one line."""


class DtypeMismatchError(AmpscopeError):
    """The traced model failed on a dtype: two tensors met in different dtypes, or a constant
    did not fit its tensor's dtype.

    `str(error)` is the one-line summary; `diagnosis.text()` adds each argument's dtype and
    origin and the usual fixes. The model's own exception is the `__cause__`.
    """

    def __init__(self, diagnosis) -> None:
        super().__init__(diagnosis.summary)
        self.diagnosis = diagnosis


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none: what a
    one-line error quotes of the error behind it."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def named_line(e: BaseException) -> str:
    """`first_line` after the exception's type: "ValueError: bad value"."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
