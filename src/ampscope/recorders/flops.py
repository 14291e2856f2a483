"""FLOPs of one aten op, from its arguments, as the op runs.

PyTorch's own formulas (`torch.utils.flop_counter.flop_registry`: matmuls, convolutions, the
CUDA attention kernels) are used as they are; the formulas it lacks are registered here:

- the CPU flash-attention kernel and its backward, which FlopCounterMode counts as 0 (the same
  `sdpa_flop_count` as the CUDA kernels: 2·B·H·L·S·(E + Ev) forward);
- causal attention counted on the entries the mask keeps: row i of a causal (L, S) score matrix
  keeps min(i + 1, S) keys (top-left alignment, as `is_causal`): L·(L+1)/2 of L·L when L == S.

Every count follows PyTorch's convention: a multiply-add is 2 FLOPs, elementwise ops are 0.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

aten = torch.ops.aten


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def _cpu_flash(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _cpu_flash_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


_EXTRA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def _kept_fraction(query_len: int, key_len: int) -> float:
    """Share of an (L, S) score matrix a causal mask keeps: row i sees keys 0..i (top-left
    alignment, as PyTorch's `is_causal`)."""
    kept = sum(min(i + 1, key_len) for i in range(query_len))
    return kept / (query_len * key_len)


def _key(value):
    """`value` as a formula keyed on shapes sees it, hashable: each tensor as its shape, lists
    as tuples. Within one op overload each argument is always a tensor or never, so the key
    tells calls apart exactly as the formula would."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (tuple, list)):
        return tuple(map(_key, value))
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in value.items())
    return value


# The body of every `shape_wrapper`-wrapped formula: it sees shapes only, so its count is a
# function of the key above. Formulas registered raw (`get_raw=True`: varlen attention) may
# read values, and are counted on every call.
_SHAPE_WRAPPER_CODE = shape_wrapper(lambda: None).__code__


class _Formula:
    """What is known of one op overload's FLOPs, looked up once."""

    __slots__ = ("count", "extra", "by_shape", "attention", "names")

    def __init__(self, func: torch._ops.OpOverload) -> None:
        packet = func.overloadpacket
        count = flop_registry.get(packet)
        extra = count is None and packet in _EXTRA
        if extra:
            count = _EXTRA[packet]
        self.count, self.extra = count, extra
        self.by_shape = extra or getattr(count, "__code__", None) is _SHAPE_WRAPPER_CODE
        self.attention = count is not None and "attention" in packet.__name__
        self.names = [a.name for a in func._schema.arguments] if self.attention else []

    def counts(self, args: tuple, kwargs: dict, out) -> tuple[int, int]:
        if self.extra:
            flops = int(self.count(*args, **kwargs))
        else:
            flops = int(self.count(*args, **kwargs, out_val=out))
        if not self.attention:
            return flops, flops
        bound = {**dict(zip(self.names, args, strict=False)), **kwargs}
        if not bound.get("is_causal"):
            return flops, flops
        query = bound.get("query")
        key = bound.get("key")
        if query is None or key is None:
            return flops, flops
        return flops, round(flops * _kept_fraction(query.shape[-2], key.shape[-2]))


_formulas: dict[torch._ops.OpOverload, _Formula | None] = {}
# Counts by (op, shapes and other arguments): a model's blocks repeat the same shapes, and a
# formula costs more than the rest of an op's record (pytree maps its arguments to shapes).
_counted: dict[tuple, tuple[int, int]] = {}


def formula(func: torch._ops.OpOverload) -> _Formula | None:
    """The op's FLOP formula, None for ops that have none (elementwise, views, copies)."""
    try:
        return _formulas[func]
    except KeyError:
        found = _Formula(func)
        result = _formulas[func] = found if found.count is not None else None
        return result


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out,
             known: _Formula | None = None) -> tuple[int, int]:
    """(FLOPs, FLOPs with causal attention counted on the kept entries only) of one op; (0, 0)
    for ops without a formula (elementwise, views, copies). `known` is `formula(func)`, where
    the caller has it already."""
    found = known if known is not None else formula(func)
    if found is None:
        return 0, 0
    if not found.by_shape:
        return found.counts(args, kwargs, out)
    key = (func, _key(args), _key(kwargs), _key(out))
    try:
        return _counted[key]
    except KeyError:
        pass
    except TypeError:  # an argument that cannot be a key
        return found.counts(args, kwargs, out)
    result = found.counts(args, kwargs, out)
    if len(_counted) < 100_000:
        _counted[key] = result
    return result
