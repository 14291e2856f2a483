"""What a training step costs on this machine: wall time, peak memory, FLOPs and MFU.

Timing an accelerator needs `torch.cuda.synchronize()` on both sides: kernels are queued
asynchronously, and without it a step "ends" when its last kernel is launched, not run.
Which peak memory is measured where, and how a CPU's is reset for each rung: docs/training.md
(the bench's "peak memory").

Namesakes, the same concern at another layer: `api/measure.py`."""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch
from torch import nn

from ampscope import hardware
from ampscope.precision import device_available


def default_device() -> str:
    """The device a training command uses when none is named: CUDA when there is one."""
    return "cuda" if device_available("cuda") else "cpu"


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU, which runs ops as called)."""
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif device == "cpu":
        # "5" resets the peak RSS (VmHWM) of this process, on Linux 4.0+; elsewhere the peak
        # stays the process's since it started.
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def peak_memory(device: str) -> tuple[int | None, str]:
    """Peak bytes since the last reset, and what they measure."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated(), "CUDA memory allocated"
    if device != "cpu":
        return None, "n/a"
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024, "process peak RSS"  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024, "process peak RSS"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return device


def accelerator(device: str) -> hardware.Accelerator | None:
    """This machine's accelerator in the peak-FLOP/s table; None on the CPU or an unknown GPU
    (MFU is then n/a rather than measured against a guess)."""
    return hardware.lookup(torch.cuda.get_device_name()) if device == "cuda" else None


def flops_per_token(module: nn.Module, seq: int) -> tuple[int, str]:
    """Training FLOPs per token (forward + backward), and which formula gave them.

    The reference models know their own count (`estimate_flops`: 6·N + 12·L·H·Q·T, attention
    included); any other model gets Kaplan et al.'s 6·N, which leaves attention out.
    """
    estimate = getattr(module, "estimate_flops", None)
    if callable(estimate):
        return int(estimate(seq)), "6·N + 12·L·H·Q·T (the model's estimate_flops)"
    n = sum(p.numel() for p in module.parameters())
    return 6 * n, "6·N (no attention term)"


def mfu(flops: float, dtype: torch.dtype | None, seconds: float,
        acc: hardware.Accelerator | None, matmul_precision: str) -> float | None:
    """Model FLOPs utilisation of one step whose matmuls all ran in `dtype`. A dtype of None
    (a native setting's, as the bench gives it) has no peak: None, as for any unknown peak."""
    name = str(dtype).removeprefix("torch.")
    return hardware.mfu({name: flops}, seconds, acc, matmul_precision)
