"""`torch.load(path, map_location="cuda")` on the virtual device: the checkpoint's tensors are
read onto the backing device (the CPU, or meta while a model is built for a predicted run) and
are on the target, as user code sees them, exactly as a tensor made there is.

torch.load restores each storage through its map_location (a device name, a `torch.device`, a
dict of saved location to location, a function of the storage and its saved location) or, with
none, the location it was saved from (a checkpoint saved on a GPU names "cuda:0"). On a build
without the device that restore fails inside torch.cuda. Here every location that names the
target restores on the backing device instead, and the tensors rebuilt on those storages are
left untagged by the device mode (on the target); every other location is torch's own
`default_restore_location`. A map_location function that moves the storage itself
(`storage.cuda()`, `storage.to("cuda")`) gets the same restore.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampscope.patches import patched
from ampscope.runtime.device_mode import DeviceMode


def load_patches(mode: DeviceMode) -> list[tuple[object, str, object]]:
    """(owner, name, value): `torch.load`, and `torch.serialization.load` where it is the same
    function (libraries call either)."""
    original = torch.load

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        with mode.restoring():
            return original(f, _restorer(map_location, mode), *args, **kwargs)

    load.__doc__ = original.__doc__
    patches: list[tuple[object, str, object]] = [(torch, "load", load)]
    if torch.serialization.load is original:
        patches.append((torch.serialization, "load", load))
    return patches


def _restorer(map_location: Any, mode: DeviceMode) -> Callable:
    """torch.load's restore of one storage (torch.serialization's private restore-location
    helper and `default_restore_location`), with the target's locations restored on the backing device."""

    def restore(storage: torch.UntypedStorage, location: str) -> Any:
        where: Any = location
        if isinstance(map_location, dict):
            where = map_location.get(location, location)
        elif isinstance(map_location, bytes):
            where = map_location.decode()
        elif isinstance(map_location, (str, torch.device)):
            where = str(map_location)
        elif map_location is not None:
            with _storage_moves(mode):
                result = map_location(storage, location)
            if result is not None:
                return result
        if mode.is_target(where):
            return _on_target(storage, where, mode)
        return torch.serialization.default_restore_location(storage, where)

    return restore


def _on_target(storage: torch.UntypedStorage, where: Any, mode: DeviceMode) -> Any:
    """`storage` restored on the target device (index 0, its only one): on the backing device,
    and known to the device mode as the target's."""
    index = torch.device(where).index
    if index not in (None, 0):  # torch's own message for a device the machine lacks
        raise RuntimeError(
            f"Attempting to deserialize object on {mode.target.upper()} device {index} but "
            f"torch.{mode.target}.device_count() is 1. Please use torch.load with map_location "
            "to map your storages to an existing device.")
    if storage.device != mode.backing:  # meta, while a predicted run's model is built
        storage = torch.UntypedStorage(storage.nbytes(), device=mode.backing)
    mode.restored_on_target(storage)
    return storage


@contextlib.contextmanager
def _storage_moves(mode: DeviceMode) -> Iterator[None]:
    """`storage.cuda()` and `storage.to(device="cuda")` in a map_location function: the storage
    restored on the target (torch's own move would need the device)."""
    untyped = torch.UntypedStorage
    original_to = untyped.to

    def to_target(self: torch.UntypedStorage, device: Any = None,
                  non_blocking: bool = False) -> Any:
        where = device if isinstance(device, (str, torch.device)) else \
            torch.device(mode.target, device or 0)
        return _on_target(self, where, mode)

    def to(self: torch.UntypedStorage, *, device: Any, non_blocking: bool = False) -> Any:
        if mode.is_target(device):
            return _on_target(self, device, mode)
        return original_to(self, device=device, non_blocking=non_blocking)

    with contextlib.ExitStack() as stack:
        if hasattr(untyped, mode.target):
            stack.enter_context(patched(untyped, mode.target, to_target))
        stack.enter_context(patched(untyped, "to", to))
        yield
