"""The ATen operators with an underscored name that ampscope names in its code.

A leading underscore marks an ATen op as internal to PyTorch: its schema may change between
releases. Every such op ampscope refers to is named here, once, as the op and, where ampscope
matches or registers by name, as its name (`TO_COPY_NAME`: the records keep ops as strings).
So are the names of torch's private modules ampscope quiets the loggers of.
`is_view_op` says whether a recorded op only makes a view (the step-time model costs it 0),
from the op's schema.
tests/test_torch_private.py fails on such a name written anywhere else.

Namesakes, the same concern at another layer: `runs/ops.py`."""

from __future__ import annotations

import functools

import torch

_aten = torch.ops.aten

TO_COPY = _aten._to_copy.default  # every cast: `.to(dtype)`, autocast's casts
LOCAL_SCALAR_DENSE = _aten._local_scalar_dense.default  # `.item()`
UNSAFE_VIEW = _aten._unsafe_view.default  # a reshape autograd does not track as a view
# batch_norm's functional forms (training with and without running stats, and inference)
BATCH_NORM_LEGIT = (_aten._native_batch_norm_legit.default,
                    _aten._native_batch_norm_legit.no_stats,
                    _aten._native_batch_norm_legit_no_training.default)
FUSED_RMS_NORM = _aten._fused_rms_norm.default
FUSED_RMS_NORM_BACKWARD = _aten._fused_rms_norm_backward.default
# The fused attention kernels scaled_dot_product_attention dispatches to (packets: called with
# their arguments, each picks its overload).
SDPA_CUDNN = _aten._scaled_dot_product_cudnn_attention
SDPA_FLASH = _aten._scaled_dot_product_flash_attention
SDPA_EFFICIENT = _aten._scaled_dot_product_efficient_attention
SDPA_MATH = _aten._scaled_dot_product_attention_math

# The same ops by name, where ampscope matches or registers by name: the records keep an op as
# `str(op)` ("aten._to_copy.default"), a dispatcher registration names it "aten::_fused_rms_norm".
TO_COPY_NAME = str(TO_COPY)
FUSED_RMS_NORM_NAMES = ("aten::_fused_rms_norm", "aten::_fused_rms_norm_backward")
# Each scaled_dot_product_attention backend's forward and backward op (math: its backward is
# that of the ops it decomposes into), and flash attention's CPU kernel, by name.
SDPA_OP_NAMES: dict[str, tuple[str, str | None]] = {
    backend: (f"_scaled_dot_product_{backend}_attention",
              f"_scaled_dot_product_{backend}_attention_backward")
    for backend in ("cudnn", "flash", "efficient")
} | {"math": ("_scaled_dot_product_attention_math", None)}
SDPA_FLASH_FOR_CPU_NAMES = ("_scaled_dot_product_flash_attention_for_cpu",
                            "_scaled_dot_product_flash_attention_for_cpu_backward")
# GradScaler's update of its scale, which reads whether a gradient was inf or NaN.
AMP_UPDATE_SCALE_NAME = "aten._amp_update_scale_.default"
# GradScaler's kernels by op name without namespace and overload: unscale_ (and step, which
# unscales where the script did not) runs the first, update() the second.
AMP_UNSCALE_OP = "_amp_foreach_non_finite_check_and_unscale_"
AMP_UPDATE_SCALE_OP = "_amp_update_scale_"
# The fused attention kernels' forward ops, by name: SDPA's backends and the kernels they call.
FUSED_ATTENTION_NAMES = (*(SDPA_OP_NAMES[b][0] for b in ("flash", "efficient", "cudnn")),
                         "_flash_attention_forward", "_efficient_attention_forward")
# The optimizers' multi-tensor ops all begin so (`_foreach_add_`, `_foreach_sqrt`).
FOREACH_PREFIX = "_foreach_"
# GradScaler's check of the gradients for inf and NaN (and their unscaling), as records name it.
GRAD_SCALER_CHECK_OPS = frozenset({"aten._amp_foreach_non_finite_check_and_unscale_.default",
                                   "aten._amp_non_finite_check_and_unscale_.default"})

# Loggers of torch's private modules whose lines ampscope holds back while it uses them.
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
PYTREE_LOGGER = "torch.utils._pytree"
# How `torch.overrides.resolve_name` names a method of the C++ tensor type.
TENSOR_BASE_PREFIX = "torch._C.TensorBase."

# Ops that only make a new view of their input's storage (no bytes moved, no kernel), by name,
# where an op's schema cannot be read: the aliasing views of ATen's native_functions.yaml and
# `_unsafe_view` (a view autograd does not track as one), `lift_fresh` and `alias`.
_VIEW_NAMES = frozenset((
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "expand_as", "slice",
    "select", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "split",
    "split_with_sizes", "unbind", "chunk", "narrow", "view_as", "view_as_real",
    "view_as_complex", "diagonal", "unfold", "lift_fresh", "movedim", "numpy_T", "T", "mT",
    "reshape", "flatten", "unflatten", "tensor_split", "hsplit", "vsplit", "swapaxes",
    "swapdims", "real", "imag", "indices", "values", "_reshape_alias", "unsafe_split",
    "unsafe_chunk"))


@functools.cache
def is_view_op(name: str) -> bool:
    """Does the op named `name` ("aten.view.default", as records keep it) only make a view, moving
    no bytes and launching no kernel? Read from the op's schema (a return that aliases an input
    and is not written: `OpOverload.is_view`), with `_unsafe_view` added (its schema shows no
    alias, but it is a reshape of a fresh tensor); the name list above where the op cannot be
    found or its schema read."""
    namespace, _, rest = name.partition(".")
    packet_name, _, overload = rest.rpartition(".")
    if packet_name == "_unsafe_view":
        return True
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet_name), overload)
        return bool(op.is_view) and not any(
            r.alias_info is not None and r.alias_info.is_write for r in op._schema.returns)
    except (AttributeError, RuntimeError):  # an op this build lacks, or no schema to read
        return (packet_name or rest) in _VIEW_NAMES
