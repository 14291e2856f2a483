"""`torch.compile` during a run: the compiled code runs eagerly, and the trace says so.

ampscope records every op as it runs; compiled code would run as fused kernels it cannot see
(and TorchDynamo compiles nothing while a dispatch mode is active anyway). During a run,
`torch.compile` returns what it wraps, run as it is, in every form a script writes it: the
decorator (`@torch.compile`, `@torch.compile(fullgraph=True, mode="max-autotune")`), a
function (`torch.compile(fn, dynamic=True)`), a module (`torch.compile(model)`, whose result is
torch's own module wrapper, so its wrapped module and state_dict keys are as the script expects),
and `model.compile()` (which calls `torch.compile` on the module's call). Every option,
`fullgraph=True` and `backend=` included, is accepted and has no effect: nothing is compiled.
Code compiled before the run (a library's `@torch.compile` at import) runs eagerly through the
capture's compiler stance (torchcompat/dynamo.py `eager_stance`).

What runs inside code compiled with Inductor (the default backend) is marked: `in_compiled()`
is true while such a function or module runs, and the op recorder marks its ops `compiled`
(runs/ops.py), those of its backward too, so that the step-time model costs them as Inductor's
fused kernels (analysis/fusion.py). Another backend ("eager", "aot_eager", a callable) fuses
nothing: its code is not marked.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ampscope.patches import patched
from ampscope.torchcompat.dynamo import eager_module

# The note a run that compiled something carries.
# Inductor (torch.compile's default backend) computes a fused chain of 16-bit elementwise ops
# in float32 and rounds once at its end, where eager rounds after every op.
COMPILE_NOTE = ("torch.compile was called: the run was eager. Compiled code keeps these "
                "dtypes between kernels, but inductor fuses elementwise ops and computes inside "
                "each fused kernel in float32 (a bfloat16 or float16 chain rounds once, not "
                "after each op), so its values differ slightly from eager's; it may also keep "
                "fewer activations for backward.")


_depth = 0  # how many Inductor-compiled calls are running now


def in_compiled() -> bool:
    """Whether code compiled with Inductor is running (its ops would be fused kernels)."""
    return _depth > 0


def _marked(fn: Callable) -> Callable:
    """`fn`, its calls marked as compiled code's while they run."""

    @functools.wraps(fn)
    def compiled(*args, **kwargs):
        global _depth
        _depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth -= 1

    return compiled


@contextlib.contextmanager
def compiled_forward(model: nn.Module) -> Iterator[None]:
    """`model` run in the block as `torch.compile(model)` runs it under ampscope (eagerly, its
    ops marked as compiled code's): the `+compile` part of a setting."""
    with patched(model, "forward", _marked(model.forward)):
        yield


def _fuses(options: dict) -> bool:
    """Whether `torch.compile(..., **options)` compiles with Inductor, which fuses kernels."""
    return options.get("backend", "inductor") == "inductor"


# The note of a run whose setting has +compile.
SETTING_COMPILE_NOTE = ("+compile: the model ran eagerly as torch.compile(model) runs under "
                        "ampscope, its ops marked compiled: a predicted step costs them as "
                        "Inductor's fused kernels; values are eager's (inductor rounds a fused "
                        "16-bit chain once).")


class EagerCompile:
    """`torch.compile`, replaced for a run. `on_wrapper` is told of each module wrapper it
    makes (a script's run keeps it from being taken for the model: the model is what it
    wraps)."""

    def __init__(self, on_wrapper: Callable[[nn.Module], None] | None = None) -> None:
        self.called = False
        self.on_wrapper = on_wrapper
        self._torch_compile = torch.compile  # torch's own, as this object is made

    def compile(self, model=None, **options):
        """`torch.compile(model, **options)` as the run answers it: `model`, eager."""
        self.called = True
        if model is None:  # @torch.compile(...) as a decorator factory
            return lambda fn: self.compile(fn, **options)
        fuses = _fuses(options)
        if isinstance(model, nn.Module):
            wrapper = eager_module(model, self._torch_compile,
                                   call=_marked(model.__call__) if fuses else None)
            if wrapper is not model and self.on_wrapper is not None:
                self.on_wrapper(wrapper)
            return wrapper
        if not callable(model):
            return self._torch_compile(model, **options)  # torch's own error for it

        if fuses:
            return _marked(model)

        @functools.wraps(model)
        def compiled(*args, **kwargs):
            return model(*args, **kwargs)

        return compiled

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with patched(torch, "compile", self.compile):
            yield

    def notes(self) -> list[str]:
        return [COMPILE_NOTE] if self.called else []
