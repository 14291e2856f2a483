"""The autograd engine's state, as the recorders read it during a backward pass."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from ampscope.torchcompat.features import Feature

# The id of the backward pass running on this thread, -1 outside one (read on every op).
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
class AutogradNode(Protocol):
    """What the recorders read of an autograd node: its name ("AddmmBackward0")."""

    def name(self) -> str: ...


# The autograd node whose backward is running (None outside one).
current_autograd_node: Callable[[], AutogradNode | None] = torch._C._current_autograd_node


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward pass ends (the engine's own queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def saved_tensors(node) -> Iterator[torch.Tensor]:
    """The tensors an autograd node holds for its backward.

    Read as the node holds them (`node._raw_saved_x.data`: not unpacked, so no hook, no
    detach, no version check) where this build's SavedTensor has `data` (2.10 and newer).
    Elsewhere they are unpacked (`node._saved_x`, a tensor on the same storage); a tensor saved
    through hooks (activation checkpointing's) may refuse that: `UnreadableSaved` is raised."""
    raw = _raw_data()
    for name in _saved_attributes(type(node)):
        try:
            value = getattr(node, name if raw else _unpacked_name(name))
        except RuntimeError:  # already released, or modified in place since
            continue
        # A saved-tensor hook is the user's code (activation checkpointing's, an offloading
        # one) and may refuse with any exception: turned into the narrow one callers handle.
        except Exception as e:  # any hook's refusal, raised again as the narrow UnreadableSaved
            raise UnreadableSaved(f"{type(e).__name__}: {e}") from e
        for saved in value if isinstance(value, (tuple, list)) else (value,):
            t = getattr(saved, "data", None) if raw else saved
            if isinstance(t, torch.Tensor):
                yield t


def saving_through_hooks() -> bool:
    """Are saved-tensor hooks in force here (activation checkpointing's), so that what autograd
    saves now would be unpacked through them?"""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class UnreadableSaved(Exception):
    """A saved tensor that cannot be read without unpacking it through its hooks."""


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


def reads_saved_raw() -> bool:
    """Can `saved_tensors` read saved tensors without unpacking them (a SavedTensor's `.data`,
    torch 2.10 and newer)? One detection a process, `_raw_data`."""
    return _raw_data()


@functools.cache
def _raw_data() -> bool:
    saved_tensor = getattr(getattr(torch._C, "_autograd", None), "SavedTensor", None)
    return saved_tensor is not None and hasattr(saved_tensor, "data")


@functools.cache
def _engine_state_readable() -> tuple[bool, str]:
    """Whether the readers above tell a backward pass as the recorders assume: no graph task
    and no node outside one; inside a custom Function's backward, a task id, that Function's
    node, and a queued callback run before the pass ends. Tried once, on a backward of its own."""
    if graph_task_id() != -1 or current_autograd_node() is not None:
        return False, "the engine reports a backward pass where none runs"
    seen: dict[str, object] = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            node = current_autograd_node()
            seen["task"], seen["node"] = graph_task_id(), node.name() if node else None
            def called() -> None:
                seen["callback"] = graph_task_id()

            queue_engine_callback(called)
            return grad * 2

    try:
        with torch.enable_grad():
            Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    except (RuntimeError, TypeError, AttributeError) as e:  # a changed engine API
        return False, f"the engine's state cannot be read as expected ({type(e).__name__}: {e})"
    task = seen.get("task")
    if not isinstance(task, int) or task == -1 or seen.get("node") != "ProbeBackward":
        return False, f"a backward pass reads as {seen} (no task id or node)"
    if seen.get("callback") != task:
        return False, "a callback queued on the engine did not run before its pass ended"
    return True, "the running graph task's id and node, the engine's callback queue"


def features() -> list[Feature]:
    raw = _raw_data()
    return [
        Feature("autograd engine state", *_engine_state_readable(),
                "backward pass phases and autograd nodes in every recording"),
        Feature("saved tensors read raw", raw,
                "SavedTensor.data: saved tensors read without unpacking" if raw else
                "no SavedTensor.data on this build: saved tensors are unpacked to be read"),
    ]


def write_count(t: torch.Tensor) -> int:
    """Autograd's counter of writes to `t` (shared with its views); -1 where it keeps none (an
    inference tensor) or this build has no such counter: never taken as unchanged."""
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return -1
