"""How a `torch.autocast` region enters and leaves: the detail the virtual device stands on.

A region keeps its device type in its `device` attribute and its dtype in `fast_dtype`, both
set by its constructor, and its `__enter__` and `__exit__` set autocast's state for that
device type through torch's module-level `set_autocast_enabled` and `set_autocast_dtype`.
Neither is documented. The virtual device builds a region for its target as a CPU region
(the target's own checks ask for the real device), then retargets it (`retarget`), so that
entering it drives the target's autocast state and the CPU's stays the CPU's
(runtime/virtual_autocast.py). Whether this build's regions behave so is found once by
entering a CPU-built region retargeted to CUDA (`retargetable`); where they do not, the
virtual device keeps the CPU's state and the target's in one (the CPU's autocast then casts
tensors on the target, as before the two were told apart).

What a run's regions did is read off them the same way (`region_state`: the device type, dtype
and enabled flag they entered with), found readable once per build (`regions_readable`); where
it is not, the recorder records no region. What the code asked of a region (a dtype or none,
`enabled=`) is gone once it is built: the constructors that see it write it down (`note_asked`,
read back by `asked`).

Namesakes, the same concern at other layers: `records/autocast_regions.py` (the record of a
region a run entered), `runs/autocast_regions.py` (the recorder).
"""

from __future__ import annotations

import functools
import weakref

import torch

from ampscope.torchcompat.features import Feature

__all__ = ["REGION", "asked", "features", "note_asked", "region_state", "regions_readable",
           "retarget", "retargetable"]

# The class `torch.autocast`, `torch.amp.autocast` are; `torch.cuda.amp.autocast` and
# `torch.cpu.amp.autocast` derive from it and enter through its `__enter__`.
REGION = torch.autocast

# As torch defines them, kept before the virtual device answers them per device type.
_is_enabled = torch.is_autocast_enabled
_get_dtype = torch.get_autocast_dtype


def retarget(region: torch.autocast, device_type: str, dtype: torch.dtype) -> None:
    """`region`, built for another device type, enters and leaves as `device_type`'s with
    `dtype` (only where `retargetable()`)."""
    region.fast_dtype = dtype
    region.device = device_type


def _state() -> tuple:
    return (_is_enabled("cpu"), _get_dtype("cpu"), _is_enabled("cuda"), _get_dtype("cuda"))


@functools.cache
def retargetable() -> tuple[bool, str]:
    """Whether a CPU-built region retargeted to CUDA sets CUDA's autocast state and leaves the
    CPU's alone, in and out (tried once, on real state put back by the region itself)."""
    before = _state()
    try:
        region = torch.autocast("cpu", dtype=torch.bfloat16)
        retarget(region, "cuda", torch.float32)
        with region:
            inside = _state()
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:
        return False, f"a retargeted autocast region fails ({type(e).__name__}: {e})"
    after = _state()
    if inside != (*before[:2], True, torch.float32) or after != before:
        return False, "an autocast region does not enter as the device type it is given"
    return True, "an autocast region enters as its `device` attribute says"


@functools.cache
def regions_readable() -> tuple[bool, str]:
    """Whether a region defines its own `__init__`, `__enter__` and `__exit__` and keeps the
    device type, dtype and enabled flag it enters with as `device`, `fast_dtype`, `_enabled`
    (tried once, on a disabled CPU region that is never entered)."""
    missing = [n for n in ("__init__", "__enter__", "__exit__") if n not in vars(REGION)]
    if missing:
        return False, f"torch.autocast defines no {missing[0]} of its own"
    try:
        region = REGION("cpu", dtype=torch.bfloat16, enabled=False)
        state = region_state(region)
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:
        return False, f"an autocast region's state cannot be read ({type(e).__name__}: {e})"
    if state != ("cpu", torch.bfloat16, False):
        return False, "an autocast region does not keep the state it was built with"
    return True, "an autocast region keeps its device type, dtype and enabled flag"


def region_state(region: torch.autocast) -> tuple[str, torch.dtype, bool]:
    """(device type, dtype, enabled) `region` enters with (only where `regions_readable()`)."""
    return region.device, region.fast_dtype, bool(region._enabled)


# What the code asked of each region built while someone wrote it down: (device type as named,
# whether a dtype was given, enabled as asked). Weak: a region the code drops goes with it.
_asked: weakref.WeakKeyDictionary[torch.autocast, tuple[str, bool, bool]] = \
    weakref.WeakKeyDictionary()


def note_asked(region: torch.autocast, device_type: str, dtype_given: bool,
               enabled: bool) -> None:
    """Write down what the code asked of `region` as it was built (the last writer wins: the
    virtual device's constructor, around the one that sees the CPU region it builds)."""
    _asked[region] = (device_type, dtype_given, enabled)


def asked(region: torch.autocast) -> tuple[str, bool, bool] | None:
    """What `note_asked` wrote of `region`; None for a region built unwatched."""
    return _asked.get(region)


def features() -> list[Feature]:
    ok, why = retargetable()
    readable, how = regions_readable()
    return [Feature("autocast regions by device type", ok, why,
                    "torch.autocast(\"cpu\") kept apart on the virtual device"),
            Feature("autocast regions readable", readable, how,
                    "the autocast regions a run entered (trace.autocast_regions, AMP8xx)")]
