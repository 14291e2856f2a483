"""TorchDynamo: keeping it out of ampscope's own dispatch handlers, and resetting it.

PyTorch wraps every dispatch mode's `__torch_dispatch__` in `torch._dynamo.disable`, so that a
compiled function running under the mode does not compile the handler: two extra Python frames
on every op. Where the build has TorchDynamo's per-code execution strategy, a handler's code
can be marked once to run, with every frame it calls, without the eval-frame callback
(`skip_frames_of`), and the mode can tell PyTorch not to wrap it. Where it does not, PyTorch's
wrapper stays (exact, a microsecond an op slower).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ampscope.torchcompat.features import Feature


@functools.cache
def _strategy() -> tuple[Callable | None, str]:
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError as e:
        return None, f"not on this build ({e})"
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)  # this frame, its callees

    def mark(code) -> None:
        set_code_exec_strategy(code, skip)

    return mark, "TorchDynamo's per-code execution strategy"


def can_skip_frames() -> bool:
    """Can a handler's code be marked never to be compiled (`skip_frames_of`)?"""
    return _strategy()[0] is not None


def skip_frames_of(handler: Callable) -> bool:
    """Mark `handler`'s code, and every frame it calls, never to be compiled; False where this
    build cannot (the caller then keeps PyTorch's per-call wrapper)."""
    mark = _strategy()[0]
    if mark is None:
        return False
    mark(handler.__code__)
    return True


def reset() -> None:
    """Forget every compiled graph (between benchmark rungs)."""
    torch._dynamo.reset()


def features() -> list[Feature]:
    mark, why = _strategy()
    return [Feature("dynamo frame strategy", mark is not None, why)]
