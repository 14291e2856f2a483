"""Predict mode: the run on fake tensors, so models of any size trace in seconds and megabytes.

A `FakeTensorMode` gives every tensor its shape, dtype, device and strides but no storage:
every op still dispatches (autocast, autograd, the optimizer, and ampscope's recorders all see
the same calls they would see in a real run) and computes only the metadata of its results.
The model is built on the meta device, so its weights are never materialised either; the run's
working copies of them are fake tensors on the device the run stands for.

What a fake run cannot do is look at values: code that branches on them (`if loss.item() > x`,
early stopping in a sampler, GradScaler's check for infinities) has nothing to read.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ampscope.errors import AmpscopeError


def fake_mode() -> FakeTensorMode:
    # Real tensors the model keeps outside its parameters and buffers (a cached mask, a
    # constant) are converted on use rather than refused.
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_like(t: torch.Tensor, mode: FakeTensorMode, *, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A fake tensor with `t`'s shape and strides, in `dtype` on `device` (no storage)."""
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=device,
                                   requires_grad=False)


def fake_batch(batch: dict[str, torch.Tensor], mode: FakeTensorMode) -> dict[str, torch.Tensor]:
    return {
        name: mode.from_tensor(t) if isinstance(t, torch.Tensor) and not t.is_meta
        else fake_like(t, mode, dtype=t.dtype, device=torch.device("cpu"))
        for name, t in batch.items()
    }


def data_dependent(e: BaseException) -> bool:
    """Did a fake run stop because code asked for a value (`.item()`, `bool(tensor)`)?"""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    names = {"DataDependentOutputException", "DynamicOutputShapeException",
             "GuardOnDataDependentSymNode"}
    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) or (
        type(e).__name__ in names
    )


def value_needed_error(model_name: str, workload: str, e: BaseException) -> AmpscopeError:
    op = getattr(e, "func", None)
    what = f" ({op})" if op is not None else ""
    return AmpscopeError(
        f"predict mode cannot run the {workload} workload of {model_name}: the code reads a "
        f"tensor's value{what}, and fake tensors have none; trace a smaller configuration for "
        "real, or use the train/forward workload"
    )
