"""Every attribute ampscope replaces for the length of a run, through one place.

A run changes code that is not its own: `torch.cuda.is_available` on the virtual device,
`nn.Module.__init__` and `torch.save` while a script runs, a block's `forward` while its twins
are replayed, `torch.inference_mode`'s entry while a step is recorded. Each such change is made
here, by `patched(owner, name, value)` (a context manager) or `patch(...)` (which returns what
undoes it), so that:

- every change is undone the way it was made: an attribute the owner had itself (a module's
  function, a class's method) is set back; one it only inherited (an instance's `forward`, found
  on its class) is deleted again, so the class's shows through as before;
- `undo_all()` undoes them all at once, in a forked process that leaves the run;
- `active()` lists the changes in force now: none once a run has ended, which the tests check
  after runs that fail in every way (tests/test_state.py);
- `changed()` lists every attribute ampscope replaced in this process that is not what it
  was before the first replacement: empty whenever no run is in progress, which the tests'
  state check asserts. An attribute is remembered only until it is put back as it was (no
  replacement of it left in force): the registry then holds nothing of its owner, so a model
  whose `forward` a run wrapped is freed with the user's last reference to it, not kept until
  the process exits (tests/test_patches_memory.py).

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(eq=False)
class Patch:
    """One replaced attribute, while it is replaced."""

    owner: object
    name: str
    value: object
    original: object
    own: bool  # whether the owner held the attribute itself (else: inherited, or missing)

    def __repr__(self) -> str:
        return f"Patch({_label(self.owner)}.{self.name})"


_active: list[Patch] = []
_MISSING = object()
# (id(owner), name) -> (owner, name, the owner's own value before ampscope first replaced it,
# or _MISSING where it had none of its own), while a replacement of it is in force or after the
# last one was undone without putting that value back (which `changed()` reports). An entry
# holds its owner, which may be a user's model (the instances whose `forward` a run wrapped):
# `undo` drops it once the attribute is as it was, or every traced model would stay alive.
_touched: dict[tuple[int, str], tuple[object, str, object]] = {}


def patch(owner: object, name: str, value: object) -> Callable[[], None]:
    """Replace `owner.name` with `value` now; returns what puts it back (call it once)."""
    held = _own_attributes(owner)
    own = held is not None and name in held
    original = held[name] if own and held is not None else getattr(owner, name, _MISSING)
    entry = Patch(owner, name, value, original, own)
    _touched.setdefault((id(owner), name), (owner, name, original if own else _MISSING))
    _set(owner, name, value)
    _active.append(entry)

    def undo() -> None:
        if entry not in _active:
            return  # undone already
        _active.remove(entry)
        _put_back(entry)
        _forget_if_restored(entry.owner, name)

    return undo


def _forget_if_restored(owner: object, name: str) -> None:
    """Drop the registry's entry for `owner.name` once no replacement of it is in force and
    its own value is the one it had before the first: nothing is left to report, and the
    entry alone would keep `owner` alive."""
    key = (id(owner), name)
    touched = _touched.get(key)
    if touched is None or any(p.owner is owner and p.name == name for p in _active):
        return
    held = _own_attributes(owner)
    now = held.get(name, _MISSING) if held is not None else _MISSING
    if now is touched[2]:
        del _touched[key]


def _put_back(entry: Patch) -> None:
    if entry.own:
        _set(entry.owner, entry.name, entry.original)
    else:
        with contextlib.suppress(AttributeError):
            _delete(entry.owner, entry.name)


def _is_instance(owner: object) -> bool:
    return not isinstance(owner, (type, types.ModuleType))


# An instance's own attribute is set and deleted past its class's __setattr__/__delattr__: a
# wrapper module that forwards attributes to the module it wraps (Lightning Fabric's, accelerate's)
# would otherwise give the wrapped module the wrapper's `forward` too, which calls it back.
def _set(owner: object, name: str, value: object) -> None:
    if _is_instance(owner):
        object.__setattr__(owner, name, value)
    else:
        setattr(owner, name, value)


def _delete(owner: object, name: str) -> None:
    if _is_instance(owner):
        object.__delattr__(owner, name)
    else:
        delattr(owner, name)


def undo_all() -> int:
    """Undo every replacement in force, newest first; how many. Only for a process forked
    during a run that leaves it (a DataLoader worker, runtime/workers.py): it never returns to
    the code that would undo them one by one."""
    undone = len(_active)
    while _active:
        entry = _active.pop()
        _put_back(entry)
        _forget_if_restored(entry.owner, entry.name)
    return undone


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    """`owner.name` is `value` while the body runs, and as it was after, also when it raised."""
    undo = patch(owner, name, value)
    try:
        yield
    finally:
        undo()


def active() -> list[Patch]:
    """The replacements in force now, oldest first."""
    return list(_active)


def changed() -> list[str]:
    """`owner.name` for each attribute ever replaced here whose own value is not the one it
    had before (empty when every run has put back what it replaced)."""
    found = []
    for owner, name, original in _touched.values():
        held = _own_attributes(owner)
        now = held.get(name, _MISSING) if held is not None else _MISSING
        if now is not original:
            found.append(f"{_label(owner)}.{name}")
    return found


def _label(owner: object) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or \
        type(owner).__name__


def _own_attributes(owner: object) -> dict | None:
    try:
        return vars(owner)
    except TypeError:  # an object without a __dict__ (slots): only inherited attributes
        return None
