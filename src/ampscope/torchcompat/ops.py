"""The ATen operators with an underscored name that ampscope names in its code.

A leading underscore marks an ATen op as internal to PyTorch: its schema may change between
releases. Every such op ampscope refers to is named here, once; the records keep only their
names as strings (`"aten._to_copy.default"`).
"""

from __future__ import annotations

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
