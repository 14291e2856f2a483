"""The reports built on a trace or on values: `memory`, `flops`, `numerics`, and the autocast
`policy` of this build."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ampscope import hardware, workloads
from ampscope.analysis import autocast
from ampscope.analysis.autocast import PolicyReport
from ampscope.analysis.findings import derive_findings
from ampscope.analysis.flops import FlopReport, flop_report, utilization
from ampscope.analysis.memory import MemoryReport, memory_report
from ampscope.analysis.numerics import NumericsReport, compare_runs, ranges
from ampscope.analysis.summary import tokens_of
from ampscope.api.gpu_time import accelerator_for, predicted_step
from ampscope.api.measure import measure_peak_memory, measure_step, peak_to_measure
from ampscope.api.preparation import batch_for, resolved, run_shortfall
from ampscope.api.tracing import trace
from ampscope.defaults import DEFAULT_NUMERICS_SETTINGS
from ampscope.errors import AmpscopeError
from ampscope.hardware.cuda_allocator import environment_config
from ampscope.models.base import Batch, LoadedModel
from ampscope.models.loading import load
from ampscope.precision import (
    DEVICES,
    DTYPES,
    Setting,
    default_autocast_dtype,
    policy_history,
)
from ampscope.precision.quiz import quiz as run_quiz
from ampscope.records import Finding, Trace, dtype_name
from ampscope.runs.environment import RunEnvironment
from ampscope.runs.values import Values, as_float64, read_grads, read_weights, recording_values
from ampscope.runtime.autocast_policy import read_policy
from ampscope.workloads import RunOptions


def memory(
    model: str | nn.Module | LoadedModel | Trace,
    inputs: torch.Tensor | Batch | None = None,
    *,
    measure: bool = False,
    **options,
) -> MemoryReport:
    """Trace one step (options as for `trace`) and account for every byte it held: by category
    and dtype, the peak and where it happens, the live-bytes timeline, and the formulas people
    use beside the counted figure. `measure=True` (a real CUDA device only; refused before
    anything is traced elsewhere) also runs the step untraced and adds the allocator's peak.

    Given a `Trace` (from `trace`, `capture`, `run_script` or `Trace.from_dict`), the report is
    computed from it, with nothing run again. On a cuda setting the caching allocator is
    replayed with the options of this process's PYTORCH_CUDA_ALLOC_CONF."""
    if measure and not isinstance(model, Trace):
        peak_to_measure(options.get("setting", "fp32"))  # refused before anything is traced
    # Read before the run, so that a malformed value stops a cuda run before it is traced; it
    # concerns only CUDA's allocator, so a run on another device goes on without it.
    allocator, unreadable = environment_config()
    if unreadable is not None and _names_cuda(options):
        raise unreadable
    traced = _traced(model, inputs, options, measure=measure)
    if unreadable is not None and traced.setting.device == "cuda":
        raise unreadable
    report = memory_report(traced, allocator=allocator)
    if measure:
        assert not isinstance(model, Trace)  # (refused by _traced: a Trace cannot be measured)
        real = {k: v for k, v in options.items() if k != "predict"}
        report.measured = measure_peak_memory(model, **real)
    return report


def _names_cuda(options: dict) -> bool:
    """Whether a run's options already say it is a CUDA run (its setting or its device)."""
    setting = options.get("setting")
    return options.get("device") == "cuda" or (isinstance(setting, str)
                                               and setting.startswith("cuda:"))


def flops(
    model: str | nn.Module | LoadedModel | Trace,
    inputs: torch.Tensor | Batch | None = None,
    *,
    step_time: float | None = None,
    measure: bool = False,
    gpu: str | hardware.Accelerator | None = None,
    **options,
) -> FlopReport:
    """Trace one step (options as for `trace`) and count its FLOPs by phase, dtype and module,
    beside the conventions people quote (6·N·D, nanoGPT's 6N + 12·L·H·Q·T). A cuda setting's
    train or forward step is also predicted on `gpu` (`predicted`: time, where it goes,
    tokens/s, MFU; api/gpu_time.py).

    With the step's wall time — `step_time` seconds, or `measure=True` to time the untraced
    step on this machine's real device — the report adds throughput and MFU against `gpu`'s
    peaks (a name from `hardware.table()`, or an `Accelerator` of your own figures; default:
    this machine's GPU, an H100 for emulated CUDA), which an emulated cuda setting's code also
    sees as its device. An unknown name is refused at once. Given a
    `Trace`, the count is made from it, with nothing run again (`step_time` still applies)."""
    if isinstance(gpu, str):
        gpu = hardware.by_name(gpu) if gpu else None
    if step_time is not None and not (math.isfinite(step_time) and step_time > 0):
        raise AmpscopeError("the step time must be a positive number of seconds")
    # An emulated cuda setting runs on `gpu` as its virtual device too (api/tracing.py).
    run = options if isinstance(model, Trace) else {**options, "gpu": gpu}
    result = _traced(model, inputs, run, measure=measure)
    report = flop_report(result, tokens=tokens_of(result))
    report.predicted = predicted_step(result, gpu)
    if measure:
        assert not isinstance(model, Trace)  # (refused by _traced: a Trace cannot be measured)
        step_time = measure_step(model, **{k: v for k, v in options.items() if k != "predict"})
    if step_time is not None:
        report.utilization = utilization(report, step_time, accelerator_for(gpu, report.setting),
                                         report.setting.matmul_precision)
    return report


def findings(model: str | nn.Module | LoadedModel | Trace,
             inputs: torch.Tensor | Batch | None = None, **options) -> list[Finding]:
    """The findings of a trace in plain words, each with its cause: those of `model` traced
    with `options` (as for `trace`), or of a `Trace` already made (derived again from its
    records, so a trace read back from JSON gets them too)."""
    result = _traced(model, inputs, options)
    return derive_findings(result) if result is model else result.findings


