"""Running the SDPA backend a CUDA GPU would choose, on CPU (and fake) tensors.

`cuda_attention` replaces, for the duration of a run, PyTorch's SDPA composite with the CUDA one
(which op with which arguments, masks, padding) and gives the CUDA-only attention ops CPU kernels
that compute in fp32 and lay their outputs out as the Meta kernels say, so the trace shows the
ops, dtypes, shapes and saved tensors of the GPU run. The choice itself is made by
`attention_choice.choose_backend`; the sources both follow are listed there.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from ampscope.runtime.attention_choice import (
    H100,
    AttentionChoice,
    CudaTarget,
    SdpFlags,
    choose_backend,
)
from ampscope.torchcompat import ops as private_ops
from ampscope.torchcompat.ops import SDPA_OP_NAMES
from ampscope.torchcompat.policy import destroy_library, no_autocast, overriding_library

aten = torch.ops.aten


# -- CPU kernels for the CUDA-only ops: fp32 math, outputs laid out as the Meta kernels say.
# Each runs under no_autocast("cpu"): ops called from a kernel re-enter the dispatcher, and
# must not be autocast again.

def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:  # GQA: query head h uses t[h // g]
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(g: torch.Tensor, heads: int) -> torch.Tensor:
    b, h, s, d = g.shape
    return g if h == heads else g.view(b, heads, h // heads, s, d).sum(2)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _probabilities(q, k, bias, causal, scale, lse=None):
    """Softmax probabilities in fp32 (fp64 for fp64) and the row logsumexp."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = q.to(acc) @ _repeat_heads(k, q.shape[1]).to(acc).transpose(-2, -1) * _scale(q, scale)
    if bias is not None:
        s = s + bias.to(acc)
    if causal:  # top-left aligned, as the math path and mem-efficient attention
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if lse is None:
        lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.masked_fill(lse == -math.inf, 0).unsqueeze(-1)), lse


def _keep(seed: int, shape, dropout_p: float, dtype) -> torch.Tensor:
    """The dropout keep-mask, scaled; regenerated from the seed in backward like philox."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=dtype) >= dropout_p) / (1 - dropout_p)


def _forward(q, k, v, bias, dropout_p, causal, scale):
    seed = int(torch.randint(0, 2**62, ())) if dropout_p > 0 else 0
    p, lse = _probabilities(q, k, bias, causal, scale)
    if dropout_p > 0:
        p = p * _keep(seed, p.shape, dropout_p, p.dtype)
    return p @ _repeat_heads(v, q.shape[1]).to(p.dtype), lse, seed


def _backward(grad, q, k, v, out, lse, bias, dropout_p, causal, scale, seed):
    """FlashAttention's backward: recompute P from the saved logsumexp."""
    p, _ = _probabilities(q, k, bias, causal, scale, lse)
    acc, heads = p.dtype, q.shape[1]
    keep = _keep(seed, p.shape, dropout_p, acc) if dropout_p > 0 else 1.0
    k_all, v_all = _repeat_heads(k, heads).to(acc), _repeat_heads(v, heads).to(acc)
    d_out = grad.to(acc)
    dv = (p * keep).transpose(-2, -1) @ d_out
    dp = (d_out @ v_all.transpose(-2, -1)) * keep
    ds = p * (dp - (d_out * out.to(acc)).sum(-1, keepdim=True))
    dq = ds @ k_all * _scale(q, scale)
    dk = ds.transpose(-2, -1) @ q.to(acc) * _scale(q, scale)
    return dq, _sum_heads(dk, k.shape[1]), _sum_heads(dv, v.shape[1]), ds


def _permuted(shape, dtype) -> torch.Tensor:  # (B, H, L, D) stored as (B, L, H, D)
    return torch.empty_permuted(shape, (0, 2, 1, 3), dtype=dtype)


def _matching_layout(q: torch.Tensor, shape) -> torch.Tensor:  # alloc_with_matching_layout
    if tuple(q.shape) == tuple(shape):
        return torch.empty_like(q)
    order = sorted(range(4), key=lambda i: q.stride(i), reverse=True)
    return torch.empty_permuted(shape, order, dtype=q.dtype)


def _flash_fwd(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    with no_autocast("cpu"):
        out, lse, seed = _forward(q, k, v, None, dropout_p, is_causal, scale)
        rng_state = torch.tensor([seed, 0], dtype=torch.uint64)
        return (torch.empty_like(q).copy_(out), lse, None, None, q.shape[2], k.shape[2],
                rng_state, torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))


def _flash_bwd(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
               rng_state, unused, *, scale=None):
    if grad is None:  # an undefined grad_out, as the CUDA kernels handle it
        return None, None, None
    with no_autocast("cpu"):
        seed = int(rng_state[0].to(torch.int64))
        dq, dk, dv, _ = _backward(grad, q, k, v, out, lse, None, dropout_p, is_causal, scale, seed)
        return tuple(torch.empty_like(t).copy_(g) for t, g in ((q, dq), (k, dk), (v, dv)))


