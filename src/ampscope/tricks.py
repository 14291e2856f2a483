"""The speed tricks of a predicted run, and the one switch that turns them all off.

A predicted run dispatches every op of the step on fake tensors. Seven tricks give the same
records in a fraction of the time by answering some ops without that dispatch
(docs/how-it-works.md#the-speed-tricks has one index of them: what each saves, what it needs,
how it falls back, which test holds it equal to the exact path):

| trick | answers | needs |
|---|---|---|
| `replay` | repeated blocks, from two recorded ones | (public hooks only) |
| `foreach` | foreach ops, over one list entry of each kind | `compute_required_storage_length` |
| `shortcuts` | per-parameter ops FakeTensorMode never caches | the converter's memos |
| `fake-cache` | other ops, from FakeTensorMode's own cache | the dispatch cache's internals |
| `clone` | new fake tensors, by cloning a first one's attributes | FakeTensor's construction |
| `prim-device` | C++ reads of a fake tensor's device | `FakeTensorMode.in_kernel_invocation` |
| `fsdp-shard` | FSDP2's chunks of each parameter for the other ranks | `_fsdp_param._chunk_with_empty` |

The exact path (`exact_path()`, `--exact`, `trace(exact=True)`) turns them all off. A trick
whose detail this torch build lacks, or that behaves differently on it, is off by itself
(`unavailable()` says why; `ampscope --version -v` lists it). A trick that fails during a run
is never the user's error: the op it failed on runs the exact way, the trick stays off for the
rest of the run, and `trace` runs the step again on the exact path.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterator
from contextvars import ContextVar


class Trick(enum.Enum):
    REPLAY = "replay"
    FOREACH = "foreach"
    SHORTCUTS = "shortcuts"
    FAKE_CACHE = "fake-cache"
    CLONE = "clone"
    PRIM_DEVICE = "prim-device"
    FSDP_SHARD = "fsdp-shard"


_exact: ContextVar[bool] = ContextVar("ampscope_exact_path", default=False)


@contextlib.contextmanager
def exact_path(exact: bool = True) -> Iterator[None]:
    """Every trick off while entered (with `exact=False`: as it was)."""
    token = _exact.set(exact or _exact.get())
    try:
        yield
    finally:
        _exact.reset(token)


def exact() -> bool:
    """Is the exact path forced here?"""
    return _exact.get()


def enabled(trick: Trick) -> bool:
    """May `trick` be used now: not on the exact path, and available on this torch build
    (what it needs is detected on the first ask, so a run that takes no trick detects none)."""
    return not _exact.get() and _missing(trick) is None


def unavailable() -> dict[Trick, str]:
    """The tricks this torch build cannot take, each with the reason."""
    return {trick: why for trick in Trick if (why := _missing(trick)) is not None}


def status(trick: Trick) -> tuple[bool, str]:
    """Whether this torch build can take `trick`, and the private detail it uses (or "needs no
    private detail") or why it cannot; each detail is detected on its first ask."""
    from ampscope.torchcompat import fake

    return fake.status(trick.value)


@functools.cache
def _missing(trick: Trick) -> str | None:
    ok, why = status(trick)
    return None if ok else why


def fell_back(trick: Trick, error: BaseException) -> str:
    """The note for a trick that failed during a run (the op ran the exact way instead)."""
    return (f"the {trick.value} speed trick failed on this torch build "
            f"({type(error).__name__}: {error}); the run took the exact path instead")


class TrickFailed(Exception):
    """A speed trick could not be trusted on this run or this torch build (a replayed block
    unlike its twins, a private detail that changed): the run is done again on the exact
    path, every trick off (`runs/environment.py`'s `exact_retry`, the one place)."""
