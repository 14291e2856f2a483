"""Constants in the code that the format an op computes in cannot hold: too large (AMP301), or
so small that they round to 0 (AMP302). They are read off the ops' Python number arguments
(OpCall.scalars): `scores.masked_fill(mask, -1e9)`, `x.pow(2).mean(-1) + 1e-12`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import cache
from typing import NamedTuple

import torch

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import HALF, count, op_name, where
from ampscope.records import OpCall, Phase, Trace
from ampscope.torchcompat.ops import FOREACH_PREFIX

# The ops, by name without overload, whose number argument stands for a value of the format
# the op computes in. Those that store it: the CPU and CUDA kernels convert it with a range
# check (`Scalar::to<T>`), so one that does not fit raises there; fake tensors' meta kernels do
# not check, so a predicted run goes on. `scalar_tensor` is how `torch.where(m, x, -1e9)` makes
# its constant, unchecked.
_BOUNDS = frozenset({"clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_"})
_CHECKED = _BOUNDS | {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like",
                      "new_full", "index_fill", "index_fill_", "constant_pad_nd"}
_STORED = _CHECKED | {"scalar_tensor", "where"}
# Those that add it (one tensor operand: with two, the number is `alpha`, a factor).
_ADDITIVE = frozenset({"add", "add_", "sub", "sub_", "rsub"})
_FOREACH_ADDITIVE = frozenset(FOREACH_PREFIX + n for n in ("add", "add_", "sub", "sub_",
                                                          "clamp_min", "clamp_min_"))
# Those that multiply by it: too large a factor is overflow for about every operand. Not for
# AMP302: the kernels keep a factor in float32 (their opmath), so what rounds is the product,
# which depends on the data; a tiny factor alone is no mistake.
_SCALING = frozenset({"mul", "mul_"})

# c10's name for a dtype in "value cannot be converted to type c10::Half without overflow".
_C10_NAMES = {"float16": "c10::Half", "bfloat16": "c10::BFloat16", "float32": "float",
              "float64": "double"}


@cache
def _finfo(dtype: str) -> torch.finfo | None:
    """torch.finfo of a floating dtype by name; None for any other dtype."""
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        return None
    return torch.finfo(found)


def _info(dtype: str) -> torch.finfo:
    """torch.finfo of a dtype `_computes_in` returned (a floating one)."""
    info = _finfo(dtype)
    assert info is not None
    return info


def _computes_in(op: OpCall) -> str | None:
    """The floating dtype the op's number meets: its result's, else its first floating
    input's (an in-place foreach op returns nothing)."""
    return next((m.dtype for m in (*op.outputs, *op.inputs) if _finfo(m.dtype) is not None),
                None)


def _constants(op: OpCall, *, scaling: bool) -> tuple[str, tuple[float, ...]]:
    """What the op does with its numbers ("stores", "clamps to", "adds", "scales by"; "" when
    none of its numbers is a value of its format) and those numbers."""
    if not op.scalars:
        return "", ()
    name = op_name(op)
    if name in _STORED:
        return "clamps to" if name in _BOUNDS else "stores", op.scalars
    if name in _ADDITIVE and len(op.inputs) == 1:
        return "adds", op.scalars[:1]
    if name in _FOREACH_ADDITIVE and op.op.endswith(".Scalar"):
        return "adds", op.scalars[:1]
    if scaling and name in _SCALING and len(op.inputs) == 1:
        return "scales by", op.scalars[:1]
    return "", ()


class _Found(NamedTuple):
    op: OpCall  # the first of `ops`
    how: str  # as _constants says
    value: float
    dtype: str
    ops: list[OpCall]  # every op on the same line with the same value (one per block)

    @property
    def name(self) -> str:
        return ".".join(self.op.op.split(".")[:2])  # "aten.masked_fill"


def _found(trace: Trace, *, scaling: bool, hit: Callable[[float, str], bool]) -> list[_Found]:
    """The constants for which `hit(value, dtype)` holds, one entry per source line, op, value
    and dtype (a block's line runs once per block)."""
    groups: dict[tuple, _Found] = {}
    for op in trace.ops:
        how, values = _constants(op, scaling=scaling)
        dtype = _computes_in(op) if how else None
        if dtype is None:
            continue
        for value in values:
            if hit(value, dtype):
                key = (op.source, op.op, value, dtype)
                groups.setdefault(key, _Found(op, how, value, dtype, [])).ops.append(op)
    return list(groups.values())


