"""Which SDPA backend a CUDA GPU would run: `choose_backend`, the selection rules of the build.

On CPU, `F.scaled_dot_product_attention` decomposes to `_scaled_dot_product_flash_attention_for_cpu`
or the math path; on a GPU it runs cuDNN, flash or memory-efficient attention, each with its own
forward and backward ops and saved tensors (logsumexp shapes, philox seed/offset). This module
predicts the choice; `attention_kernels.cuda_attention` makes CPU (and fake) tensors take it.

Sources, all torch 2.13.0 (git cf30153c4c131c8164ee7798e5022d810682e2cb, the installed build):
- the selection rules (`select_sdp_backend`, `can_use_{cudnn,flash,mem_efficient}_attention` and
  their `check_*` filters) follow `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp` as stored
  in the pytorch/pytorch index (a newer revision), checked against the disassembly of
  `libtorch_cuda.so` in the torch-2.13.0 cu130 wheel (filter lists, template arguments, version
  and head-dim constants). Where they differ this module follows the wheel: mem-efficient has no
  GQA (`check_batch_size_and_num_heads_dense<false, true>`), cuDNN's head-dim limit is 256 on
  sm90 from cuDNN 9.10 (192/128 on sm10x from 9.11, else 128), and there is no cuDNN
  d256-backward filter. The shared filters are the wheel's own
  `include/ATen/native/transformers/sdp_utils_cpp.h`; the Python-side flags are
  `torch.backends.cuda.*_sdp_enabled()` and the priority order and FA3 switch, where the
  build has them (`torchcompat.attention`).
- priority: flash, efficient, math, cuDNN; cuDNN goes first when the runtime cuDNN is newer than
  9.15.0 on compute capability 9.x/10.x (the source adds: on CUDA < 13 builds only minor 0 or 3;
  the cu130 binary has no such test), unless
  TORCH_CUDNN_SDPA_DEPRIORITIZED=1. The PyPI torch 2.13.0 wheel is CUDA 13.0 with
  nvidia-cudnn-cu13==9.20.0.48, so on an H100 with that wheel cuDNN attention wins.
- the composite (masks, padding, which op with which arguments) follows
  `scaled_dot_product_attention` in `aten/src/ATen/native/transformers/attention.cpp`; output
  shapes, dtypes and strides follow the Meta kernels in the installed
  `torch/_meta_registrations.py`; autograd uses the derivatives registered in `derivatives.yaml`,
  so the real backward ops run.

Not reproduced: nested tensors (rejected), ROCm, FA3 kernels (its fp8 dtype rule is kept),
a priority order set before the first CUDA SDPA call, cuDNN/flash numerics bit for bit (the CPU
kernels compute in fp32 and round once; dropout masks come from the CPU generator, not philox),
and which way cuDNN aligns a causal mask when seq_q != seq_k (top-left here, as in math).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from ampscope.torchcompat import attention as sdp
from ampscope.torchcompat.ops import SDPA_OP_NAMES

aten = torch.ops.aten


@dataclass(frozen=True)
class CudaTarget:
    """The GPU and CUDA/cuDNN build the emulation stands for."""

    name: str = "H100"
    capability: tuple[int, int] = (9, 0)
    cudnn_version: int | None = 92000  # runtime cuDNN as cudnnGetVersion() gives it; None: none
    cuda_version: tuple[int, int] = (13, 0)


H100 = CudaTarget()
A100 = CudaTarget("A100", (8, 0))

_DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")


@dataclass(frozen=True)
class SdpFlags:
    """The process-wide switches `select_sdp_backend` reads (defaults: a fresh process)."""

    flash: bool = True
    efficient: bool = True
    cudnn: bool = True
    math: bool = True
    fa3: bool = False
    priority: tuple[str, ...] | None = None  # set by sdpa_kernel(..., set_priority=True)
    deterministic: bool = False  # use_deterministic_algorithms(True) without warn_only
    cudnn_deprioritized: bool = False  # TORCH_CUDNN_SDPA_DEPRIORITIZED=1

    @classmethod
    def current(cls) -> SdpFlags:
        order = sdp.sdp_priority_order() or _DEFAULT_ORDER  # None: the build's fixed order
        return cls(
            flash=torch.backends.cuda.flash_sdp_enabled(),
            efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
            cudnn=torch.backends.cuda.cudnn_sdp_enabled(),
            math=torch.backends.cuda.math_sdp_enabled(),
            fa3=sdp.fa3_enabled(),  # False on builds without FlashAttention-3
            priority=None if order[:4] == _DEFAULT_ORDER else order,
            deterministic=torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled(),
            # c10::utils::check_env reads only "1" as true
            cudnn_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1",
        )


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (a size-0 dimension strides as size 1)."""
    strides: list[int] = []
    n = 1
    for size in reversed(shape):
        strides.insert(0, n)
        n *= max(size, 1)
    return tuple(strides)


