"""The private PyTorch details the virtual device (runtime/virtual_device.py) uses.

An emulated GPU run answers device questions from Python: it must see a tensor's attribute
getters and moves as the C++ tensor type defines them, parse `.to(...)` arguments as torch
does, read a device without its own torch function mode answering, know which factories take
a `device=`, and undo the few caches torch fills from the accelerator it finds. Each detail is
looked up once, here, and `features()` says which this build has.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator

import torch

from ampscope.torchcompat.features import Feature


@functools.cache
def tensor_base() -> type:
    """The C++ tensor type whose getters (`device`, `is_cuda`) and methods (`to`, `cuda`)
    every tensor's come from: `torch._C.TensorBase` (`_TensorBase` before 2.2)."""
    found = getattr(torch._C, "TensorBase", None) or getattr(torch._C, "_TensorBase", None)
    if found is None:
        raise ImportError("this torch build has no torch._C.TensorBase: the virtual device "
                          "cannot read tensor devices")
    return found


def parse_to() -> Callable[..., tuple[torch.device | None, torch.dtype | None, bool,
                                      torch.memory_format | None]]:
    """The function that reads `Tensor.to`'s arguments as torch does: called with them, it
    returns (device, dtype, non_blocking, memory_format), each None where not given. Torch
    functions see it too: `nn.Module.to` calls it with the user's arguments and moves each
    tensor to the device it returns."""
    return torch._C._nn._parse_to


@functools.cache
def _constructors_source() -> Callable[[], set] | None:
    module = importlib.import_module("torch.utils._device")
    return getattr(module, "_device_constructors", None)


@functools.cache
def device_constructors() -> frozenset[Callable]:
    """The factory functions that take `device=` and follow the default device
    (`torch.zeros`, `torch.arange`, ...): the set `with torch.device(...)` rewrites."""
    source = _constructors_source()
    return frozenset(source()) if source is not None else frozenset()


@functools.cache
def dataloader_pinning() -> types.ModuleType | None:
    """The module whose `pin_memory(data, device)` every DataLoader iterator calls to pin a
    batch (in the main thread, or in its pin-memory thread, which no function mode of the
    main thread reaches), or None where this build has none."""
    try:
        module = importlib.import_module("torch.utils.data._utils.pin_memory")
    except ImportError:
        return None
    return module if callable(getattr(module, "pin_memory", None)) else None


@functools.cache
def checkpoint_device_slot() -> tuple[type, str] | None:
    """(class, attribute) where activation checkpointing caches its default device type, which
    newer releases fill on first use from the accelerator they find: a run on the virtual
    device must not leave 'cuda' cached there. None where this build has no such cache."""
    owner = getattr(importlib.import_module("torch.utils.checkpoint"), "DefaultDeviceType", None)
    name = "_default_device_type"
    if owner is None or name not in vars(owner):
        return None
    return owner, name


@contextlib.contextmanager
def checkpoint_cache_kept() -> Iterator[None]:
    """The checkpoint default-device cache as it was before the body, whatever the body
    cached there."""
    slot = checkpoint_device_slot()
    if slot is None:
        yield
        return
    owner, name = slot
    before = vars(owner)[name]
    try:
        yield
    finally:
        setattr(owner, name, before)


@functools.cache
def accelerator_query() -> tuple[types.ModuleType, str] | None:
    """(module, name) of the function torch's own code calls to learn this build's
    accelerator, `torch._C._get_accelerator(check=False)`, which the virtual device answers
    (runtime/device_internals.py says why); None where this build has none."""
    name = "_get_accelerator"
    return (torch._C, name) if callable(getattr(torch._C, name, None)) else None


@functools.cache
def wrapper_subclass_maker() -> tuple[type, str, Callable] | None:
    """(owner, name, original) of the constructor every tensor subclass that wraps other
    tensors calls, `torch.Tensor._make_wrapper_subclass(cls, size, ..., device=...)` (DTensor,
    torchao's float8 weight; runtime/device_internals.py says why the virtual device replaces
    it); None where this build has none."""
    name = "_make_wrapper_subclass"
    original = getattr(torch.Tensor, name, None)
    return (torch.Tensor, name, original) if callable(original) else None


_VIRTUAL = "the virtual device (an emulated --device)"


def _feature(name: str, available: bool, detail: str, needed_by: str) -> Feature:
    return Feature(name, available, detail if available else f"missing: {detail}", needed_by)


def _has_tensor_base() -> bool:
    try:
        tensor_base()
    except ImportError:
        return False
    return True


def features() -> list[Feature]:
    """What this build offers of the details above."""
    nn = getattr(torch._C, "_nn", None)
    return [
        _feature("torch._C.TensorBase", _has_tensor_base(),
                 "the tensor getters and moves the device mode answers", _VIRTUAL),
        _feature("torch._C._nn._parse_to", hasattr(nn, "_parse_to"),
                 "reads Tensor.to arguments as torch does", _VIRTUAL),
        _feature("torch.utils._device._device_constructors", _constructors_source() is not None,
                 "the factories that follow `with torch.device(...)`",
                 "the target as default device (`with torch.device('cuda'):`)"),
        _feature("torch._C._get_accelerator", accelerator_query() is not None,
                 "the build's accelerator as torch's own code asks it",
                 "fully_shard without a mesh on the virtual device"),
        _feature("torch.Tensor._make_wrapper_subclass", wrapper_subclass_maker() is not None,
                 "tensor subclasses made on the backing device",
                 "tensor subclasses (torchao float8 weights) on the virtual device"),
        _feature("torch.utils.data._utils.pin_memory", dataloader_pinning() is not None,
                 "DataLoader's batch pinning, left undone on the virtual device",
                 "DataLoader(pin_memory=True) with workers on the virtual device"),
        Feature("torch.utils.checkpoint.DefaultDeviceType._default_device_type",
                checkpoint_device_slot() is not None,
                "checkpointing's cached device type, put back after a run"
                if checkpoint_device_slot() is not None else "no such cache: nothing to put back"),
    ]


def default_device_context() -> object | None:
    """The device mode `torch.set_default_device` installed in this thread, or None. Public
    `torch.get_default_device()` answers "cpu" both when none is set and when "cpu" is, and
    only the latter leaves a mode on torch's function-mode stack. Read from
    `torch._GLOBAL_DEVICE_CONTEXT` where this build keeps it; None where it does not."""
    holder = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    return getattr(holder, "device_context", None) if holder is not None else None


def default_device_given() -> torch.device:
    """The default device as `with torch.device(...)` or `torch.set_default_device` gave it
    (its index None where none was given), "cpu" where none is set: what
    `torch.get_default_device()` answers, without the empty tensor that function makes to find
    the index, which a device this build lacks (the virtual device's "cuda") cannot make. The
    innermost of torch's `DeviceContext` modes on the function-mode stack, else the global
    one; where this build has neither name, `torch.get_default_device()` itself."""
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:
        return torch.get_default_device()
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    device = getattr(default_device_context(), "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


# Functional collectives' module, which wraps a collective's result in an AsyncCollectiveTensor
# made on the result's device (runtime/device_mode.py shows it where the result really is).
FUNCTIONAL_COLLECTIVES_MODULE = "torch.distributed._functional_collectives"
