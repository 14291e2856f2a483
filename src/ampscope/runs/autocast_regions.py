"""The `torch.autocast` regions a run enters: `RegionRecorder`, entered by the capture.

While it records, torch's autocast class (which `torch.amp.autocast`, `torch.cuda.amp.autocast`
and `torch.cpu.amp.autocast` are or derive from) is built and entered through wrappers that
write down what the code asked (a dtype or none, `enabled=`), what the region entered with, the
user line that entered it and where it nests. The ops the op recorder appends while a region is
the innermost one are its own: how many, how many autocast cast, their inputs' floating dtypes;
and the devices of the torch calls made inside it, which the function recorder collects in the
region's set. Regions PyTorch enters itself (activation checkpointing's recomputation replays
the forward's autocast state) are not the user's and are not recorded; their ops count in the
user's region around them.

Where this build's regions cannot be read (torchcompat/autocast_regions.py) nothing is patched
and no region is recorded. Every patch is undone when the capture stops, also when the run
raised.

Namesakes, the same concern at other layers: `records/autocast_regions.py` (the record),
`torchcompat/autocast_regions.py` (how a region is built, entered and read).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

import torch

from ampscope.patches import patch
from ampscope.records import OP_ROW, dtype_name
from ampscope.records.autocast_regions import AutocastRegion
from ampscope.runs.functions import FunctionRecorder
from ampscope.runs.source import source_from
from ampscope.torchcompat.autocast_regions import (
    REGION,
    asked,
    note_asked,
    region_state,
    regions_readable,
    retargetable,
)

_CAST, _INPUTS = OP_ROW.at("autocast_cast"), OP_ROW.at("inputs")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Frames between the code that enters a region and its `__enter__`: the per-device subclasses'
# own `__enter__`, the decorator form's wrapper, a `contextmanager` that yields a region.
_WRAPPERS = frozenset({*(os.path.join(_TORCH_DIR, *parts, "autocast_mode.py")
                         for parts in (("amp",), ("cuda", "amp"), ("cpu", "amp"))),
                       contextlib.__file__})
# On a virtual device, the tensors' real device types that stand for the target's.
_BACKING = frozenset({"cpu", "meta"})


@functools.cache
def _is_floating(name: str) -> bool:
    dtype = getattr(torch, name, None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


@dataclass(eq=False)
class _Open:
    """A region entered and not yet left, with what it has counted so far."""

    region: torch.autocast
    index: int
    device_type: str
    dtype: str
    enabled: bool
    enabled_asked: bool
    dtype_given: bool | None
    source: str | None
    depth: int
    parent: int | None
    since: int  # the op row from which the ops are this region's (while it is innermost)
    ops: int = 0
    casts: int = 0
    dtypes: set[str] = field(default_factory=set)
    devices: set[str] = field(default_factory=set)


def _warn_at(caught: list[warnings.WarningMessage], frame: FrameType) -> None:
    """Issue the warnings `caught` again as made at `frame`'s line, under the filters and
    the once-only registry of its module, as `warnings.warn(stacklevel=...)` would have."""
    scope = frame.f_globals
    registry = scope.setdefault("__warningregistry__", {})
    for w in caught:
        warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename,
                               frame.f_lineno, scope.get("__name__"), registry, scope)


class RegionRecorder:
    """Records each autocast region entered while it is entered (see the module's doc).
    `rows`: the op recorder's rows; `functions`: the function recorder, which fills the
    innermost region's device set; `device`: a virtual device's target (its tensors live on the
    CPU and say they are on the target), None for a run on this machine's own devices."""

    def __init__(self, rows: list[tuple], functions: FunctionRecorder,
                 device: str | None = None) -> None:
        self._rows = rows
        self._functions = functions
        self._device = device
        self._thread = threading.get_ident()  # autocast's state is per thread: this one's
        self._slots: list[_Open | AutocastRegion] = []  # every region entered, in order
        self._open: list[_Open] = []  # the regions entered and not left, innermost last
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> RegionRecorder:
        if not regions_readable()[0]:
            return self  # nothing to read them by: no records
        retargetable()  # found before the patches: its trial region is none of the run's
        self._undo = [patch(REGION, "__init__", self._built(REGION.__init__)),
                      patch(REGION, "__enter__", self._entering(REGION.__enter__)),
                      patch(REGION, "__exit__", self._leaving(REGION.__exit__))]
        return self

    def __exit__(self, *exc: object) -> None:
        undo, self._undo = self._undo, []
        for each in reversed(undo):
            each()
        self._functions.devices = None
        while self._open:  # the run stopped inside them: each counted up to here
            self.left(self._open[-1].region)

    def records(self) -> list[AutocastRegion]:
        """The regions entered, in order (those still open counted up to now)."""
        while self._open:
            self.left(self._open[-1].region)
        return [s for s in self._slots if isinstance(s, AutocastRegion)]

    # -- the wrappers
    def _built(self, original: Callable) -> Callable:
        def __init__(region, device_type, dtype=None, enabled=True, cache_enabled=None):
            # torch warns of a region it turns off at its caller's line: the code's, not this.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                original(region, device_type, dtype=dtype, enabled=enabled,
                         cache_enabled=cache_enabled)
            note_asked(region, device_type, dtype is not None, bool(enabled))
            if caught:
                _warn_at(caught, sys._getframe(1))
        return __init__

    def _entering(self, original: Callable) -> Callable:
        def __enter__(region):
            out = original(region)  # entered first: a region torch refuses is none
            self.entered(region, sys._getframe(1))
            return out
        return __enter__

    def _leaving(self, original: Callable) -> Callable:
        def __exit__(region, exc_type, exc_val, exc_tb):
            self.left(region)
            return original(region, exc_type, exc_val, exc_tb)
        return __exit__

    # -- the regions
    def entered(self, region: torch.autocast, frame: FrameType | None) -> None:
        """`region` was entered by the code at `frame` (the caller of its `__enter__`)."""
        if threading.get_ident() != self._thread:
            return
        while frame is not None and frame.f_code.co_filename in _WRAPPERS:
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR):
            return  # PyTorch's own region
        device, dtype, enabled = region_state(region)
        built = asked(region)
        device_type, dtype_given, enabled_asked = built if built is not None else \
            (device, None, enabled)
        now = len(self._rows)
        outer = self._open[-1] if self._open else None
        if outer is not None:
            self._count(outer, now)
        entry = _Open(region, len(self._slots), device_type, dtype_name(dtype), enabled,
                      enabled_asked, dtype_given, source_from(frame), len(self._open),
                      outer.index if outer is not None else None, now)
        self._slots.append(entry)
        self._open.append(entry)
        self._functions.devices = entry.devices

    def left(self, region: torch.autocast) -> None:
        """`region` is being left: its counts end here, the region around it counts again."""
        if threading.get_ident() != self._thread:
            return
        at = next((i for i in range(len(self._open) - 1, -1, -1)
                   if self._open[i].region is region), None)
        if at is None:
            return  # entered before the recording, or by PyTorch
        now = len(self._rows)
        self._count(self._open[-1], now)  # the innermost, whichever is left
        entry = self._open.pop(at)
        self._slots[entry.index] = self._record(entry)
        if self._open:
            self._open[-1].since = now
            self._functions.devices = self._open[-1].devices
        else:
            self._functions.devices = None

    def _count(self, entry: _Open, now: int) -> None:
        """The ops appended since `entry` became innermost, counted as its own."""
        start = min(entry.since, now)
        dtypes = entry.dtypes
        for row in self._rows[start:now]:
            entry.casts += row[_CAST]
            dtypes.update(m.dtype for m in row[_INPUTS])
        entry.ops += now - start
        entry.since = now

    def _record(self, entry: _Open) -> AutocastRegion:
        devices = entry.devices
        if self._device is not None:  # the virtual device's tensors are the target's
            devices = {self._device if d in _BACKING else d for d in devices}
        return AutocastRegion(
            entry.index, entry.device_type, entry.dtype, entry.enabled, entry.enabled_asked,
            entry.dtype_given, entry.source, entry.depth, entry.parent, entry.ops, entry.casts,
            tuple(sorted(d for d in entry.dtypes if _is_floating(d))), tuple(sorted(devices)))
