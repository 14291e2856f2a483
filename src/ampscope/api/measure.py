"""Measurements of an untraced step on this machine's real device: its wall time (for MFU)
and the allocator's peak (beside the predicted one): CUDA's own counter on a GPU, the
profiler's allocation events on the CPU.

Namesakes, the same concern at another layer: `train/measure.py`."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
from torch import nn

from ampscope import workloads
from ampscope.analysis.memory import MeasuredPeak
from ampscope.api.preparation import batch_for, resolved
from ampscope.errors import AmpscopeError
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import Setting
from ampscope.runs.environment import RunEnvironment
from ampscope.workloads import RunOptions


def real_step(model: str | nn.Module | LoadedModel, setting: Setting,
              options: RunOptions) -> tuple[LoadedModel, Batch]:
    """The model and batch of an untraced, measured step on this machine's real device."""
    lm = RunEnvironment(setting).load(model)
    return lm, batch_for(lm, None, options, device=setting.run_device)


def peak_to_measure(setting: str | Setting) -> Setting:
    """The setting, if it runs for real on a CUDA device or on the CPU here; else the one-line
    refusal of `memory --measure` (checked before any tracing)."""
    setting = resolved(setting)
    if setting.device not in ("cuda", "cpu") or setting.emulated:
        raise AmpscopeError(
            f"--measure needs a real CUDA device or the CPU and {setting.name} runs "
            f"{'emulated ' if setting.emulated else ''}on {setting.run_device}; "
            "drop --device or choose a cpu setting"
        )
    return setting


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a batch's ids and targets may be views
    of one storage: the prediction counts it once, and so must the measurement)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure_step(model: str | nn.Module | LoadedModel, *, setting: str | Setting = "fp32",
                 repeats: int = 3, **options) -> float:
    """Median wall seconds of the untraced step on this machine, after one warm-up run.

    `options` are `RunOptions` fields, as for `trace`. Only a real device can be timed: an
    emulated setting is refused (give the step time instead)."""
    import statistics
    import time

    run_options = RunOptions(**options)
    setting = resolved(setting)
    if setting.emulated:
        raise AmpscopeError(
            f"cannot time {setting.name} here: this machine has no {setting.device}; "
            "give the measured step time with --step-time SECONDS"
        )
    lm, data = real_step(model, setting, run_options)
    cuda = setting.device == "cuda"
    times = []
    for i in range(repeats + 1):
        with RunEnvironment(setting).applied(lm.module):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            workloads.run(lm, data, setting, run_options)
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first run warms up allocators and kernels
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_peak_memory(model: str | nn.Module | LoadedModel, *,
                        setting: str | Setting = "fp32", **options) -> MeasuredPeak:
    """The step's peak on this machine's real device, counted as the prediction counts it: the
    step's own copies of the weights and the batch, plus the most bytes the step allocated on
    top of them (see precision.applied: the step works on its own copies of the weights)."""
    run_options = RunOptions(**options)  # its fields, as for `trace`
    setting = peak_to_measure(setting)
    lm, data = real_step(model, setting, run_options)
    if setting.device == "cpu":
        return _cpu_peak(lm, data, setting, run_options)
    input_bytes = _storage_bytes(data.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with RunEnvironment(setting).applied(lm.module):
        workloads.run(lm, data, setting, run_options)
        torch.cuda.synchronize()
    return MeasuredPeak(
        device=torch.cuda.get_device_name(),
        source="torch.cuda.max_memory_allocated",
        max_memory_allocated=torch.cuda.max_memory_allocated() - before + input_bytes,
        raw_max_memory_allocated=torch.cuda.max_memory_allocated(),
        allocated_before=before,
    )


def _cpu_peak(lm: LoadedModel, data: Batch, setting: Setting,
              options: RunOptions) -> MeasuredPeak:
    """The CPU has no peak counter: the profiler records every allocation and free of the step
    (`profile_memory=True`), and replaying them in time order gives the most bytes live at
    once, relative to the start. Started inside `applied`, so that what applied keeps for
    itself (a copy of the RNG state) is not counted; the step's weights and batch, live at the
    start, are counted from their storages."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    from ampscope.runtime.predict import gc_paused

    # Garbage from before the step, collected during it, would be a free the profiler never
    # saw allocated: it lowers the replayed peak, and torch warns on stderr about it.
    gc.collect()
    with RunEnvironment(setting).applied(lm.module), gc_paused():
        module = lm.module
        start = _storage_bytes([*module.parameters(), *module.buffers(), *data.values()])
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _fd2_silenced():
            prof.start()
        try:
            workloads.run(lm, data, setting, options)
        finally:
            with _fd2_silenced():
                prof.stop()
    # The events torch's own parser reads (torch.autograd.profiler_util): one "[memory]" event
    # per allocation (+bytes) and free (-bytes), each with its time. (nbytes: a method of the
    # C++ event that torch's stub of _KinetoEvent leaves out.)
    profiler = prof.profiler
    assert profiler is not None and profiler.kineto_results is not None  # (set by stop())
    events = sorted((e.start_ns(), e.nbytes())  # type: ignore[attr-defined]
                    for e in profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return MeasuredPeak(device="cpu", source="torch.profiler memory events",
                        max_memory_allocated=start + peak, raw_max_memory_allocated=peak,
                        allocated_before=start)


@contextlib.contextmanager
def _fd2_silenced() -> Iterator[None]:
    """Kineto writes a "profiler_start" / "profiler_stop" line straight to file descriptor 2
    when the profiler starts and stops, whatever its log level: `--measure` silences those two
    moments (never the step), so that stderr keeps only what ampscope says."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