def _modules(ops: list[OpCall]) -> str:
    """"12 calls, in modules h.0.attn, h.1.attn, h.2.attn and 9 more" (a block's line runs
    once per block)."""
    names = list(dict.fromkeys(o.module for o in ops))
    real = [n for n in names if n]
    parts = ["in the model"] if "" in names else []
    if real:
        shown = ", ".join(real[:3]) + (f" and {len(real) - 3} more" if len(real) > 3 else "")
        parts.append(f"in {'module' if len(real) == 1 else 'modules'} {shown}")
    if None in names:
        parts.append("outside any module")
    return f"{count(len(ops), 'call')}, {'; '.join(parts)}"


def _number(x: float, digits: int = 6) -> str:
    return f"{x:.{digits}g}"


@rule("AMP301", "constant-overflows", "error",
      "a constant beyond the largest finite value of the format the op computes in")
def constant_overflows(trace: Trace) -> Iterator[Hit]:
    def overflows(value: float, dtype: str) -> bool:
        # inf and -inf are values of every floating format: a deliberate -inf mask is no hit.
        return math.isfinite(value) and abs(value) > _info(dtype).max

    for f in _found(trace, scaling=True, hit=overflows):
        limit = _number(_info(f.dtype).max)
        if f.name.split(".")[1] in _CHECKED:
            consequence = (f"{f.name} converts the value to {f.dtype} with a range check: on "
                           "CUDA (and on the CPU) it raises RuntimeError: value cannot be "
                           f"converted to type {_C10_NAMES.get(f.dtype, f.dtype)} without "
                           "overflow (fake tensors do not check it: a predicted run goes on)")
        else:
            consequence = (f"the value is {'-' if f.value < 0 else ''}inf in {f.dtype}: where "
                           "it masks attention scores, a row masked in full is all -inf and "
                           "its softmax is NaN (0/0), and inf - inf is NaN in any later sum")
        yield Hit(
            f"{_number(f.value)} does not fit {f.dtype} (largest finite value {limit}): "
            f"{where(f.op)}.",
            (f"{f.name} on {f.dtype} {f.how} the constant {_number(f.value)}; "
             f"torch.finfo(torch.{f.dtype}).max is {limit}", _modules(f.ops)),
            consequence,
            f"use a value the format holds: torch.finfo(x.dtype).{'min' if f.value < 0 else 'max'}"
            " of the tensor the constant meets (scores.masked_fill(mask, "
            f"torch.finfo(scores.dtype).min)), {'-' if f.value < 0 else ''}float('inf') where "
            "no row can be masked in full, or compute this part in float32",
            f.op.source)


@rule("AMP302", "constant-vanishes", "warning",
      "a nonzero constant that rounds to 0 in the float16 or bfloat16 an op computes in")
def constant_vanishes(trace: Trace) -> Iterator[Hit]:
    def vanishes(value: float, dtype: str) -> bool:
        # Up to half the smallest subnormal rounds to 0 (to nearest, ties to even); above
        # that it rounds to a subnormal, which still keeps a denominator off 0.
        info = _info(dtype)
        return dtype in HALF and value != 0 and abs(value) <= info.tiny * info.eps / 2

    for f in _found(trace, scaling=False, hit=vanishes):
        info = _info(f.dtype)
        smallest = _number(info.tiny * info.eps, 3)
        holds = (f"torch.finfo(x.dtype).eps ({_number(info.eps, 3)}) or torch.finfo(x.dtype)"
                 f".tiny ({_number(info.tiny, 3)})")
        if f.op.phase == Phase.OPTIMIZER:  # the optimizer's eps, on 16-bit state
            at = where(f.op) + ("" if f.op.source else ", in the optimizer step")
            consequence = (
                "the optimizer's eps does nothing: its denominator (Adam's sqrt(v) + eps) is "
                f"sqrt(v), and where v is 0 (a zero gradient, or one whose square underflows "
                f"{f.dtype}) the update divides by 0: inf or NaN weights")
            fix = (f"keep the optimizer's state in float32 (float32 parameters under "
                   f"torch.autocast, or float32 master weights), or pass an eps {f.dtype} "
                   f"holds ({_number(info.tiny, 3)} or more)")
        else:
            at = where(f.op)
            consequence = (
                "the constant does nothing: x + eps is x, a clamp to eps is a clamp to 0, so an "
                "eps meant to keep a denominator or an rsqrt away from 0 does not (rsqrt(0) is "
                "inf, 0/0 is NaN)")
            fix = (f"use an eps {f.dtype} holds, such as {holds}, or compute the statistic in "
                   "float32 (x.float().pow(2).mean(-1) + eps) and cast back")
        yield Hit(
            f"{_number(f.value)} is 0 in {f.dtype} (smallest positive value {smallest}): {at}.",
            (f"{f.name} on {f.dtype} {f.how} the constant {_number(f.value)}; the smallest "
             f"positive {f.dtype} is {smallest} (torch.finfo(torch.{f.dtype}).tiny × eps), "
             "and a value up to half of it rounds to 0", _modules(f.ops)),
            consequence, fix, f.op.source)
