"""Fake results of per-parameter ops FakeTensorMode answers slowly and never from its cache,
made without its dispatch.

An optimizer's Python loop makes each parameter's step counter (`torch.tensor(0.0)`, a
`lift_fresh`) and reads it back with `.item()` twice a step; the autograd engine detaches each
gradient as it stores it. On a 70B Llama that is about 3,700 ops, at 30 to 150 µs each through
FakeTensorMode (ops it does cache are answered from it: runs/fake_cache.py). In a predicted run
(by the switch that thins foreach ops) the op recorder answers them itself (`answer`), each as
FakeTensorMode would, a lift without the cache lookup the mode tries and gives up on first:
docs/how-it-works.md#per-parameter-ops-answered-without-faketensormode has the table. The
recorders see these ops as any other: the op, its inputs and its result are the same.
"""

from __future__ import annotations

import torch

from ampscope.runs.foreach import NOT_THINNED
from ampscope.runs.tensor_meta import no_torch_function
from ampscope.runtime.predict import new_fake, wrap_fake
from ampscope.torchcompat import ops as private_ops
from ampscope.torchcompat.dispatch import OpOverload, active_fake_mode, no_dispatch
from ampscope.torchcompat.fake import (
    FakeTensor,
    converter_memos,
    in_kernel_invocation_manager,
    remember_constant,
)

aten = torch.ops.aten
_ITEM = private_ops.LOCAL_SCALAR_DENSE
# Ops whose result is a new tensor object on the input's storage, made by the meta kernel
# alone: a detach, and the reshape of a tensor autograd does not track as a view.
_ALIASES = frozenset({aten.detach.default, private_ops.UNSAFE_VIEW})
_LIFT = aten.lift_fresh.default
OPS = _ALIASES | {_ITEM, _LIFT}


def answer(func: OpOverload, args: tuple, kwargs: dict):
    """The result of one of `OPS`, or NOT_THINNED (as foreach's) where it has to be
    dispatched."""
    t = args[0] if args else None
    if func is _LIFT:
        return _constant(t) if len(args) == 1 and not kwargs else NOT_THINNED
    if type(t) is not FakeTensor or t.fake_mode.in_kernel_invocation:
        return NOT_THINNED
    if func is _ITEM:
        if t.constant is None:
            return NOT_THINNED
        with no_dispatch():
            return func(t.constant)
    if t.constant is not None:
        return NOT_THINNED
    with in_kernel_invocation_manager(t.fake_mode):  # one of _ALIASES
        alias = func(*args, **kwargs)
    return wrap_fake(t.fake_mode, alias, t.fake_device)


def _constant(t) -> object:
    """A small real tensor made fake, as FakeTensorMode makes the result of a lift: a fake
    constant holding a copy of it.

    The converter's general path describes the tensor in full to convert it (a tenth of a
    millisecond); a fresh dense copy needs none of that. A tensor the converter would carry
    more over for (autograd, conjugate or negative bits, a layout other than strided) is left
    to it."""
    mode = active_fake_mode()
    if mode is None or type(t) is not torch.Tensor or not converter_memos():
        return NOT_THINNED
    with no_torch_function():
        if (not mode.may_turn_const(t) or t.requires_grad or t.layout != torch.strided
                or t.is_conj() or t.is_neg()):
            return NOT_THINNED
        with no_dispatch():
            copy = t.clone()
        fake = new_fake(mode, tuple(copy.shape), copy.stride(), copy.dtype, copy.device,
                        constant=copy)
        # Entered in the converter's books as its own conversion enters it (the module's
        # docstring says why); an op that makes a view of it no constant must find this fake
        # tensor to stop following it too.
        remember_constant(mode, copy, fake)
        return fake
