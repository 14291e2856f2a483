"""Holding back other libraries' log lines while ampscope calls them: their messages would
reach the user's terminal before (or instead of) ampscope's own one-line answer."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def loggers_quiet(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """Raise the named loggers to `level` for the body; their own levels come back after,
    also when the body raises. Handlers, and every other logger, are left alone."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, levels, strict=True):
            logger.setLevel(old)
