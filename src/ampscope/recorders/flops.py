"""FLOPs of one aten op, from its arguments, as the op runs.

PyTorch's own formulas (`torch.utils.flop_counter`: matmuls, convolutions, the CUDA attention
kernels) are used as they are; ampscope counts, with the same convention, what they do not:

- the CPU flash-attention kernel and its backward on releases whose registry lacks them;
- grouped-query attention (key/value with fewer heads than the query, `enable_gqa=True`) on
  releases whose `sdpa_flop_count` asserts equal head counts: each query head attends over
  its group's key/value head, so the count is that of the query's heads (`_sdpa_forward`);
- causal attention counted on the entries the mask keeps: row i of a causal (L, S) score matrix
  keeps min(i + 1, S) keys (top-left alignment, as `is_causal`): L·(L+1)/2 of L·L when L == S.

Every count follows PyTorch's convention: a multiply-add is 2 FLOPs, elementwise ops are 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampscope.torchcompat import flops as torch_flops
from ampscope.torchcompat.dispatch import OpOverload, OpOverloadPacket, op_schema
from ampscope.torchcompat.ops import SDPA_FLASH_FOR_CPU_NAMES, SDPA_OP_NAMES

aten = torch.ops.aten


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def _sdpa_forward(query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...]) -> int:
    """scores = q·kᵀ and out = scores·v, for every query head: 2·B·Hq·Sq·Sk·(D + Dv). A GQA
    key/value head serves Hq/Hkv query heads; each of them multiplies it again."""
    b, heads, seq_q, d_qk = query
    seq_k, d_v = key[-2], value[-1]
    return 2 * b * heads * seq_q * seq_k * (d_qk + d_v)


def _sdpa_backward(query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...]) -> int:
    """The scores recomputed (q·kᵀ), then the gradients of the scores (dO·vᵀ), of v (Pᵀ·dO),
    of q (dS·k) and of k (dSᵀ·q): 2·B·Hq·Sq·Sk·(3·D + 2·Dv), as torch's own formula counts."""
    b, heads, seq_q, d_qk = query
    seq_k, d_v = key[-2], value[-1]
    return 2 * b * heads * seq_q * seq_k * (3 * d_qk + 2 * d_v)


def _attention(query, key, value, *args, **kwargs) -> int:
    return _sdpa_forward(_shape(query), _shape(key), _shape(value))


def _attention_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return _sdpa_backward(_shape(query), _shape(key), _shape(value))


def _own_formulas() -> dict[OpOverloadPacket, Callable[..., int]]:
    """The fused attention ops, whose first arguments are (query, key, value), and their
    backwards ((grad_out, query, key, value)), with ampscope's formulas for them."""
    own: dict[OpOverloadPacket, Callable[..., int]] = {}
    names = [SDPA_OP_NAMES[b] for b in ("flash", "efficient", "cudnn")]
    for forward, backward in [*names, SDPA_FLASH_FOR_CPU_NAMES]:
        if hasattr(aten, forward):
            own[getattr(aten, forward)] = _attention
        if backward is not None and hasattr(aten, backward):
            own[getattr(aten, backward)] = _attention_backward
    return own


_OWN = _own_formulas()


def _own_formula(packet) -> bool:
    """Whether ampscope counts `packet` itself: torch has no formula for it, or cannot count
    grouped-query shapes with it."""
    if packet not in _OWN:
        return False
    return (torch_flops.torch_formula(packet) is None
            or not torch_flops.counts_grouped_query_attention())


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


class _Formula:
    """What is known of one op overload's FLOPs, looked up once."""

    __slots__ = ("count", "extra", "by_shape", "attention", "names")

    def __init__(self, func: OpOverload) -> None:
        packet = func.overloadpacket
        extra = _own_formula(packet)
        count = _OWN[packet] if extra else torch_flops.torch_formula(packet)
        self.count, self.extra = count, extra
        # A count from shapes alone is a function of `_key` below and can be cached; a formula
        # that may read values (varlen attention) is counted on every call.
        self.by_shape = extra or (count is not None and torch_flops.sees_shapes_only(count))
        self.attention = count is not None and "attention" in packet.__name__
        self.names = [a.name for a in op_schema(func).arguments] if self.attention else []

    def counts(self, args: tuple, kwargs: dict, out) -> tuple[int, int]:
        assert self.count is not None  # `formula` keeps only formulas with a count
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


_formulas: dict[OpOverload, _Formula | None] = {}
# Counts by (op, shapes and other arguments): a model's blocks repeat the same shapes, and a
# formula costs more than the rest of an op's record (pytree maps its arguments to shapes).
_counted: dict[tuple, tuple[int, int]] = {}


def formula(func: OpOverload) -> _Formula | None:
    """The op's FLOP formula, None for ops that have none (elementwise, views, copies)."""
    try:
        return _formulas[func]
    except KeyError:
        found = _Formula(func)
        result = _formulas[func] = found if found.count is not None else None
        return result


def op_flops(func: OpOverload, args: tuple, kwargs: dict, out,
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
