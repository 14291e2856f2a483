"""The dispatcher's Python side: modes, their stack, and the guards that switch them off.

All of these have kept their names and meaning since torch 2.1; they are private only by
their module path. Each is looked up once, at import, and a release that renamed one would
fail here, in one place, with the name that moved.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.overrides import _pop_mode, _push_mode
from torch.utils import _pytree as pytree
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)

from ampscope.torchcompat.features import Feature

__all__ = [
    "OpOverload", "OpOverloadPacket", "TorchDispatchMode", "active_fake_mode",
    "default_device", "disable_torch_dispatch", "op_schema", "dispatch_mode_stack", "dispatch_stack_depth",
    "function_stack_depth", "higher_order", "inner_tensors", "run_decomposed", "is_traceable_wrapper_subclass", "no_dispatch",
    "no_torch_function",
    "pop_function_mode", "proxy_mode_active", "push_function_mode", "pytree", "pytree_children",
]

_C = torch._C
_FAKE = _C._TorchDispatchModeKey.FAKE
_PROXY = _C._TorchDispatchModeKey.PROXY

# Context managers, used as `with no_torch_function():` around metadata reads ampscope makes
# (a function mode above would see every `.dtype` read as a user's call).
no_torch_function: Callable[[], contextlib.AbstractContextManager] = _C.DisableTorchFunction
disable_torch_dispatch: Callable[[], contextlib.AbstractContextManager] = \
    _C._DisableTorchDispatch

# The number of modes on each stack (cheap: no list is built).
dispatch_stack_depth: Callable[[], int] = _C._len_torch_dispatch_stack
function_stack_depth: Callable[[], int] = _C._len_torch_function_stack
# The default device `torch.set_default_device` set, as a string ("cpu" when none).
default_device: Callable[[], str] = _C._get_default_device

push_function_mode = _push_mode
pop_function_mode = _pop_mode


def higher_order(func: object) -> bool:
    """Whether `func` is a higher-order operator (flex_attention, cond, ...), which reaches a
    dispatch mode whose class sets `supports_higher_order_operators` with no arguments' types."""
    return isinstance(func, HigherOrderOperator)


def run_decomposed(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple,
                   kwargs: dict | None):
    """A higher-order operator that reached `mode`: its dense implementation, the one eager
    PyTorch runs without a compiler, with `mode` back on the stack so that each aten op it runs
    reaches the mode as any other; NotImplemented where it has none (PyTorch then says so)."""
    kernel = func.py_kernels.get(_C.DispatchKey.CompositeExplicitAutograd)
    if kernel is None:
        return NotImplemented
    with mode, _Decomposing():
        return kernel(*args, **(kwargs or {}))


class _Decomposing(TorchDispatchMode):
    """Below autograd, where a higher-order operator's implementation runs, composite ops
    (matmul, to) reach the modes whole: this one splits each into the ops it is made of
    (bmm, _to_copy), as autograd's dispatch does everywhere else, so the modes below see the
    ops a device runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, OpOverload) and func.namespace == "aten" and \
                func.has_kernel_for_dispatch_key(_C.DispatchKey.CompositeImplicitAutograd):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The op's signature (its arguments and returns), as torch's own Python reads it."""
    return op._schema


def active_fake_mode():
    """The FakeTensorMode on the dispatch stack, or None (the stack keeps it in a slot of its
    own, so this is one lookup)."""
    return _C._get_dispatch_mode(_FAKE)


def proxy_mode_active() -> bool:
    """Is a tracing (proxy) mode on the stack, as under make_fx or torch.compile's export?"""
    return _C._get_dispatch_mode(_PROXY) is not None


def pytree_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """A pytree structure's children: `children()` where the build has it (2.10 and newer;
    `children_specs` is deprecated there), `children_specs` before."""
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def dispatch_mode_stack() -> list[TorchDispatchMode]:
    """The dispatch modes on the stack, innermost last."""
    return _get_current_dispatch_mode_stack()


@contextlib.contextmanager
def modes_off() -> Iterator[None]:
    """Neither dispatch nor function modes see what runs inside."""
    with disable_torch_dispatch(), no_torch_function():
        yield


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a tensor subclass wraps (a DTensor's local shard, a float8 tensor's data and
    scale), in the order of PyTorch's `__tensor_flatten__` protocol; [] for any other tensor.
    The names the protocol gives may include non-tensors (a DTensor's device mesh, on some
    builds): they are left out."""
    if not is_traceable_wrapper_subclass(t):
        return []
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, name, None) for name in names)
    return [x for x in inner if isinstance(x, torch.Tensor)]


@functools.cache
def _modes_work() -> tuple[bool, str]:
    """Whether a dispatch mode sees the ops run under it, stands on the stack as the readers
    here say, and sees nothing inside `modes_off()`: tried once, on a mode of its own."""
    seen: list[OpOverload] = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    before = dispatch_stack_depth()
    try:
        with Probe():
            stacked = dispatch_stack_depth() == before + 1 and isinstance(
                dispatch_mode_stack()[-1], Probe)
            torch.ones(2).add_(1)
            with modes_off():
                torch.ones(2).add_(1)
    except (RuntimeError, TypeError, AttributeError, IndexError) as e:  # a changed mode API
        return False, f"a dispatch mode cannot be used as expected ({type(e).__name__}: {e})"
    if not stacked:
        return False, "a dispatch mode entered is not on top of the mode stack as read here"
    if torch.ops.aten.add_.Tensor not in seen:
        return False, "a dispatch mode does not see the ops run under it"
    if len([f for f in seen if f is torch.ops.aten.add_.Tensor]) != 1:
        return False, "modes_off() does not hide ops from a dispatch mode"
    return True, "TorchDispatchMode, the mode stack, DisableTorchFunction (exact path)"


def features() -> list[Feature]:
    return [Feature("dispatch modes", *_modes_work(), "every recording")]
