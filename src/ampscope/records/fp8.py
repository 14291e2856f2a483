"""The fp8 casts of a recorded step and the scales they used, read off the op records.

A dynamically scaled fp8 cast (torchao's float8 training, docs/fp8.md) runs as: the tensor's
amax, a scale computed from it (`scale = fp8_max / amax`, in float64 and back to float32,
optionally rounded to a power of 2), then `x * scale`, a clamp to the format's range and the
`_to_copy` into float8. So each `_to_copy` into a float8 dtype is a cast, and the `mul` just
before it on the same tensor names the scale by its shape: one number (tensorwise) or one per
row (rowwise). The op that made the scale is the last earlier op in the same module with the
scale's dtype and shape.

Namesakes, the same concern at another layer: `analysis/fp8.py`, `precision/fp8.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ampscope.records.tensors import OpCall, TensorMeta
from ampscope.torchcompat.ops import TO_COPY_NAME

# The hardware requirement of fp8 matmuls (torch's scaled-matmul op): both dims a multiple of 16.
DIM_MULTIPLE = 16
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_CAST = TO_COPY_NAME
_MUL = "aten.mul.Tensor"
_LOOKBACK = 16  # ops between a scale's making and its cast: a dozen in torchao 0.18


@dataclass(frozen=True)
class Fp8Cast:
    """One cast into fp8 and its scale."""

    op: int  # index of the `_to_copy` op
    scale: TensorMeta | None  # the scale's dtype and shape; None: no scaling mul was found
    scale_op: int | None  # index of the op that made the scale

    @property
    def granularity(self) -> str:
        """"tensorwise" (one scale), "rowwise" (one per row or column), "unscaled"."""
        if self.scale is None:
            return "unscaled"
        return "tensorwise" if math.prod(self.scale.shape) == 1 else "rowwise"


def short_fp8(dtype: str) -> str:
    """"float8_e4m3fn" → "e4m3", as the notes of the op table, modules table and diagram write
    it."""
    return dtype.removeprefix("float8_").removesuffix("fn")


def is_fp8_cast(op: OpCall) -> bool:
    return op.op == _CAST and bool(op.outputs) and op.outputs[0].dtype in FP8_DTYPES


def fp8_casts(ops: list[OpCall]) -> list[Fp8Cast]:
    """Every cast into a float8 dtype, in op order, with the scale it was made with."""
    casts = []
    for i, op in enumerate(ops):
        if op.op != _CAST or not is_fp8_cast(op):  # few of a step's ops cast: asked first
            continue
        scale, made = None, None
        shape = op.inputs[0].shape if op.inputs else None
        for j in range(i - 1, max(i - _LOOKBACK, -1), -1):
            mul = ops[j]
            if (mul.op == _MUL and mul.module == op.module and len(mul.inputs) == 2
                    and mul.inputs[0].shape == shape and mul.inputs[1].shape != shape):
                scale = mul.inputs[1]
                made = next((k for k in range(j - 1, max(j - _LOOKBACK, -1), -1)
                             if ops[k].module == op.module and scale in ops[k].outputs), None)
                break
        casts.append(Fp8Cast(i, scale, made))
    return casts


# What each operand of a Linear layer's matmuls is: forward `input × weightᵀ`; backward
# `output gradient × weight` (the input's gradient) and `output gradientᵀ × input` (the
# weight's gradient). torchao's Float8Linear casts each operand of each of these to fp8.
INPUT, WEIGHT, GRAD_OUTPUT = "input", "weight", "output gradient"


class GemmRoles:
    """The roles of the two operands of each fp8 matmul of a Linear layer, told the matmuls in
    the order they ran.

    Forward: (input, weight). Backward: the first operand is the output gradient; the second
    is the weight when the matmul makes the input's gradient, shaped (tokens, in_features),
    and the input when it makes the weight's, shaped like the weight (out, in). When tokens ==
    out_features both look alike: the layer's backward makes the input's gradient first, so
    such matmuls of one layer alternate weight, input.
    """

    def __init__(self) -> None:
        self._square_seen: dict[str | None, int] = {}

    def of(self, phase: str, module: str | None, first: tuple[int, ...], out: tuple[int, ...],
           weight: tuple[int, ...] | None) -> tuple[str, str]:
        if phase != "backward":
            return INPUT, WEIGHT
        if len(first) == 2 and first[0] == first[1]:  # tokens == out_features
            n = self._square_seen.get(module, 0)
            self._square_seen[module] = n + 1
            return GRAD_OUTPUT, WEIGHT if n % 2 == 0 else INPUT
        makes_weight_grad = weight is not None and tuple(out) in (tuple(weight),
                                                                   tuple(reversed(weight)))
        return GRAD_OUTPUT, INPUT if makes_weight_grad else WEIGHT
