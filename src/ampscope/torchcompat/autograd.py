"""The autograd engine's state, as the recorders read it during a backward pass."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch

from ampscope.torchcompat.features import Feature

# The id of the backward pass running on this thread, -1 outside one (read on every op).
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
# The autograd node whose backward is running (None outside one).
current_autograd_node: Callable[[], object] = torch._C._current_autograd_node


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward pass ends (the engine's own queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def saved_tensors(node) -> Iterator[torch.Tensor]:
    """The tensors an autograd node holds for its backward.

    Read as the node holds them (`node._raw_saved_x.data`: not unpacked, so no hook, no
    detach, no version check) where this build's SavedTensor has `data` (2.10 and newer);
    elsewhere unpacked (`node._saved_x`), which gives a tensor on the same storage."""
    raw = _raw_data()
    for name in _saved_attributes(type(node)):
        try:
            if raw:
                value = getattr(node, name)
            else:
                value = getattr(node, _unpacked_name(name))
        except RuntimeError:  # already released, or modified in place since
            continue
        for saved in value if isinstance(value, (tuple, list)) else (value,):
            t = getattr(saved, "data", None) if raw else saved
            if isinstance(t, torch.Tensor):
                yield t


_saved_names: dict[type, tuple[str, ...]] = {}


def _saved_attributes(node_type: type) -> tuple[str, ...]:
    """`_raw_saved_self`, `_raw_saved_mat2`, ... (`_raw_saved_tensors` for a custom Function)."""
    names = _saved_names.get(node_type)
    if names is None:
        names = _saved_names[node_type] = tuple(a for a in dir(node_type)
                                                if a.startswith("_raw_saved_"))
    return names


def _unpacked_name(raw: str) -> str:
    """`_raw_saved_self` -> `_saved_self`; a custom Function's `_raw_saved_tensors` ->
    `saved_tensors`."""
    return "saved_tensors" if raw == "_raw_saved_tensors" else raw.replace("_raw_saved_", "_saved_")


@functools.cache
def _raw_data() -> bool:
    """Does a SavedTensor give the tensor it holds (`.data`) without unpacking it?"""
    saved_tensor = getattr(getattr(torch._C, "_autograd", None), "SavedTensor", None)
    return saved_tensor is not None and hasattr(saved_tensor, "data")


def features() -> list[Feature]:
    raw = _raw_data()
    return [
        Feature("autograd engine state", True,
                "the running graph task's id and node, the engine's callback queue"),
        Feature("saved tensors read raw", raw,
                "SavedTensor.data: saved tensors read without unpacking" if raw else
                "no SavedTensor.data on this build: saved tensors are unpacked to be read"),
    ]
