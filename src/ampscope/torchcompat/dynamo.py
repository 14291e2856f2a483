"""TorchDynamo: keeping it out of ampscope's own dispatch handlers, and resetting it.

PyTorch wraps every dispatch mode's `__torch_dispatch__` in `torch._dynamo.disable` (recursive),
so that a `torch.compile`d function running while the mode is active does not try to compile
the handler or anything it calls. The wrapper does that on every op: two Python frames that
switch the eval-frame callback off and back on, about 1 µs (0.6 ms of a gpt2-tiny train step's
567 ops, benchmarks/bench_overhead.py). `UncompiledDispatchMode` asks the same of TorchDynamo
once per handler instead: the handler's code object is marked to run, with every frame it
calls, without the callback (TorchDynamo's per-code execution strategy, SKIP for the frame and
its callees), and PyTorch is told not to wrap it (`_should_skip_dynamo`, the opt-out it gives
dispatch modes). Where this build cannot mark code, PyTorch's wrapper stays (exact, a
microsecond an op slower). tests/test_modes.py traces a compiled model under it: the eager
model's ops, and no frame compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ampscope.torchcompat.dispatch import TorchDispatchMode
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


class UncompiledDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode whose subclasses' handlers TorchDynamo skips (see the module)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True makes PyTorch wrap the handler in torch._dynamo.disable; not needed when the
        # handler's code is marked below.
        return not can_skip_frames()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is not None:
            skip_frames_of(handler)


def reset() -> None:
    """Forget every compiled graph (between benchmark rungs)."""
    torch._dynamo.reset()


def features() -> list[Feature]:
    mark, why = _strategy()
    return [Feature("dynamo frame strategy", mark is not None, why)]
