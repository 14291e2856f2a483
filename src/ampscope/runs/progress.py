"""How far a run has got, for whoever shows it: the ops recorded so far and the phase now.

A caller (the CLI's progress bar) wraps any API call in `reporting(callback)`; every `Capture`
started inside, however deep, hands the callback to its op recorder, which calls it with
(ops recorded, phase) every `every` ops and whenever the phase changes. A context variable
carries it, so the API's signatures stay as they are and nothing here knows how it is shown.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

Callback = Callable[[int, str], None]

# Often enough for a bar to move several times a second on a large predicted run, rarely
# enough that the check costs nothing next to an op's record.
EVERY = 512

_listener: contextvars.ContextVar[tuple[Callback, int] | None] = contextvars.ContextVar(
    "ampscope_progress", default=None)


@contextlib.contextmanager
def reporting(callback: Callback, every: int = EVERY) -> Iterator[None]:
    """Runs recorded inside call `callback(ops, phase)` every `every` ops and at each phase
    change ("forward", "backward", "optimizer"); the count starts at 0 with each run."""
    if every < 1:
        raise ValueError("every must be at least 1")
    token = _listener.set((callback, every))
    try:
        yield
    finally:
        _listener.reset(token)


def listener() -> tuple[Callback, int] | None:
    """The (callback, every) a run started now reports to, if any."""
    return _listener.get()


class Reporter:
    """The op recorder's side: told of each op, calls back when due."""

    __slots__ = ("callback", "every", "phase")
    callback: Callback
    every: int
    phase: str | None  # the phase last reported, None before the first op

    def __init__(self, callback: Callback, every: int) -> None:
        self.callback, self.every, self.phase = callback, every, None

    def op(self, count: int, phase: str) -> None:
        if phase != self.phase or count % self.every == 0:
            self.phase = phase
            self.callback(count, phase)
