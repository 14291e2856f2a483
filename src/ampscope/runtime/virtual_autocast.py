"""Autocast on the virtual device: each device type keeps its own autocast state, as on a GPU.

An emulated run's tensors live on the CPU, so the target's autocast has to run at the CPU's
autocast dispatch key, whose kernels the emulation replaced with the target's
(runtime/emulation.py). PyTorch keeps one autocast state (enabled, dtype) per device type, and
`torch.autocast(device_type)` casts only the tensors of that type. While the virtual device is
active, the state functions torch's own `autocast` regions call (`is_autocast_enabled`,
`get_autocast_dtype`, `set_autocast_enabled`, `set_autocast_dtype`) read and write:

- the target's state ("cuda") at the CPU's key, which drives the emulated kernels; it starts
  at the target's default dtype (float16 on CUDA, from hardware/device_types.py or the
  build), so `torch.get_autocast_dtype("cuda")` and `torch.autocast("cuda")` without a dtype
  answer as on the GPU;
- the CPU's own state ("cpu") in a shadow that drives no kernel: `torch.autocast("cpu")`
  around a model on the virtual `cuda` device changes nothing, as on the GPU, where CPU
  autocast never reaches a CUDA tensor (and `enabled=False` for "cpu" does not turn the
  target's autocast off). This needs a region built for the CPU to enter as the target's
  (torchcompat/autocast_regions.py); on a build where it cannot, there is no shadow and
  `ampscope --version -v` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ampscope.hardware.device_types import device_type
from ampscope.runtime import emulation
from ampscope.runtime.autocast_key import key_state, set_key_state
from ampscope.runtime.autocast_policy import default_autocast_dtype
from ampscope.torchcompat.autocast_regions import note_asked, retarget, retargetable

# The dtypes torch's autocast accepts on the CPU (its `device_supported_dtypes`).
CPU_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def target_default_dtype(target: str) -> torch.dtype:
    """The target's default autocast dtype: its table entry's, else the build's own."""
    name = device_type(target).autocast_dtype
    return getattr(torch, name) if name is not None else default_autocast_dtype(target)


class AutocastSlots:
    """The per-device autocast state user code sees while the virtual device stands for
    `target`: the target's at the CPU's key, the CPU's in a shadow (see the module's doc)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.shadow: list = [False, torch.bfloat16]  # the CPU's (enabled, dtype), as user code set it

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The slots for the body: the CPU's state as it was moves to the shadow, the CPU's key
        starts as the target's state outside any region (off, its default dtype)."""
        before = key_state("cpu")
        self.shadow = list(before)
        set_key_state("cpu", False, target_default_dtype(self.target))
        try:
            yield
        finally:
            set_key_state("cpu", *before)

    def _slot(self, device_type: str) -> str | None:
        """"cpu" for the CPU's key, None for the shadow, else the device type itself. Where
        this build's regions cannot be retargeted (torchcompat/autocast_regions.py), the
        CPU's state is the target's: no shadow."""
        if device_type == self.target:
            return "cpu"
        if device_type == "cpu" and retargetable()[0]:
            return None
        return device_type

    def patches(self) -> list[tuple[object, str, object]]:
        """torch's autocast state functions, each reading or writing its device's slot."""
        target = self.target
        retargetable()  # found out now, on torch's own functions, before they are replaced

        def is_autocast_enabled(device_type: str = "cuda") -> bool:
            slot = self._slot(device_type)
            return bool(self.shadow[0]) if slot is None else key_state(slot)[0]

        def get_autocast_dtype(device_type: str) -> torch.dtype:
            slot = self._slot(device_type)
            return self.shadow[1] if slot is None else key_state(slot)[1]

        def set_autocast_enabled(device_type: str, enabled: bool) -> None:
            slot = self._slot(device_type)
            if slot is None:
                self.shadow[0] = enabled
            else:
                set_key_state(slot, enabled=enabled)

        def set_autocast_dtype(device_type: str, dtype: torch.dtype) -> None:
            slot = self._slot(device_type)
            if slot is None:
                self.shadow[1] = dtype
            else:
                set_key_state(slot, dtype=dtype)

        clear = torch.clear_autocast_cache

        def clear_autocast_cache() -> None:
            # What autocast calls when its outermost region ends: the emulated cast cache
            # goes too (the target's kernels keep their own).
            clear()
            emulation.clear_active_cache()

        patches: list[tuple[object, str, object]] = [
            (torch, "is_autocast_enabled", is_autocast_enabled),
            (torch, "get_autocast_dtype", get_autocast_dtype),
            (torch, "set_autocast_enabled", set_autocast_enabled),
            (torch, "set_autocast_dtype", set_autocast_dtype),
            (torch, "clear_autocast_cache", clear_autocast_cache),
            (torch.amp.autocast_mode.autocast, "__init__", _autocast_init(target)),
        ]
        # The deprecated per-device forms (torchao's Float8Linear reads the GPU one).
        deprecated = {"is_autocast_cpu_enabled": lambda: is_autocast_enabled("cpu"),
                      "get_autocast_cpu_dtype": lambda: get_autocast_dtype("cpu")}
        if target == "cuda":
            deprecated["get_autocast_gpu_dtype"] = lambda: get_autocast_dtype("cuda")
        patches += [(torch, name, fn) for name, fn in deprecated.items() if hasattr(torch, name)]
        return patches


def _autocast_init(target: str) -> Callable:
    """`torch.autocast(target, ...)` checked by torch as a CPU region (the target's checks ask
    for the real device), then driving the target's slot; without a dtype, the slot's."""
    original = torch.amp.autocast_mode.autocast.__init__

    def __init__(self, device_type: str, dtype=None, enabled: bool = True,
                 cache_enabled=None):
        if device_type != target:
            original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            return
        given = dtype is not None
        if dtype is None:
            dtype = torch.get_autocast_dtype(target)  # the target's slot, as torch reads it
        accepted = dtype
        if dtype not in CPU_AUTOCAST_DTYPES:
            # torch's autocast checks the dtype against a list on every device but CUDA,
            # which takes float32 too: the CPU's check must not disable the region. It is
            # built with a dtype the CPU takes, then given the user's (CPU autocast itself
            # runs on any floating dtype it is set to).
            dtype = CPU_AUTOCAST_DTYPES[0]
        original(self, "cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        # Its __enter__ and __exit__ go to the target's slot (where this build cannot retarget
        # a region, the CPU's, which is then the target's too).
        retarget(self, target if retargetable()[0] else "cpu", accepted)
        # What the code asked, over what the constructor below saw (a CPU region, a dtype).
        note_asked(self, target, given, enabled)

    return __init__