@dataclass(frozen=True)
class TensorSpec:
    """What the selection rules look at in a tensor; `stride` None means contiguous."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None
    storage_offset: int = 0
    requires_grad: bool = False

    def __post_init__(self) -> None:
        if self.stride is None:
            object.__setattr__(self, "stride", contiguous_strides(self.shape))

    @property
    def strides(self) -> tuple[int, ...]:
        """`stride`, which is never None once constructed (contiguous when none was given)."""
        assert self.stride is not None  # (__post_init__ fills it in)
        return self.stride

    @classmethod
    def of(cls, t: torch.Tensor | TensorSpec) -> TensorSpec:
        if isinstance(t, TensorSpec):
            return t
        if t.is_nested:
            raise NotImplementedError("nested tensors are not emulated")
        # torch types an offset as int | SymInt, and sizes and strides as int, though all are
        # SymInts together under symbolic shapes: the offset is read as the sizes are.
        offset = cast(int, t.storage_offset())
        return cls(tuple(t.shape), t.dtype, tuple(t.stride()), offset, t.requires_grad)


@dataclass(frozen=True)
class AttentionChoice:
    """The backend picked, its ops, and why each backend tried before it was rejected."""

    backend: str  # "cudnn" | "flash" | "efficient" | "math"
    forward_op: str
    backward_op: str | None  # None for math: its backward is that of the decomposed ops
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class _Call:
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    mask: TensorSpec | None
    dropout: float
    causal: bool
    gqa: bool
    needs_grad: bool  # sdp::input_requires_grad
    target: CudaTarget
    flags: SdpFlags


def choose_backend(
    query: torch.Tensor | TensorSpec,
    key: torch.Tensor | TensorSpec,
    value: torch.Tensor | TensorSpec,
    attn_mask: torch.Tensor | TensorSpec | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,  # accepted for symmetry: no 2.13 rule reads it
    enable_gqa: bool = False,
    *,
    target: CudaTarget = H100,
    flags: SdpFlags = SdpFlags(),  # frozen, so a shared default is safe
    grad_enabled: bool = True,
) -> AttentionChoice:
    """The backend `select_sdp_backend` of torch 2.13 picks for these inputs on `target`."""
    q, k, v = TensorSpec.of(query), TensorSpec.of(key), TensorSpec.of(value)
    mask = None if attn_mask is None else TensorSpec.of(attn_mask)
    needs_grad = grad_enabled and (q.requires_grad or k.requires_grad or v.requires_grad)
    call = _Call(q, k, v, mask, dropout_p, is_causal, enable_gqa, needs_grad, target, flags)
    reasons: list[str] = []
    for backend in _priority(target, flags):
        if backend == "math":
            reason = None if flags.math else "math attention has been runtime disabled."
        elif backend in _REJECTION:
            reason = _REJECTION[backend](call)
        else:
            continue
        if reason is None:
            forward, backward = SDPA_OP_NAMES[backend]
            return AttentionChoice(backend, f"aten.{forward}.default",
                                   backward and f"aten.{backward}.default", tuple(reasons))
        reasons.append(f"{backend}: {reason}")
    raise RuntimeError("No available kernel. Aborting execution. " + " ".join(reasons))


def _priority(target: CudaTarget, flags: SdpFlags) -> tuple[str, ...]:
    if flags.priority is not None:
        return flags.priority
    major, minor = target.capability
    cudnn_first = (
        not flags.cudnn_deprioritized
        and (target.cudnn_version or 0) > 91500  # 9.15.1 fixed seq_len % 128 != 0
        and major in (9, 10)
        and (target.cuda_version >= (13, 0) or minor in (0, 3))
    )
    return ("cudnn", "flash", "efficient", "math") if cudnn_first else _DEFAULT_ORDER


# -- the filters, in the order sdp_utils.cpp runs them; each returns why it rejects, or None

def _shape_reason(c: _Call) -> str | None:  # check_tensor_shapes
    if not (len(c.q.shape) == len(c.k.shape) == len(c.v.shape) == 4):
        return "all fused kernels require query, key and value to be 4 dimensional."
    return None


def _dtype_reason(c: _Call, allowed: tuple[torch.dtype, ...]) -> str | None:
    if not (c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in allowed):
        return f"expected query, key and value to all be of dtype {allowed}, got {c.q.dtype}."
    return None


def _low_precision(c: _Call) -> tuple[torch.dtype, ...]:  # check_dtypes_low_precision
    return (torch.half, torch.bfloat16) if c.target.capability[0] >= 8 else (torch.half,)


def _dense_reason(c: _Call, ignore_singleton: bool, gqa: bool, same_kv_heads: bool) -> str | None:
    """check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense and
    check_batch_size_and_num_heads_dense<gqa, same_kv_heads>."""
    q, k, v = c.q, c.k, c.v
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return "all fused kernels do not support zero seq_len_q or seq_len_kv."
    last_ok = all(t.strides[-1] == 1 for t in (q, k, v)) or (ignore_singleton and q.shape[-1] == 1)
    if not last_ok or (c.mask is not None and c.mask.strides[-1] != 1):
        return "all fused kernels require the last dimension of the inputs to have stride 1."
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return "query, key and value must have the same batch size."
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if c.gqa and gqa:
        if (same_kv_heads and hk != hv) or hq % hk or (not same_kv_heads and hq % hv):
            return "the number of heads in key/value must divide the number of heads in query."
        return None
    if not hq == hk == hv:
        return "query, key and value must have the same num_heads (this backend has no GQA)."
    return None


def _cudnn_reason(c: _Call) -> str | None:
    mask, target, version = c.mask, c.target, c.target.cudnn_version
    if version is None or version < 90000:
        return "torch was not built with cuDNN >= 9 attention."
    if c.dropout > 0 and 91100 < version < 91400:
        return "cuDNN 9.11 - 9.13 do not support dropout in SDPA."
    if not c.flags.cudnn:
        return "cuDNN attention has been runtime disabled."
    if reason := _shape_reason(c):
        return reason
    if c.flags.deterministic:
        return "cuDNN SDPA is not deterministic."
    if reason := _dtype_reason(c, _low_precision(c)):
        return reason
    if mask is not None and not _cudnn_mask_shape_ok(c):
        return "attn_mask must be 2-D (L|1, S|1) or 4-D (B|1, H|1, L|1, S|1) and need no grad."
    if not (8, 0) <= target.capability <= (12, 1):
        return "cuDNN MHA only supports gpu architectures in the range [sm80, sm121]."
    if c.dropout * 16.0 != math.floor(c.dropout * 16.0):
        return "cuDNN dropout probability resolution is limited to 1/16."
    if reason := _dense_reason(c, ignore_singleton=True, gqa=True, same_kv_heads=False):
        return reason
    return _cudnn_shape_reason(c, version)


def _cudnn_mask_shape_ok(c: _Call) -> bool:  # check_attn_mask_shape
    m, (b, h, seq_q, _), seq_k = c.mask, c.q.shape, c.k.shape[2]
    assert m is not None  # (asked only where there is a mask)
    if m.requires_grad or len(m.shape) not in (2, 4):
        return False
    ok = m.shape[-2] in (seq_q, 1) and m.shape[-1] in (seq_k, 1)
    return ok and (len(m.shape) == 2 or (m.shape[0] in (b, 1) and m.shape[1] in (h, 1)))


def _cudnn_shape_reason(c: _Call, version: int) -> str | None:
    """check_cudnn_tensor_shapes as compiled into torch 2.13.0 (its cuDNN < 9 rules are moot)."""
    b, h, s_q, d_qk = c.q.shape
    s_k, d_v = c.k.shape[2], c.v.shape[3]
    major, minor = c.target.capability
    if b > 65535 or h > 65535:
        return "cuDNN SDPA does not support batch size or num_heads greater than 65535."
    limit = 256 if version >= 91000 and (major, minor) == (9, 0) else 128
    if version >= 91100 and major == 10 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit:
        return f"head_dim should be no more than {limit}."
    if d_qk % 8 or d_v % 8:
        return "head_dim should be a multiple of 8."
    if s_k == 1:
        return "cudnn SDPA does not support key/value sequence length 1."
    if s_q == 1 and c.dropout != 0.0:
        return "cudnn SDPA does not support query sequence length 1 with dropout."
    return None


def _flash_reason(c: _Call) -> str | None:
    q, target = c.q, c.target
    if not c.flags.flash:
        return "Flash attention has been runtime disabled."
    if reason := _shape_reason(c):
        return reason
    if c.mask is not None:
        return "Flash Attention does not support non-null attn_mask."
    if not (q.shape[-1] == c.k.shape[-1] == c.v.shape[-1] <= 256):
        return "Flash attention requires q,k,v to have the same last dimension, at most 256."
    if not (8, 0) <= target.capability <= (12, 1):
        return "Flash attention only supports gpu architectures in the range [sm80, sm121]."
    head_dim, cap = q.shape[-1], target.capability
    sm86_89_or_12x = (8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)
    big_head = 192 < head_dim <= 224 or (head_dim > 224 and c.dropout > 0)
    if c.needs_grad and sm86_89_or_12x and big_head:
        return "Flash attention does not support training with this head_dim on sm86-89/sm120."
    if c.causal and q.shape[-2] != c.k.shape[-2]:
        return "Flash attention does not support the is_causal flag when seqlen_q != seqlen_k."
    fa3 = (torch.float8_e4m3fn,) if target.capability[0] >= 9 and c.flags.fa3 else ()
    if reason := _dtype_reason(c, fa3 + _low_precision(c)):
        return reason
    return _dense_reason(c, ignore_singleton=True, gqa=True, same_kv_heads=True)


def _efficient_reason(c: _Call) -> str | None:
    q, k, v, target = c.q, c.k, c.v, c.target
    if not c.flags.efficient:
        return "Memory Efficient attention has been runtime disabled."
    if not (5, 0) <= target.capability <= (12, 1):
        return "Mem Efficient Attention only supports gpu architectures in the range [sm50, sm121]."
    if reason := _shape_reason(c):
        return reason
    align = _gemm_alignment(target, q.dtype)
    if q.shape[-1] != k.shape[-1] or any(d % align or d <= 0 for d in (q.shape[-1], v.shape[-1])):
        return f"Mem efficient attention requires the last dimensions to be divisible by {align}."
    if target.capability[0] >= 8:  # check_data_ptr_alignment_mem_efficient
        size = q.dtype.itemsize
        if any(t.storage_offset * size % (align * size) for t in (q, k, v) if math.prod(t.shape)):
            return "Mem efficient attention on sm80 or newer requires aligned storage offsets."
    if reason := _dense_reason(c, ignore_singleton=False, gqa=False, same_kv_heads=True):
        return reason
    floats = (torch.half, torch.float, torch.bfloat16)
    return _dtype_reason(c, floats if target.capability[0] >= 8 else floats[:2])


def _gemm_alignment(target: CudaTarget, dtype: torch.dtype) -> int:  # minimum_gemm_alignment
    major, is_half = target.capability[0], dtype in (torch.half, torch.bfloat16)
    tensor_cores = major >= 8 or (major >= 7 and is_half)
    alignment = 4 if major >= 8 else 1
    return max(alignment, 128 // (16 if is_half else 32)) if tensor_cores else alignment


_REJECTION = {"cudnn": _cudnn_reason, "flash": _flash_reason, "efficient": _efficient_reason}
