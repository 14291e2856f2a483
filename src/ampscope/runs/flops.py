"""FLOPs of one aten op, from its arguments, as the op runs; and ampscope's own formulas.

Two sources, one convention (a multiply-add is 2 FLOPs, elementwise work 0):

- PyTorch's formulas (`torch.utils.flop_counter`, read through torchcompat/flops.py): matmuls,
  convolutions, the CUDA attention kernels;
- ampscope's, below, each a function with `@register_flop_formula(op, ...)` above it, the one
  way to add one: the CPU flash-attention kernel and grouped-query attention where torch lacks
  or asserts on them, and the fused RNN ops (oneDNN's LSTM layer, cuDNN's RNN). Where both
  have one, torch's counts unless the registration's `replaces_torch()` says otherwise.

Registering: CONTRIBUTING.md#where-to-add-things says how to name the ops and what a formula
reads. Each op is checked as it is registered, so a formula is feature-detected, never a crash
(`skipped()` says why one was left out). Fitting: each positional parameter has an argument of
the op's schema at its place, of the same name unless the parameter is positional-only (before
`/`: read by place); the op has no more positional arguments than the formula takes unless it
takes `*args`; the op's keyword-only ones (`out=`, `scale=`) reach `**kwargs`. A release that
reorders or renames an argument a formula reads turns the formula off rather than feeding it
the wrong value. Counts are cached by shapes and non-tensor arguments, so a formula reads no
more (no `out_val`). A parameter whose schema argument has a default needs one too (the
dispatcher may leave it out). Register at import, before anything runs: the op recorder keeps
what it looked up per op.

What is counted: every op that reaches the op recorder (runs/ops.py), once (CONTRIBUTING.md).
RNNs: oneDNN's LSTM layer on the CPU (`mkldnn_rnn_layer`, float32 LSTMs without
projections, one call per layer and direction) and cuDNN's RNN (`_cudnn_rnn`, all layers in
one call; also what the CUDA emulation runs, runtime/rnn_kernels.py) do their matmuls inside
the kernel, so torch counts them 0; the formulas below count them. Every other RNN path (GRU
and RNN on the CPU, packed sequences, LSTMs with projections or in bfloat16 on the CPU,
LSTMCell) dispatches its matmuls as `mm`/`addmm`, counted already. `lstm.input` and its
siblings never reach the recorder and have no formula: one would count those matmuls twice.

Causal attention is also counted on the entries the mask keeps: row i of a causal (L, S) score
matrix keeps min(i + 1, S) keys (top-left alignment, as `is_causal`): L·(L+1)/2 of L·L when
L == S.

Namesakes, the same concern at another layer: `analysis/flops.py`, `render/flops.py`,
`torchcompat/flops.py`."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ampscope.torchcompat import flops as torch_flops
from ampscope.torchcompat import rnn as private_rnn
from ampscope.torchcompat.dispatch import OpOverload, OpOverloadPacket, op_schema
from ampscope.torchcompat.ops import SDPA_FLASH_FOR_CPU_NAMES, SDPA_OP_NAMES

log = logging.getLogger(__name__)
Formula = TypeVar("Formula", bound=Callable[..., int])
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


_formulas: dict[OpOverload, _Formula | None] = {}
# Counts by (op, shapes and other arguments): a model's blocks repeat the same shapes, and a
# formula costs more than the rest of an op's record (pytree maps its arguments to shapes).
_counted: dict[tuple, tuple[int, int]] = {}


# -- registering ----------------------------------------------------------------------------

def _never() -> bool:
    return False


@dataclass(frozen=True)
class OwnFormula:
    """One registered formula: `count(*args, **kwargs)` of the op's call, and whether it is
    used where torch has a formula for the op too."""

    count: Callable[..., int]
    replaces_torch: Callable[[], bool] = _never


_registered: dict[OpOverloadPacket, OwnFormula] = {}
_skipped: dict[str, str] = {}


def register_flop_formula(*ops: OpOverloadPacket | str,
                          replaces_torch: Callable[[], bool] = _never
                          ) -> Callable[[Formula], Formula]:
    """Decorator: the function below counts the FLOPs of each of `ops` (packets or aten names);
    ops this build lacks, or whose arguments do not fit it, are skipped (see `skipped()`)."""
    if not ops:
        raise ValueError("register_flop_formula needs at least one op")

    def register(count: Formula) -> Formula:
        for op in ops:
            packet, why = _resolved(op, count)
            if packet is None:
                _skipped[str(op)] = why
                log.debug("FLOP formula %s skipped for %s: %s", count.__name__, str(op), why)
                continue
            if packet in _registered:
                raise ValueError(f"{packet} has a FLOP formula already "
                                 f"({_registered[packet].count.__name__})")
            _registered[packet] = OwnFormula(count, replaces_torch)
        _changed()
        return count

    return register


def unregister_flop_formula(*ops: OpOverloadPacket | str) -> None:
    """Remove the formulas of `ops` (one registered for a while: a test's)."""
    for op in ops:
        packet = torch_flops.aten_op(op) if isinstance(op, str) else op
        if packet is not None:
            _registered.pop(packet, None)
        _skipped.pop(str(op), None)
    _changed()


def skipped() -> dict[str, str]:
    """The ops named in a registration but skipped on this build, each with the reason."""
    return dict(_skipped)


def _changed() -> None:
    """A formula was registered or removed: what was looked up may have changed."""
    _formulas.clear()
    _counted.clear()


def _resolved(op: OpOverloadPacket | str, count: Callable) -> tuple[OpOverloadPacket | None, str]:
    """(the op, "") where `count` can count it on this build; (None, why not) otherwise."""
    if isinstance(op, str):
        packet = torch_flops.aten_op(op)
        if packet is None:
            return None, "not an op of this torch build"
    elif isinstance(op, OpOverloadPacket):
        packet = op
    else:
        raise TypeError(f"name an op by its packet (torch.ops.aten.mm) or its name, not {op!r}")
    for overload in packet.overloads():
        why = _misfit(count, getattr(packet, overload))
        if why:
            return None, f"{overload}: {why}"
    return packet, ""


def _misfit(count: Callable, overload) -> str:
    """Why `count` cannot take the overload's arguments ("" where it can; see the docstring)."""
    params = list(inspect.signature(count).parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    takes_rest = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    takes_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    arguments = op_schema(overload).arguments
    in_order = [a.name for a in arguments if not a.kwarg_only]
    for place, param in enumerate(positional):
        if place >= len(in_order):
            if param.default is inspect.Parameter.empty:
                return f"the formula reads {param.name!r}, the op has {len(in_order)} arguments"
        elif param.kind is not inspect.Parameter.POSITIONAL_ONLY and param.name != in_order[place]:
            return f"argument {place} is {in_order[place]!r}, the formula reads {param.name!r}"
    if len(in_order) > len(positional) and not takes_rest:
        return f"the op has {len(in_order)} arguments, the formula takes {len(positional)}"
    named = {p.name for p in params}
    keywords = [a.name for a in arguments if a.kwarg_only and a.name not in named]
    if keywords and not takes_keywords:
        return f"the formula takes no {', '.join(keywords)}"
    return ""


# -- attention ------------------------------------------------------------------------------

_FUSED_ATTENTION = [SDPA_OP_NAMES[backend] for backend in ("flash", "efficient", "cudnn")]
_FUSED_ATTENTION.append(SDPA_FLASH_FOR_CPU_NAMES)


def _replaces_torchs_attention() -> bool:
    """Where torch's attention formulas assert on grouped-query shapes, ampscope's count."""
    return not torch_flops.counts_grouped_query_attention()


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


@register_flop_formula(*(forward for forward, _ in _FUSED_ATTENTION),
                       replaces_torch=_replaces_torchs_attention)
def attention_flops(query, key, value, *args, **kwargs) -> int:
    """A fused attention kernel, (query, key, value) first."""
    return _sdpa_forward(tuple(query.shape), tuple(key.shape), tuple(value.shape))


# The backwards' gradient is `grad_out` or `grad_out_`: read by place (positional-only).
@register_flop_formula(*(backward for _, backward in _FUSED_ATTENTION if backward is not None),
                       replaces_torch=_replaces_torchs_attention)
def attention_backward_flops(grad_out, /, query, key, value, *args, **kwargs) -> int:
    """A fused attention kernel's backward, (grad_out, query, key, value) first."""
    return _sdpa_backward(tuple(query.shape), tuple(key.shape), tuple(value.shape))


# -- RNNs -----------------------------------------------------------------------------------

# Gate blocks per mode: the rows of w_ih and w_hh are gates · hidden_size.
_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
_GATES_BY_CUDNN_MODE = {private_rnn.CUDNN_MODES[mode]: g for mode, g in _GATES.items()}


def _positions(input) -> int:
    """T·B, the vectors each layer's weights multiply: a padded input is (T, B, I) or (B, T, I),
    a packed one (ΣB_t, I)."""
    size = input.shape[-1]
    return input.numel() // size if size else 0


def rnn_forward_flops(positions: int, gates: int, input_size: int, hidden_size: int,
                      proj_size: int, num_layers: int, directions: int) -> int:
    """The matmuls of a whole RNN over T·B = `positions`: for each layer and direction, the
    input projection (w_ih: G·H × I_l), the recurrent one (w_hh: G·H × P) and, with projections,
    the output projection (w_hr: P × H), each a multiply-add per weight and position:
    2·T·B·(G·H·(I_l + P) + P·H). P is proj_size, or H without projections (and no w_hr);
    I_l is the input size for layer 0, D·P after. Gates G: LSTM 4, GRU 3, RNN 1. The gates'
    elementwise math counts 0."""
    out = proj_size or hidden_size
    per_position = 0
    for layer in range(num_layers):
        layer_input = input_size if layer == 0 else directions * out
        per_position += directions * (gates * hidden_size * (layer_input + out)
                                      + proj_size * hidden_size)
    return 2 * positions * per_position


@register_flop_formula(private_rnn.CUDNN_RNN_NAME)
def cudnn_rnn_flops(input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size,
                    proj_size, num_layers, batch_first, dropout, train, bidirectional,
                    *args, **kwargs) -> int:
    """cuDNN's forward over the whole sequence, every layer and direction (`rnn_forward_flops`).
    Read from the sizes, not `weight`: under autocast the weights come as (n, 1) views."""
    return rnn_forward_flops(_positions(input), _GATES_BY_CUDNN_MODE[mode], input.shape[-1],
                             hidden_size, proj_size, num_layers, 2 if bidirectional else 1)


@register_flop_formula(private_rnn.CUDNN_RNN_BACKWARD_NAME)
def cudnn_rnn_backward_flops(input, weight, weight_stride0, weight_buf, hx, cx, output,
                             grad_output, grad_hy, grad_cy, mode, hidden_size, proj_size,
                             num_layers, batch_first, dropout, train, bidirectional, batch_sizes,
                             dropout_state, reserve, output_mask, *args, **kwargs) -> int:
    """Convention, from what the op runs (`_cudnn_rnn_backward`, aten/src/ATen/native/cudnn/
    RNN.cpp): the data pass (cudnnRNNBackwardData), run unconditionally, multiplies each
    position's gradient by every weight the forward multiplied, transposed (the gradients of
    the input, of each layer's input and of the recurrent state): the forward's FLOPs. The
    weight pass (cudnnRNNBackwardWeights), run where `output_mask[3]` asks for the weights'
    gradients, multiplies each position's gradient by that position's input: the forward's
    FLOPs again. So 2× the forward when the weights train, 1× when they are frozen, 0 when no
    gradient reached the op (it returns at once)."""
    if grad_output is None and grad_hy is None and grad_cy is None:
        return 0
    forward = rnn_forward_flops(_positions(input), _GATES_BY_CUDNN_MODE[mode], input.shape[-1],
                                hidden_size, proj_size, num_layers, 2 if bidirectional else 1)
    return forward * (2 if output_mask[3] else 1)


def _layer_flops(input, w_ih, w_hh) -> int:
    """One layer in one direction: every position multiplies w_ih (G·H × I) and w_hh (G·H × H),
    2·T·B·G·H·(I + H)."""
    return 2 * _positions(input) * (w_ih.numel() + w_hh.numel())


@register_flop_formula("mkldnn_rnn_layer")
def mkldnn_rnn_layer_flops(input, weight0, weight1, *args, **kwargs) -> int:
    """oneDNN's LSTM, one call per layer and direction (weight0 = w_ih, weight1 = w_hh)."""
    return _layer_flops(input, weight0, weight1)


@register_flop_formula("mkldnn_rnn_layer_backward")
def mkldnn_rnn_layer_backward_flops(input, weight1, weight2, *args, **kwargs) -> int:
    """Convention: 2× the layer's forward. oneDNN's backward always computes the gradients of
    the input and of the recurrent state (the forward's multiply-adds with the weights
    transposed) and of both weights (as many again); it takes no mask."""
    return 2 * _layer_flops(input, weight1, weight2)


# -- looking up ---------------------------------------------------------------------------

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
        own = _registered.get(packet)
        count = torch_flops.torch_formula(packet)
        # ampscope's formula counts where torch has none, or where its registration says so
        extra = own is not None and (count is None or own.replaces_torch())
        if own is not None and extra:
            count = own.count
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
