"""Measurements of an untraced step on this machine's real device: its wall time (for MFU)
and, on CUDA, the allocator's peak (beside the predicted one)."""

from __future__ import annotations

import torch
from torch import nn

from ampscope import workloads
from ampscope.analysis.memory import MeasuredPeak
from ampscope.api.planning import batch_for, load, resolved
from ampscope.errors import AmpscopeError
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import (
    Setting,
    applied,
)
from ampscope.workloads import RunOptions


def real_step(model: str | nn.Module | LoadedModel, setting: Setting,
              options: RunOptions) -> tuple[LoadedModel, Batch]:
    """The model and batch of an untraced, measured step on this machine's real device."""
    lm = load(model, device=setting.run_device)
    return lm, batch_for(lm, None, options, device=setting.run_device)


def cuda_to_measure(setting: str | Setting) -> Setting:
    """The setting, if it runs on a real CUDA device here; else the one-line refusal of
    `memory --measure` (checked before any tracing)."""
    setting = resolved(setting)
    if setting.device != "cuda" or setting.emulated:
        raise AmpscopeError(
            f"--measure needs a real CUDA device and {setting.name} runs "
            f"{'emulated ' if setting.emulated else ''}on {setting.run_device}"
        )
    return setting


def measure_step(
    model: str | nn.Module | LoadedModel,
    *,
    setting: str | Setting = "fp32",
    workload: str = "train",
    batch: int = 1,
    seq: int = 64,
    optimizer: str = "adamw",
    new_tokens: int = 4,
    seed: int = 0,
    checkpoint: bool = False,
    optimizer_impl: str | None = None,
    repeats: int = 3,
) -> float:
    """Median wall seconds of the untraced step on this machine, after one warm-up run.

    Only a real device can be timed: an emulated setting is refused (give the step time
    instead)."""
    import statistics
    import time

    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed,
                         checkpoint=checkpoint, optimizer_impl=optimizer_impl)
    setting = resolved(setting)
    if setting.emulated:
        raise AmpscopeError(
            f"cannot time {setting.name} here: this machine has no {setting.device}; "
            "give the measured step time with --step-time SECONDS"
        )
    lm, data = real_step(model, setting, options)
    cuda = setting.device == "cuda"
    times = []
    for i in range(repeats + 1):
        with applied(setting, lm.module):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            workloads.run(lm, data, setting, options)
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first run warms up allocators and kernels
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_peak_memory(
    model: str | nn.Module | LoadedModel,
    *,
    setting: str | Setting = "fp32",
    workload: str = "train",
    batch: int = 1,
    seq: int = 64,
    optimizer: str = "adamw",
    new_tokens: int = 4,
    seed: int = 0,
    checkpoint: bool = False,
    optimizer_impl: str | None = None,
) -> MeasuredPeak:
    """The step's peak on a real CUDA device, counted as the prediction counts it: CUDA's
    `max_memory_allocated` over the step, less what was allocated before it (the model as
    loaded and the batch), plus the batch (the prediction counts the inputs, not the model as
    loaded: its step works on its own copies of the weights, see precision.applied)."""
    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed,
                         checkpoint=checkpoint, optimizer_impl=optimizer_impl)
    setting = cuda_to_measure(setting)
    lm, data = real_step(model, setting, options)
    input_bytes = sum(t.numel() * t.element_size() for t in data.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with applied(setting, lm.module):
        workloads.run(lm, data, setting, options)
        torch.cuda.synchronize()
    return MeasuredPeak(
        device=torch.cuda.get_device_name(),
        max_memory_allocated=torch.cuda.max_memory_allocated() - before + input_bytes,
        raw_max_memory_allocated=torch.cuda.max_memory_allocated(),
        allocated_before=before,
    )
