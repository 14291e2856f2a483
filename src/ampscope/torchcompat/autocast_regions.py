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
"""

from __future__ import annotations

import functools

import torch

from ampscope.torchcompat.features import Feature

__all__ = ["features", "retarget", "retargetable"]

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


def features() -> list[Feature]:
    ok, why = retargetable()
    return [Feature("autocast regions by device type", ok, why,
                    "torch.autocast(\"cpu\") kept apart on the virtual device")]
