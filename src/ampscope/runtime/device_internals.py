"""What torch asks below its public device API, answered for the virtual device: which
accelerator the build has, and on which device a tensor subclass that wraps others is made.

- **The accelerator.** torch's own code asks its private accelerator query (devices.py's
  `accelerator_query`) where it does not go through `torch.accelerator` (which
  virtual_device.py answers): FSDP2's `fully_shard` without a mesh builds its default mesh
  on that device type, and a CPU build answers "cpu", so a script that moved its model to
  "cuda" would be refused ("Expects the parameter to already be moved to device cpu"). It
  answers the target here. One caller keeps the real answer: a process group made without a
  backend (`init_device_mesh` before any `init_process_group`) picks the accelerator's
  default backend and binds it to that device type only; the ranks' tensors live on the CPU,
  so its choice (`BackendConfig`) still sees the CPU and picks gloo for it, as it did before.
- **Tensor subclasses.** A subclass that wraps tensors (DTensor, torchao's float8 weight) is
  made with Tensor's private wrapper-subclass constructor (devices.py's
  `wrapper_subclass_maker`) and `device=inner.device`, and the device mode answers
  `inner.device` with the target: the wrapper would claim a CUDA device on a build without
  CUDA, and `copy_` into it fails ("PyTorch is not linked with support for cuda devices": it
  asks for CUDA's device guard before the subclass's own dispatch runs). It is made on the
  backing device, as its inner tensors are; the device mode reports the target for it as for
  any tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampscope.runtime.device_mode import DeviceMode
from ampscope.runtime.device_rng import philox_state
from ampscope.torchcompat import devices
from ampscope.torchcompat.distributed import c10d_module, dtensor_rng_state_reader

Patches = list[tuple[object, str, object]]


def internal_patches(mode: DeviceMode, target: str) -> Patches:
    """The replacements for a run on the virtual device `target` (see the module docstring);
    only those this build has details for."""
    patches: Patches = []
    query = devices.accelerator_query()
    if query is not None:
        patches += _accelerator(query, target)
    maker = devices.wrapper_subclass_maker()
    if maker is not None:
        owner, name, make = maker
        patches.append((owner, name, staticmethod(_on_backing(mode, make))))
    reader = dtensor_rng_state_reader()
    if reader is not None:
        # DTensor's random ops read the device generator's state as Philox's (seed, offset)
        # and move it to the device, inside its own dispatch where no mode of the run is
        # active: the virtual device's generator is the CPU's, so the state is a Philox one
        # made for it, on the CPU (where DTensor gives it back to the generator anyway).
        patches.append((*reader, lambda self: philox_state()))
    return patches


def _accelerator(query: tuple[object, str], target: str) -> Patches:
    owner, name = query
    real = getattr(owner, name)
    choosing = [0]  # > 0 while a process group chooses its default backend

    def accelerator(check: bool = False) -> torch.device:
        return real(check) if choosing[0] else torch.device(target)

    patches: Patches = [(owner, name, accelerator)]
    c10d = c10d_module()
    config = getattr(c10d, "BackendConfig", None) if c10d is not None else None
    if config is not None and "__init__" in vars(config):
        original = config.__init__

        def __init__(self, *args, **kwargs) -> None:
            choosing[0] += 1
            try:
                original(self, *args, **kwargs)
            finally:
                choosing[0] -= 1

        patches.append((config, "__init__", __init__))
    return patches


def _on_backing(mode: DeviceMode, make: Callable) -> Callable:
    """The wrapper-subclass constructor `make`, with a target `device=` made on the backing
    device instead."""

    def make_wrapper(cls, *args, **kwargs):
        if mode.is_target(kwargs.get("device")):
            kwargs["device"] = mode.backing
        return make(cls, *args, **kwargs)

    return make_wrapper
