"""How a script run under ampscope ends: as it would under `python`, whether it finished or was
stopped after `--steps`.

- **atexit.** The handlers the script registers are kept here rather than in the interpreter's
  list, and run (last registered first) when the script's run ends: under `python` they run as
  the process exits, and a run stopped after its steps, or a caller's process that goes on,
  would otherwise never run them (or run them long after, in the caller).
- **os._exit.** Called by the script in its own process, it ends the script, not ampscope:
  the run unwinds with `ScriptExited` (which the script's `except Exception:` cannot catch)
  and is reported with its status. A child process (a DataLoader worker, a forked rank) exits
  at once, as it always does.
- **status.** The status the script ended with is carried on its run's trace or error
  (`with_status`), and `run_status` says what `ampscope run` exits with (docs/cli.md, "Exit
  codes").
- **fork.** A process the script forked, which returns from the script instead of exiting
  (`sys.exit(0)` in the child), must not go on into the caller's code: `leave_if_forked`
  ends it with the status it was leaving with.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

from ampscope.patches import patched

# os._exit as the interpreter has it, before a run replaced it.
_real_exit = os._exit


class ScriptExited(BaseException):
    """The script called os._exit(code) in its own process."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Ending:
    """The script's exit handlers and its process, watched while it runs."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.handlers: list[tuple[Callable, tuple, dict]] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        def register_(func, *args, **kwargs):
            self.handlers.append((func, args, kwargs))
            return func

        def unregister_(func) -> None:
            self.handlers = [h for h in self.handlers if h[0] != func]

        def exit_(code) -> NoReturn:
            if os.getpid() == self.pid and threading.current_thread() is threading.main_thread():
                raise ScriptExited(int(code))
            _real_exit(code)

        with patched(atexit, "register", register_), patched(atexit, "unregister", unregister_), \
                patched(os, "_exit", exit_):
            yield

    def run_handlers(self) -> None:
        """The script's atexit handlers, last registered first; one that raises is reported on
        stderr and the others still run, as at interpreter exit."""
        handlers, self.handlers = self.handlers, []
        for func, args, kwargs in reversed(handlers):
            try:
                func(*args, **kwargs)
            except SystemExit:
                continue
            except BaseException:  # noqa: BLE001 - reported as the interpreter reports it, then the next one runs
                print(f"Exception ignored in atexit callback {func!r}:", file=sys.stderr)
                traceback.print_exc()

    def leave_if_forked(self, code: int) -> None:
        """In a process the script forked: exit with `code` now, its output flushed."""
        if os.getpid() == self.pid:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        _real_exit(code)


def exit_code(e: BaseException | None) -> int:
    """The status a process leaving with `e` (None: normally) would have."""
    if e is None:
        return 0
    if isinstance(e, SystemExit):
        if e.code is None:
            return 0
        return e.code if isinstance(e.code, int) else 1
    if isinstance(e, ScriptExited):
        return e.code
    return 1


# id(trace or error) -> the script's own exit status, for as long as that object lives
# (`weakref.finalize` drops the entry with it): the trace and errors are not the script's to
# carry fields for, and a status is kept only while someone may ask for it.
_statuses: dict[int, int] = {}

_Carrier = TypeVar("_Carrier")


def with_status(carrier: _Carrier, status: int) -> _Carrier:
    """`carrier` (a run's trace, or the error it raised) marked with the status the script
    ended its process with, as the operating system reports it (0-255: `sys.exit(256)` is 0
    under `python`, `sys.exit(-1)` 255)."""
    key = id(carrier)
    if key not in _statuses:
        weakref.finalize(carrier, _statuses.pop, key, None)
    _statuses[key] = status & 0xFF
    return carrier


def run_status(result: object) -> int:
    """The exit status of `ampscope run` for `result`, the run's trace or the error it raised:
    the script's own where it set one, as `python SCRIPT` would end (`sys.exit(n)`,
    `os._exit(n)`, 1 for an exception it did not catch); otherwise 0 for a trace and 2 for
    ampscope's own error (an emulation or prediction that cannot run the script, bad input)."""
    status = script_status(result)
    if status is not None:
        return status
    return 2 if isinstance(result, BaseException) else 0


def script_status(result: object) -> int | None:
    """The status the script ended with, carried by its run's trace or error; None where it
    set none (it ran to its end or was stopped; ampscope's own error)."""
    return _statuses.get(id(result)) if result is not None else None
