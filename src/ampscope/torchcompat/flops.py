"""PyTorch's FLOP formulas (`torch.utils.flop_counter`), and what each release can count.

- `aten_op(name)`: the aten op of that name ("_cudnn_rnn", "mkldnn_rnn_layer"), None where this
  build has none: ampscope's own formulas name their ops so (runs/flops.py), and
  an underscored op's name is written in this package only;
- `torch_formula(packet)`: the formula FlopCounterMode uses for an op, None where it has none;
- `sees_shapes_only(formula)`: whether a formula was registered to see argument shapes only
  (most are; the varlen attention ones read values). A count that depends on shapes only can
  be cached by shape; where this cannot be told, the answer is False and every call is
  counted (the same count, slower);
- `counts_grouped_query_attention()`: whether torch's attention formulas accept
  grouped-query shapes (fewer key/value heads than query heads); releases whose
  `sdpa_flop_count` asserts equal head counts need ampscope's own formula for them.

Namesakes, the same concern at another layer: `analysis/flops.py`, `render/flops.py`,
`runs/flops.py`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils import flop_counter

from ampscope.torchcompat.dispatch import OpOverloadPacket
from ampscope.torchcompat.features import Feature

__all__ = ["aten_op", "counts_grouped_query_attention", "sees_shapes_only", "torch_formula"]

# The first release whose attention formulas count grouped-query shapes.
_GQA_RELEASE = "2.12"


def aten_op(name: str) -> OpOverloadPacket | None:
    """The aten op `name` names ("_cudnn_rnn"; "aten::_cudnn_rnn" and "aten._cudnn_rnn" too), None
    where this build has no such op. `torch.ops.aten` raises AttributeError for an unknown name
    (its own lookup's RuntimeError included), so a missing op is never an error here."""
    bare = name.removeprefix("aten::").removeprefix("aten.")
    if not bare or "." in bare:
        raise ValueError(f"{name!r}: name an aten op (its packet), not an overload")
    return getattr(torch.ops.aten, bare, None)


def torch_formula(packet) -> Callable | None:
    """FlopCounterMode's formula for an op overload packet (`torch.ops.aten.mm`)."""
    return flop_counter.flop_registry.get(packet)


@functools.cache
def _shape_wrapper_code() -> tuple[object | None, str]:
    """The code object every shape-only formula runs first: `shape_wrapper` wraps each formula
    registered without `get_raw` in one closure, so they all share its code. Checked on the
    registry's own mm formula (registered shape-only in every release)."""
    wrap = getattr(flop_counter, "shape_wrapper", None)
    if wrap is None:
        return None, "torch.utils.flop_counter.shape_wrapper is not on this build"
    try:
        code = wrap(lambda *a, **k: 0).__code__
    except (TypeError, AttributeError) as e:  # a changed signature, or no function returned
        return None, f"shape_wrapper changed ({type(e).__name__})"
    mm = flop_counter.flop_registry.get(torch.ops.aten.mm)
    if getattr(mm, "__code__", None) is not code:
        return None, "the registry's formulas are not shape_wrapper closures on this build"
    return code, "formulas wrapped by shape_wrapper see shapes only"


def sees_shapes_only(formula: Callable) -> bool:
    """Whether `formula` (from `torch_formula`) counts from argument shapes alone."""
    if getattr(formula, "_get_raw", False):  # marked raw by releases that mark them
        return False
    code, _ = _shape_wrapper_code()
    return code is not None and getattr(formula, "__code__", None) is code


@functools.cache
def counts_grouped_query_attention() -> bool:
    """Whether torch's `sdpa_flop_count` counts 4 query heads over 2 key/value heads (by
    trying: older releases assert equal head counts)."""
    count = getattr(flop_counter, "sdpa_flop_count", None)
    if count is None:
        return False
    try:
        count((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8))
    except AssertionError:
        return False
    return True


def features() -> list[Feature]:
    code, why = _shape_wrapper_code()
    gqa = counts_grouped_query_attention()
    return [
        Feature("flop formulas by shape", code is not None, why, "flop-count cache"),
        Feature("torch's grouped-query attention FLOPs", gqa,
                "torch.utils.flop_counter counts GQA" if gqa else
                f"torch's sdpa_flop_count asserts on GQA before torch {_GQA_RELEASE}; "
                "ampscope's own formula counts it", ""),
    ]
