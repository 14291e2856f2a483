"""The process-wide SDPA switches the CUDA backend choice reads, as far as this build has them.

`torch.backends.cuda.*_sdp_enabled()` are public on every supported release; two details are
not: the priority order `sdpa_kernel(..., set_priority=True)` sets, and FlashAttention-3's
switch (torch 2.11 on). Where a build lacks one, its default applies (the built-in order;
FA3 off), as it does on that build's GPUs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ampscope.torchcompat.features import Feature

__all__ = ["fa3_enabled", "sdp_priority_order"]

# The SDPBackend numbers `_get_sdp_priority_order` returns, by name.
_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
# The first release with each detail, for the note where it is missing.
_FA3_RELEASE = "2.11"
_PRIORITY_RELEASE = "2.9"  # every supported release has it; the note names the oldest


@functools.cache
def _getter(name: str) -> Callable | None:
    return getattr(torch._C, name, None)


def sdp_priority_order() -> tuple[str, ...] | None:
    """The backends in the order the next CUDA SDPA call tries them ("flash", "efficient",
    "math", "cudnn", ...); None where the build has no settable order."""
    get = _getter("_get_sdp_priority_order")
    if get is None:
        return None
    return tuple(_BACKENDS.get(int(i), str(i)) for i in get())


def fa3_enabled() -> bool:
    """Whether FlashAttention-3 is switched on (False on builds without it)."""
    get = _getter("_get_fa3_sdp_enabled")
    return bool(get()) if get is not None else False


def features() -> list[Feature]:
    order = _getter("_get_sdp_priority_order") is not None
    fa3 = _getter("_get_fa3_sdp_enabled") is not None
    return [
        Feature("sdp priority order", order,
                "the order sdpa_kernel(set_priority=True) sets" if order
                else f"needs torch {_PRIORITY_RELEASE}; the built-in order applies",
                "attention choice"),
        Feature("fa3 sdp switch", fa3,
                "FlashAttention-3's switch" if fa3
                else f"needs torch {_FA3_RELEASE}; FA3 counts as off", "attention choice"),
    ]
