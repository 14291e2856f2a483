"""Autocast's state at a device's dispatch key, as torch keeps it.

While the virtual device is active, torch's own state functions (`torch.is_autocast_enabled`,
`torch.get_autocast_dtype`, ...) answer per device type as user code should see them
(runtime/virtual_autocast.py): "cuda" reads the CPU's key, which drives the emulated kernels,
and "cpu" a shadow that drives none. ampscope's own code reads and sets the key itself, here,
with the functions kept as torch defines them when this module was first imported (before
any run could replace them).
"""

from __future__ import annotations

import torch

# As torch defines them, kept before the virtual device replaces torch's attributes.
_is_enabled = torch.is_autocast_enabled
_get_dtype = torch.get_autocast_dtype
_set_enabled = torch.set_autocast_enabled
_set_dtype = torch.set_autocast_dtype


def key_state(device: str) -> tuple[bool, torch.dtype]:
    """(enabled, dtype) of autocast at `device`'s dispatch key, as torch keeps it: for "cpu"
    in an emulated run, the target's autocast (not what the virtual device tells user code)."""
    return _is_enabled(device), _get_dtype(device)


def set_key_state(device: str, enabled: bool | None = None,
                  dtype: torch.dtype | None = None) -> None:
    """Set autocast's state at `device`'s dispatch key (what is None stays)."""
    if enabled is not None:
        _set_enabled(device, enabled)
    if dtype is not None:
        _set_dtype(device, dtype)


def eligible(value: object) -> bool:
    """autocast's is_eligible: a floating tensor that is not float64 (what a cast may touch)."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype != torch.float64)


def cpu_key_dtype() -> torch.dtype:
    """The dtype autocast casts to at the CPU's key: in an emulated run, the target's."""
    return _get_dtype("cpu")