def _traced(model: str | nn.Module | LoadedModel | Trace, inputs, options: dict, *,
            measure: bool = False) -> Trace:
    """The trace a report reads: `model` traced with `options`, or the Trace given, a finished
    run to which nothing that would change the run can apply."""
    if not isinstance(model, Trace):
        return trace(model, inputs, **options)
    given = [name for name, value in (("inputs", inputs), ("measure", measure)) if value]
    given += sorted(options)
    if given:
        raise AmpscopeError(
            f"{', '.join(given)} cannot apply to a Trace that has already run; pass the model "
            f"({model.model.name}) instead to run it again with them")
    return model


def numerics(
    model: str | nn.Module | LoadedModel,
    inputs: torch.Tensor | Batch | None = None,
    *,
    settings: Sequence[str | Setting] = DEFAULT_NUMERICS_SETTINGS,
    reference: str = "fp64",
    workload: str = "forward",
    batch: int = 1,
    seq: int = 64,
    optimizer: str = "adamw",
    seed: int = 0,
    on_setting: Callable[[int, str], None] | None = None,
) -> NumericsReport:
    """Run the same weights and inputs under each setting and under a higher-precision
    `reference` ("fp64" or "fp32"); compare every module's output, the loss and (train) the
    gradients; and report the range of the reference's activations, gradients and weights
    against fp16, bf16 and fp8. Real runs only: values are the point."""
    with torch.inference_mode(False):  # as trace_run: the caller's modes stay outside
        options = RunOptions(workload, batch, seq, optimizer, seed=seed, predict=False)
        if workload not in ("forward", "train"):
            raise AmpscopeError(f"numerics runs the forward or train workload, not {workload!r}")
        if reference not in ("fp64", "fp32"):
            raise AmpscopeError(f"the reference is fp64 or fp32, not {reference!r}")
        parsed = [resolved(s) for s in settings]
        if not parsed:
            raise AmpscopeError("give at least one setting")
        ref_setting = resolved(reference)
        lm = load(model, device="cpu", have_inputs=inputs is not None)
        shortfall = run_shortfall(lm, ref_setting, workload, optimizer, built_on_meta=False)
        if shortfall is not None:
            raise AmpscopeError(f"{shortfall}; numerics needs real values (no predict mode)")
        data = batch_for(lm, inputs, options)
        if on_setting is not None:
            on_setting(0, f"{reference} (reference)")
        ref = _values_of(lm, data, ref_setting, options)
        report = NumericsReport(lm.name, workload, reference, ranges=ranges(ref),
                                emulated=[s.name for s in parsed if s.emulated])
        for i, s in enumerate(parsed):
            if on_setting is not None:
                on_setting(i + 1, s.name)
            report.settings.append(compare_runs(s.name, _values_of(lm, data, s, options), ref))
        return report


def _values_of(lm: LoadedModel, data: Batch, setting: Setting, options: RunOptions) -> Values:
    with RunEnvironment(setting).applied(lm.module):
        run_data = {k: v.to(setting.run_device, copy=v.is_inference()) for k, v in data.items()}
        torch.manual_seed(options.seed)  # the same dropout masks in every run (restored after)
        with recording_values(lm.module, fp8=setting.fp8 is not None) as values:
            read_weights(lm.module, values)
            out = workloads.run(lm, run_data, setting, options)
        if "loss" in out:
            values.loss = as_float64(out["loss"])
        read_grads(lm.module, values)
    return values


def policy(device: str = "cpu", dtype: str | None = None, *, op: str | None = None,
           compare: tuple[str, str] | None = None, quiz: bool = False,
           history: bool = False) -> PolicyReport:
    """The autocast policy of this PyTorch build, read from the build itself: `device`'s ops by
    category; with `compare`, only the ops where two devices differ; with `quiz`, what common
    expressions return on cpu, cuda and mps (or the two compared devices). `dtype` is "bf16" or
    "fp16" (default: the first device's own autocast dtype); `op` keeps op names containing it;
    with `history`, how `device`'s policy changed in earlier releases for the ops GPT-style
    models call (precision/policy_history.json), each change marked as in this build or not."""
    devices = tuple(compare) if compare else (device,)
    for d in devices:
        if d not in DEVICES:
            raise AmpscopeError(f"unknown device {d!r}; choose {', '.join(DEVICES)}")
    if dtype is not None and dtype not in DTYPES:
        raise AmpscopeError(f"unknown autocast dtype {dtype!r}; choose bf16 or fp16")
    torch_dtype = DTYPES[dtype] if dtype else default_autocast_dtype(devices[0])
    name = dtype_name(torch_dtype)
    version = torch.__version__
    if history:
        found = policy_history.for_device(device, op)
        return PolicyReport(name, version, device=device, history=found,
                            in_build=tuple(policy_history.applies(c) for c in found))
    if quiz:
        asked = devices if compare else ("cpu", "cuda", "mps")
        return PolicyReport(name, version, quiz={d: run_quiz(d, torch_dtype) for d in asked})
    if compare:
        a, b = (read_policy(d, torch_dtype) for d in devices)
        return PolicyReport(name, version, devices=(devices[0], devices[1]),
                            rows=autocast.compare(a, b, op))
    rules = read_policy(device, torch_dtype)
    rows = autocast.table(rules, op)
    if not rows and op:
        raise AmpscopeError(
            f"no op containing {op!r} is on {device}'s autocast list: it follows "
            f"its inputs there (try --compare cpu cuda --op {op})"
        )
    return PolicyReport(name, version, device=device, rows=rows, total=len(rules))
