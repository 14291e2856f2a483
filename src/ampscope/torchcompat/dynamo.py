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

While ampscope records, compiled code runs eagerly, whatever it was compiled with. TorchDynamo
compiles no frame while a dispatch mode is active, and `fullgraph=True` then fails ("found no
compiled frames"): `eager_stance` sets the compiler's public "force_eager" stance for the run,
under which TorchDynamo is never entered and that check is not made. `eager_module` is what
`torch.compile(module)` returns during a script's run (runtime/compiled.py): torch's own
`OptimizedModule` (`_orig_mod`, its state_dict keys, `isinstance` checks as the script expects)
whose call runs the module it wraps, so that the module, not the wrapper, is the model a capture
records.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

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


class UncompiledDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode whose subclasses' handlers TorchDynamo skips (see the module)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True makes PyTorch wrap the handler in torch._dynamo.disable; not needed when the
        # handler's code is marked below.
        return _strategy()[0] is None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        mark = _strategy()[0]
        if handler is not None and mark is not None:  # else PyTorch's per-call wrapper stays
            mark(handler.__code__)  # the handler and every frame it calls: never compiled


def eager_stance() -> contextlib.AbstractContextManager:
    """Every compiled function and module runs eagerly in the block (TorchDynamo's
    "force_eager" stance), the stance before it back afterwards. Nothing is done where
    TorchDynamo is not loaded: nothing was compiled then (`torch.compile` loads it), and
    loading it costs seconds. Where this build has no stances, compiled code runs as before:
    eagerly too (its frames are skipped under ampscope's modes), but `fullgraph=True` fails."""
    if "torch._dynamo" not in sys.modules or not hasattr(torch.compiler, "set_stance"):
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


@functools.cache
def _eager_module_class() -> type[nn.Module] | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None

    class EagerOptimizedModule(OptimizedModule):
        """torch.compile's wrapper of a module, whose call runs the module as it is: no
        TorchDynamo, and no module call of its own (module hooks see the module it wraps)."""

        def __call__(self, *args, **kwargs):
            return self.forward(*args, **kwargs)  # the module's call (`eager_module`)

    return EagerOptimizedModule


def eager_module(module: nn.Module, compile_: Callable, *,
                 call: Callable | None = None) -> nn.Module:
    """`module` wrapped as `torch.compile(module)` wraps it, run eagerly: its calls and its
    `forward` run `call` (default: `module`'s own call). `compile_` is torch's own
    `torch.compile` (with the eager backend, it compiles nothing and loads no compiler). Where
    this build has no `OptimizedModule`, or makes something else, `module` itself: eager all
    the same, without `_orig_mod`."""
    cls = _eager_module_class()
    if cls is None:
        return module
    wrapper = compile_(module, backend="eager")
    if not isinstance(wrapper, nn.Module) or type(wrapper) is not cls.__base__:
        return module
    wrapper.__class__ = cls
    # Its own `forward` called directly (TorchDynamo's wrapper of the module's call): the
    # module's call, without TorchDynamo.
    wrapper.forward = call or module.__call__
    return wrapper


def reset() -> None:
    """Forget every compiled graph (between benchmark rungs)."""
    torch._dynamo.reset()


def features() -> list[Feature]:
    mark, why = _strategy()
    stance = hasattr(torch.compiler, "set_stance")
    return [Feature("dynamo frame strategy", mark is not None, why),
            Feature("compiler stance", stance, "torch.compiler.set_stance('force_eager')"
                    if stance else "not on this build: fullgraph=True fails under a run")]
