"""The GPU a report's step is predicted on, and the predicted step itself
(analysis/step_time.py), one rule for every report: `flops`, `trace`, `run` (each rank of
`run --nproc`), `matrix` and `diff`.

- `accelerator_for(given, setting)`: the accelerator given (`--gpu`, `gpu=`), else, for a cuda
  setting, this machine's GPU or the H100 an emulated CUDA run stands for; None otherwise (a
  CPU or MPS setting, an unknown GPU). MFU from a measured step time uses it too.
- `predicted_step(trace, gpu)`: the step's `StepTime` on that accelerator, or None where there
  is nothing to predict: a setting that is not cuda (a CPU step says nothing about a GPU's),
  a workload that is not one step (sampling), an accelerator without peak FLOP/s, a trace
  without a step's ops."""

from __future__ import annotations

import torch

from ampscope import hardware
from ampscope.analysis.step_time import StepTime, step_time
from ampscope.records import SettingRecord, Trace

# Workloads whose traced ops are one step: the built-in train and forward steps, and the steps
# a script ran (`run`); a sampling loop reruns a growing context, not a step.
STEP_WORKLOADS = ("train", "forward", "script", "custom")


def accelerator_for(given: hardware.Accelerator | str | None,
                    setting: SettingRecord) -> hardware.Accelerator | None:
    """The accelerator whose figures a report uses: the one given (a name of
    `hardware.table()` or an `Accelerator`), this machine's GPU, or the H100 an emulated CUDA
    run stands for (its setting's `gpu`, or an H100); None when unknown (MFU n/a, no
    prediction)."""
    if isinstance(given, str):
        given = hardware.by_name(given) if given else None
    if given is not None:
        return given
    if setting.device != "cuda":
        return None
    if setting.emulated or not torch.cuda.is_available():
        return hardware.stood_for("cuda", setting.gpu)
    return hardware.lookup(torch.cuda.get_device_name())


def predicted_step(trace: Trace, gpu: hardware.Accelerator | str | None = None
                   ) -> StepTime | None:
    """The traced step's predicted time on `gpu` (default: `accelerator_for`'s), or None where
    there is nothing to predict (module docstring)."""
    if trace.setting.device != "cuda" or trace.workload not in STEP_WORKLOADS:
        return None
    accelerator = accelerator_for(gpu, trace.setting)
    if accelerator is None or not accelerator.peak_flops:
        return None
    result = step_time(trace, accelerator)
    return result if result.seconds > 0 else None


__all__ = ["STEP_WORKLOADS", "accelerator_for", "predicted_step"]
