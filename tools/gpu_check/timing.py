"""How gpu_check times things, logs progress, keeps to its time boxes and leaves torch's global
settings as it found them.

On CUDA a kernel's time is read from CUDA events around it (the host returns before the GPU has
finished, so a wall clock would time the launch); on the CPU, where `--device cpu --tiny` checks
the plumbing, `time.perf_counter` around the call is the time.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ampscope.precision import GlobalState, matmul

_START = time.monotonic()


def log(message: str) -> None:
    """One progress line on stderr, with the time and the seconds since start, flushed at once: on the GPU
    machine the output comes back only as a tail, and a line held in a buffer is lost on a kill."""
    print(f"[gpu_check {time.strftime('%H:%M:%S')} +{time.monotonic() - _START:.1f} s] {message}",
          file=sys.stderr, flush=True)


@dataclass
class Box:
    """A part's time box: `left()` seconds until `seconds` after it was opened. Items inside a
    part check `over()` before starting, so a part ends early (with what it measured so far)
    rather than pushing the whole check past its limit."""

    name: str
    seconds: float
    opened: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.opened)

    def over(self) -> bool:
        return self.left() <= 0


class Clock:
    """Times a callable on one device: `median_seconds(fn)` runs `warmup` calls, then `repeats`
    timed ones, and returns the median (the median: one slow call, a clock change, a context
    switch, moves it little)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def once(self, fn: Callable[[], object]) -> float:
        """Seconds of one call of `fn`, the device's work included."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    def median_seconds(self, fn: Callable[[], object], *, warmup: int = 3,
                       repeats: int = 10) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        return statistics.median(self.once(fn) for _ in range(repeats))


def _legacy_precision() -> tuple[str, bool] | None:
    """The float32 matmul precision and cuBLAS's allow_tf32 as the legacy API reads them; None
    where reading them raises (the user has mixed the legacy and the per-backend APIs)."""
    try:
        return torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:
        return None


@contextlib.contextmanager
def restored_settings() -> Iterator[None]:
    """The body may change torch's global settings (float32 matmul precision, autocast, default
    dtype, grad mode, RNG); afterwards they are as before, also on error. ampscope's own
    `GlobalState` saves them, the matmul precision per backend. Putting those values back
    through the per-backend API can leave the legacy API unreadable ("mix of the legacy and new
    APIs": after "medium", whose per-backend values differ between cuBLAS and oneDNN), so where
    the user's legacy read worked, the legacy values are set again, and the per-backend ones
    only where that did not give them back exactly."""
    saved = GlobalState.save()
    legacy = _legacy_precision()
    try:
        yield
    finally:
        saved.restore()
        if legacy is not None and _legacy_precision() != legacy:
            torch.set_float32_matmul_precision(legacy[0])
            if torch.backends.cuda.matmul.allow_tf32 != legacy[1]:
                torch.backends.cuda.matmul.allow_tf32 = legacy[1]
            if matmul.snapshot() != saved.fp32_precision:
                matmul.restore(saved.fp32_precision)


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """float32 matmuls in `precision` ("highest": fp32 CUDA cores; "high": TF32) for the body."""
    with restored_settings():
        torch.set_float32_matmul_precision(precision)
        yield


def free_memory(device: torch.device) -> None:
    """Release what the caching allocator holds and zero its peak counters, so that each item's
    peaks are its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def first_line(error: BaseException) -> str:
    """An error as one line: its type and its message's first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def is_oom(error: BaseException) -> bool:
    """Whether `error` is the device running out of memory (torch raises OutOfMemoryError on CUDA;
    a RuntimeError naming it elsewhere)."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)
