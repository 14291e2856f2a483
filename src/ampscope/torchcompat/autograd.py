"""The autograd engine's state, as the recorders read it during a backward pass."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampscope.torchcompat.features import Feature

# The id of the backward pass running on this thread, -1 outside one (read on every op).
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
# The autograd node whose backward is running (None outside one).
current_autograd_node: Callable[[], object] = torch._C._current_autograd_node


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward pass ends (the engine's own queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def features() -> list[Feature]:
    return [Feature("autograd engine state", True,
                    "the running graph task's id and node, the engine's callback queue")]