def _efficient_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                   scale=None):
    with no_autocast("cpu"):
        out, lse, seed = _forward(q, k, v, attn_bias, dropout_p, is_causal, scale)
        b, h, seq_q, _ = q.shape
        padded = torch.zeros(b, h, -(-seq_q // 32) * 32 if compute_log_sumexp else 0,
                             dtype=lse.dtype)
        if compute_log_sumexp:  # the kernel pads logsumexp to a multiple of 32 queries
            padded[..., :seq_q] = lse
        res = _permuted((b, h, seq_q, v.shape[-1]), q.dtype)
        return res.copy_(out), padded, torch.tensor(seed), torch.tensor(0)


def _efficient_bwd(grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                   is_causal=False, *, scale=None):
    if grad is None:
        return None, None, None, None
    with no_autocast("cpu"):
        lse = lse[..., : q.shape[2]]
        dq, dk, dv, ds = _backward(grad, q, k, v, out, lse, attn_bias, dropout_p, is_causal, scale,
                                   int(seed))
        grads = [_permuted(t.shape, t.dtype).copy_(g) for t, g in ((q, dq), (k, dk), (v, dv))]
        d_bias = None
        if attn_bias is not None and grad_input_mask[3]:
            last = attn_bias.shape[-1]  # stored with its last dim padded to a multiple of 16
            storage = torch.empty(*attn_bias.shape[:-1], -(-last // 16) * 16, dtype=attn_bias.dtype)
            d_bias = storage[..., :last].copy_(ds)
        return (*grads, d_bias)


def _cudnn_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None):
    with no_autocast("cpu"):
        out, lse, seed = _forward(q, k, v, attn_bias, dropout_p, is_causal, scale)
        res = _matching_layout(q, (*q.shape[:3], v.shape[-1]))
        return (res.copy_(out), lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2],
                torch.tensor(seed), torch.tensor(0), None)


def _cudnn_bwd(grad, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k,
               dropout_p, is_causal, *, scale=None):
    if grad is None:
        return None, None, None
    with no_autocast("cpu"):
        dq, dk, dv, _ = _backward(grad, q, k, v, out, lse.squeeze(-1), attn_bias, dropout_p,
                                  is_causal, scale, int(seed))
        return tuple(torch.empty_like(t).copy_(g) for t, g in ((q, dq), (k, dk), (v, dv)))


_CPU_KERNELS = {
    name: kernel
    for backend, kernels in (("flash", (_flash_fwd, _flash_bwd)),
                             ("efficient", (_efficient_fwd, _efficient_bwd)),
                             ("cudnn", (_cudnn_fwd, _cudnn_bwd)))
    for name, kernel in zip(SDPA_OP_NAMES[backend], kernels, strict=True)
}


# -- the CUDA branch of the scaled_dot_product_attention composite (attention.cpp)

def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype, fill: float):
    """convert_boolean_attn_mask(_cudnn): True keeps a position; cuDNN uses -65504, not -inf."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype))


def _pad_last_dim(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[-1] % multiple
    return aten.constant_pad_nd(t, [0, extra]) if extra else t


def _efficient_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask: 8-aligned strides (padding the last dim if not), expanded to (B,H,L,S)."""
    if any(s % 8 for s in mask.stride()[:-1]) or mask.stride(-1) != 1:
        last = mask.shape[-1]
        mask = aten.slice(aten.constant_pad_nd(mask, [0, 8 - last % 8]), -1, 0, last)
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# The active `cuda_attention` contexts, innermost last: (target, its list of choices). The
# kernels are registered once, by the outermost context (2.11 and older refuse a second
# Python kernel for the same op and key), and serve the innermost one.
_contexts: list[tuple[CudaTarget, list[AttentionChoice]]] = []


def _composite():
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, *, scale=None, enable_gqa=False):
        if not query.dtype == key.dtype == value.dtype:
            raise RuntimeError("Expected query, key, and value to have the same dtype, "
                               f"got {query.dtype}, {key.dtype} and {value.dtype}.")
        target, choices = _contexts[-1]
        choice = choose_backend(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa, target=target, flags=SdpFlags.current(),
                                grad_enabled=torch.is_grad_enabled())
        choices.append(choice)
        compute_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if choice.backend == "cudnn":
            mask = _additive_mask(attn_mask, query.dtype, -65504.0)
            return private_ops.SDPA_CUDNN(
                query, key, value, mask, compute_lse, dropout_p, is_causal, False, scale=scale)[0]
        if choice.backend == "flash":
            # FlashAttention-2 wants head_dim % 8 == 0: pad, keep the unpadded scale, slice back.
            head_dim = query.shape[-1]
            out = private_ops.SDPA_FLASH(
                *(_pad_last_dim(t, 8) for t in (query, key, value)), dropout_p, is_causal, False,
                scale=_scale(query, scale))[0]
            return out if out.shape[-1] == head_dim else aten.slice(out, -1, 0, head_dim)
        mask = _additive_mask(attn_mask, query.dtype, -math.inf)
        if choice.backend == "efficient":
            mask = None if mask is None else _efficient_mask(mask, query, key)
            return private_ops.SDPA_EFFICIENT(
                query, key, value, mask, compute_lse, dropout_p, is_causal, scale=scale)[0]
        return private_ops.SDPA_MATH(
            query, key, value, mask, dropout_p, is_causal, None, scale=scale,
            enable_gqa=enable_gqa)[0]

    return scaled_dot_product_attention


def _register(lib: torch.library.Library) -> None:
    lib.impl("scaled_dot_product_attention", _composite(), "CompositeImplicitAutograd")
    for name, kernel in _CPU_KERNELS.items():
        lib.impl(name, kernel, "CPU")


@contextlib.contextmanager
def cuda_attention(target: CudaTarget = H100) -> Iterator[list[AttentionChoice]]:
    """While active, SDPA on CPU (or fake CPU) tensors runs the ops `target` would run (as
    the module docstring says), PyTorch's own kernels back on exit, also when the body raises.
    Yields the list of choices made, one per SDPA call. Run backward inside too: outside, the
    backward ops have no CPU kernel. Process-wide, like any dispatcher registration: not for
    concurrent threads."""
    choices: list[AttentionChoice] = []
    with contextlib.ExitStack() as stack:
        if not _contexts:  # the outermost context registers the kernels
            stack.callback(destroy_library, overriding_library(_register))
        _contexts.append((target, choices))
        stack.callback(_contexts.pop)
        yield choices
