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
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

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


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """(FLOPs, FLOPs with causal attention counted on the kept entries only) of one op; (0, 0)
    for ops without a formula (elementwise, views, copies)."""
    packet = func.overloadpacket
    formula = flop_registry.get(packet)
    if formula is not None:
        flops = int(formula(*args, **kwargs, out_val=out))
    elif packet in _EXTRA:
        flops = int(_EXTRA[packet](*args, **kwargs))
    else:
        return 0, 0
    if "attention" not in packet.__name__:
        return flops, flops
    names = [a.name for a in func._schema.arguments]
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    if not bound.get("is_causal"):
        return flops, flops
    query = bound.get("query")
    key = bound.get("key")
    if query is None or key is None:
        return flops, flops
    return flops, round(flops * _kept_fraction(query.shape[-2], key.shape[-2]))
