"""Values, not just dtypes: what each module returned, each gradient, each weight, for numerics.

Dtype traces hold no tensors; numerics needs the numbers. `ValueRecorder` keeps, for one run,
a float64 CPU copy of the first floating output of every module call (in call order, per module
name), the loss, and — read by the caller after backward — gradients and weights. Copies in
float64 so that comparing against a float64 reference loses nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ampscope.records import Phase, dtype_name
from ampscope.records.fp8 import FP8_DTYPES, GemmRoles
from ampscope.runs.modules import ModuleTracker, in_backward
from ampscope.torchcompat import ops as private_ops
from ampscope.torchcompat.dispatch import TorchDispatchMode, inner_tensors


def _first_floating(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_floating(v)
            if found is not None:
                return found
    if isinstance(value, dict) or hasattr(value, "values"):  # HF ModelOutput is a dict
        try:
            return _first_floating(list(value.values()))
        except TypeError:
            return None
    return None


def as_float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64, copy=True)


@dataclass
class Values:
    """One run's numbers, float64 on the CPU."""

    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # module → per call
    types: dict[str, str] = field(default_factory=dict)  # module → class name
    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter → its gradient
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter → value used
    fp8_casts: list[CastValues] = field(default_factory=list)  # in the order they ran


@dataclass
class CastValues:
    """One cast into fp8, counted on the real tensors: the high-precision tensor, the scale the
    recipe computed for it (one number, or one per row) and the fp8 values it became."""

    module: str | None
    phase: str
    dtype: str  # the fp8 format
    scales: int  # numbers in the scale: 1 tensorwise, one per row or column rowwise
    numel: int
    nonzero: int  # values ≠ 0 before the cast
    saturated: int  # |x · scale| above the format's max: clamped to it
    underflow: int  # ≠ 0 before the cast, 0 after it (below half the smallest subnormal)
    role: str | None = None  # "input", "weight", "output gradient"; None: used by no matmul


@contextmanager
def recording_values(model: nn.Module, *, fp8: bool = False) -> Iterator[Values]:
    """Record every module's output during the body; with `fp8`, every cast into fp8 too. The
    hooks and the mode are removed afterwards, also when the body raises."""
    names = {m: n for n, m in model.named_modules()}
    values = Values()

    def hook(module, args, output):
        name = names.get(module)
        if name is None:
            return
        t = _first_floating(output)
        if t is not None:
            values.outputs.setdefault(name, []).append(as_float64(t))
            values.types.setdefault(name, type(module).__name__)

    with ExitStack() as stack:
        if fp8:
            weights = {n.removesuffix(".weight"): tuple(p.shape)
                       for n, p in model.named_parameters()}
            tracker = stack.enter_context(ModuleTracker(dict(names)))
            stack.enter_context(_Fp8Casts(values.fp8_casts, tracker, weights))
        stack.callback(nn.modules.module.register_module_forward_hook(hook).remove)
        yield values


def read_weights(model: nn.Module, values: Values) -> None:
    """The weights the run starts from (its working copies, in the setting's dtype)."""
    for name, p in model.named_parameters():
        values.weights[name] = as_float64(p)


def read_grads(model: nn.Module, values: Values) -> None:
    """Gradients after backward, before the working copies are restored."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            values.grads[name] = as_float64(p.grad)


_MUL, _CLAMP, _CAST = (torch.ops.aten.mul.Tensor, torch.ops.aten.clamp.default,
                       private_ops.TO_COPY)


class _Fp8Casts(TorchDispatchMode):
    """Counts what each dynamically scaled cast into fp8 does to its values.

    torchao's cast (records/fp8.py) runs `x · scale` in float32, clamps it to the format's
    range and converts: the `mul` gives the high-precision tensor and its scale, the `_to_copy`
    into a float8 dtype the fp8 values. A matmul whose operand holds those values (a wrapper
    subclass's inner tensor) tells the cast's role.
    """

    def __init__(self, out: list[CastValues], tracker: ModuleTracker,
                 weights: dict[str, tuple[int, ...]]):
        super().__init__()
        self._out, self._tracker, self._weights = out, tracker, weights
        self._scaled: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # storage of fp8 values not yet seen in a matmul → (index in `out`, the values: kept
        # alive, so that no other tensor takes the storage meanwhile)
        self._bits: dict[int, tuple[int, torch.Tensor]] = {}
        self._roles = GemmRoles()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _MUL and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args):
            x, scale = args
            # the scaling mul: float32 tensor times a smaller float32 scale
            self._scaled = ((out, x, scale) if x.dtype == scale.dtype == torch.float32
                            and scale.numel() < x.numel() else None)
        elif func is _CLAMP and self._scaled is not None and args[0] is self._scaled[0]:
            self._scaled = (out, *self._scaled[1:])
        elif (func is _CAST and dtype_name(out.dtype) in FP8_DTYPES
              and self._scaled is not None and args[0] is self._scaled[0]):
            self._count(out, *self._scaled[1:])
            self._scaled = None
        elif self._bits and func.overloadpacket is torch.ops.aten.mm:
            self._roles_of(args, out)
        return out

    def _count(self, bits: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
        fmax = torch.finfo(bits.dtype).max
        nonzero = x != 0
        backward = in_backward()
        self._bits[bits.untyped_storage().data_ptr()] = (len(self._out), bits)
        self._out.append(CastValues(
            module=self._tracker.current_in(backward),
            phase=Phase.BACKWARD if backward else Phase.FORWARD,
            dtype=dtype_name(bits.dtype), scales=scale.numel(), numel=x.numel(),
            nonzero=int(nonzero.sum()),
            saturated=int(((x * scale).abs() > fmax).sum()),
            underflow=int((nonzero & (bits.float() == 0)).sum()),
        ))

    def _roles_of(self, args, out: torch.Tensor) -> None:
        operands = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        found = [self._cast_of(a) for a in operands]
        if len(operands) != 2 or all(i is None for i in found):
            return
        first = self._out[next(i for i in found if i is not None)]
        roles = self._roles.of(first.phase, first.module, tuple(operands[0].shape),
                               tuple(out.shape), self._weights.get(first.module or ""))
        for i, role in zip(found, roles, strict=True):
            if i is not None:
                self._out[i].role = role

    def _cast_of(self, t: torch.Tensor) -> int | None:
        """The cast whose fp8 values a matmul operand holds, or a view of them (`.t()`,
        `.reshape()`): the same storage."""
        inner = next(iter(inner_tensors(t)), None)
        if inner is None or dtype_name(inner.dtype) not in FP8_DTYPES:
            return None
        found = self._bits.pop(inner.untyped_storage().data_ptr(), None)  # each feeds one matmul
        return found[0] if found is not None else None
