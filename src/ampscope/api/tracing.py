"""`trace`, `matrix` and `capture`: one workload under a setting, several settings side by
side, and the user's own code, recorded into Traces."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from ampscope import hardware, workloads
from ampscope.analysis.checks import judge
from ampscope.analysis.compare import Matrix, build_matrix
from ampscope.analysis.diagnosis import diagnose
from ampscope.analysis.memory import memory_report
from ampscope.api.gpu_time import predicted_step
from ampscope.api.preparation import batch_for, inputs_in_param_dtype, plan, resolved
from ampscope.defaults import DEFAULT_MATRIX_SETTINGS
from ampscope.errors import AmpscopeError, DtypeMismatchError
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import (
    DEVICES,
    Setting,
)
from ampscope.records import Trace, dtype_name
from ampscope.render.style import format_bytes
from ampscope.runs.environment import RunEnvironment, exact_retry
from ampscope.runs.session import Capture
from ampscope.runs.source import source_line
from ampscope.runtime.compiled import SETTING_COMPILE_NOTE
from ampscope.runtime.emulation import device_api_error
from ampscope.runtime.predict import (
    data_dependent,
    fake_batch,
    gc_paused,
    value_needed_error,
)
from ampscope.torchcompat.ops import AMP_UPDATE_SCALE_NAME
from ampscope.tricks import TrickFailed, exact, exact_path
from ampscope.workloads import DEFAULT_OPTIONS, RunOptions

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)

# Findings and checks filled in, a check silenced by a comment on the user's line.
judged = partial(judge, line_of=source_line)


def trace(
    model: str | nn.Module | LoadedModel,
    inputs: torch.Tensor | Batch | None = None,
    *,
    setting: str | Setting = "fp32",
    workload: workloads.Workload = "train",
    batch: int = 1,
    seq: int = 64,
    optimizer: str = "adamw",
    new_tokens: int = 4,
    seed: int = 0,
    predict: bool | None = None,
    checkpoint: bool = False,
    optimizer_impl: str | None = None,
    exact: bool = False,
    every_block: bool = False,
    values: bool = False,
    gpu: str | hardware.Accelerator | None = None,
) -> Trace:

    """Run `workload` once under `setting` and return what every tensor's dtype was.

    A setting on a device this machine lacks (`cuda:fp32+amp-bf16` on a laptop) is emulated:
    the run happens on the CPU with the device's autocast policy. `predict=True` runs on fake
    tensors (no memory: any model size); `None`, the default, predicts too, unless the model
    reads a tensor's value (then it runs for real, with a note); `False` always runs for real.
    `checkpoint=True` recomputes each repeated block's activations in backward
    (`torch.utils.checkpoint`); `optimizer_impl` is "for-loop", "foreach" or "fused" (default:
    PyTorch's choice on the setting's device). `exact=True` (or its older name
    `every_block=True`) takes none of a predicted run's speed tricks (ampscope.tricks; each in
    docs/api.md) and dispatches every op: the same trace, slower. `values=True` also records
    what the values say (`Trace.values`: inf/NaN, activations near the format's limit, 16-bit
    updates that round away, judged by the checks AMP303, AMP304, AMP401): a real run, so
    `predict` None means False then (`predict=True` records no values). `gpu` (a name of
    `hardware.table()` or an `Accelerator`) is the GPU an emulated cuda setting's virtual device
    is: what the model's code sees (name, memory, compute capability) and the kernels chosen by
    capability (SDPA's); default: an H100.

    The model — parameters, buffers, gradients, hooks, training flag — and torch's global state
    (autocast, matmul precision, default dtype, RNG) are exactly as before afterwards, also when
    the model raised. Random token ids are made when `inputs` is None.
    """
    if values and predict is None:
        predict = False  # values need real tensors
    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed, predict, checkpoint,
                         optimizer_impl, exact or every_block, values)
    return trace_run(model, inputs, setting=setting, options=options, gpu=gpu)


def trace_run(model: str | nn.Module | LoadedModel, inputs: torch.Tensor | Batch | None = None,
              *, setting: str | Setting = "fp32", options: RunOptions = DEFAULT_OPTIONS,
              gpu: str | hardware.Accelerator | None = None) -> Trace:
    """`trace` with its run options as one `RunOptions` (what the CLI and `matrix` pass on)."""
    # Built and run outside the caller's inference_mode: its tensors cannot take part in a
    # train step (precision.applied sets the other modes the run needs).
    # Building the model, its working copies, the records and the findings make hundreds of
    # thousands of objects and no garbage: the collector would only walk them, again and again
    # (a tenth to a quarter of a large predicted run). It runs, as it did, only during a real
    # run's step, whose tensors a collection may free.
    collecting = gc.isenabled()
    setting = resolved(setting)
    with torch.inference_mode(False), exact_path(options.exact), gc_paused():
        try:
            return exact_retry(lambda: _traced(model, inputs, setting, options, collecting, gpu),
                               what="the step is traced")
        except _ValuesNeeded as needed:
            # Predicted by default, but the model reads a value: run it for real, and say why.
            result = _traced(model, inputs, setting, replace(options, predict=False), collecting,
                             gpu)
            result.notes.insert(0, f"Run for real: the model reads a tensor's value{needed.what}, "
                                   "which a fake tensor has none of.")
            return result


def _fake_mask(lm: LoadedModel, result: Trace) -> bool:
    """A predicted transformers model whose attention got a mask (a 4th tensor)."""
    return type(lm.module).__module__.startswith("transformers.") and any(
        "scaled_dot_product" in o.op and len(o.inputs) >= 4
        for o in result.ops if o.phase == "forward")


class _TrickSuspect(TrickFailed):
    """A predicted run that took speed tricks raised: run again on the exact path, whose error
    (if it raises too) is the one to report."""


class _ValuesNeeded(Exception):
    """A run predicted by default stopped because the model read a value."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def _traced(model: str | nn.Module | LoadedModel, inputs: torch.Tensor | Batch | None,
            setting: Setting, options: RunOptions, collecting: bool,
            gpu: str | hardware.Accelerator | None = None) -> Trace:
    workload_name = options.workload_name
    env = RunEnvironment(setting, gpu=gpu)
    lm, notes = plan(model, env, workload_name, options.optimizer, options.predict,
                     have_inputs=inputs is not None)
    predict = env.predict
    if not predict and inputs is None and options.batch * options.seq >= _PEAK_CHECK_TOKENS:
        _check_peak(lm, setting, options, gpu)
    with env.applied(lm.module):
        data = batch_for(lm, inputs, options, device=setting.run_device)
        if inputs is not None:
            data, cast = inputs_in_param_dtype(data, setting)
            if cast:
                assert setting.param_dtype is not None  # (inputs are cast to that dtype only)
                notes.append(f"Float inputs {', '.join(cast)} were cast to "
                             f"{dtype_name(setting.param_dtype)}, the parameters' dtype, as a "
                             f"script would under {setting.name} (no autocast to do it).")
                log.info("%s", notes[-1])
        capture = env.capture(lm.module, model_name=lm.name, workload=workload_name,
                              values=options.values)
        try:
            with env.predicting(collecting=collecting):
                run_data = fake_batch(data, env.fake) if env.fake is not None else data
                with env.recording(capture):
                    outputs = workloads.run(lm, run_data, setting, options, predict=predict)
        except TrickFailed:
            raise
        except Exception as e:
            if predict and data_dependent(e):
                if options.predict is None:
                    op = getattr(e, "func", None)
                    raise _ValuesNeeded(f" ({op})" if op is not None else "") from e
                raise value_needed_error(lm.name, workload_name, e) from e
            if setting.emulated and (device_error := device_api_error(e, setting.device)):
                raise device_error from e
            diagnosis = diagnose(capture.failure)
            if diagnosis is not None:
                raise DtypeMismatchError(diagnosis) from e
            if predict and not exact() and not isinstance(e, AmpscopeError):
                # Maybe the model's error, maybe a speed trick's on this torch build: the exact
                # path tells (exact_retry runs the step again on it).
                raise _TrickSuspect(str(e)) from e
            raise
        result = capture.finish(inputs=run_data, outputs=outputs)
    result.mode = "predict" if predict else "run"
    if predict and _fake_mask(lm, result):
        notes.append("transformers treats fake tensors as tracing and built its attention mask "
                     "explicitly, where a real run without padding passes is_causal=True and no "
                     "mask: the predicted step has the mask's ops and storage (--real for the "
                     "real step's).")
    if predict and any(o.op == AMP_UPDATE_SCALE_NAME for o in result.ops):
        notes.append("GradScaler's check for inf/NaN gradients reads a value, which a fake "
                     "tensor has none of: the step was predicted as taken (finite gradients).")
        log.info("%s", notes[-1])
    if setting.compiled:
        notes.append(SETTING_COMPILE_NOTE)
    notes += env.emulation_notes(result, workload_name)
    result.notes = notes + result.notes  # what the capture itself noted comes last
    result.notes += env.device_notes()
    judged(result)
    return result


# From this many tokens a step's activations can outgrow its weights: a real run is first
# predicted on fake tensors (seconds, whatever the size) and its peak held to the free memory.
_PEAK_CHECK_TOKENS = 4096


def _check_peak(lm: LoadedModel, setting: Setting, options: RunOptions,
                gpu: str | hardware.Accelerator | None = None) -> None:
    """Refuse a real run whose predicted peak, plus the model as loaded, does not fit in the
    memory free here. (A model that reads values cannot be predicted: its real run, the
    fallback, is not checked.)"""
    from ampscope.models.registry import available_memory_bytes

    available = available_memory_bytes() if setting.run_device == "cpu" else None
    if available is None:
        return
    predicted = trace_run(lm, None, setting=setting, options=replace(options, predict=True),
                          gpu=gpu)
    loaded = sum(p.numel() * p.element_size() for p in lm.module.parameters())
    needed = memory_report(predicted).peak.bytes + loaded
    if needed > available:
        raise AmpscopeError(
            f"a real run of {lm.name} would not fit: its predicted peak is "
            f"{format_bytes(needed)} (the step's {format_bytes(needed - loaded)} and the model as "
            f"loaded), more than the {format_bytes(available)} free here; predict it on fake "
            "tensors (drop --real) or make the batch or sequence smaller")


def matrix(
    model: str | nn.Module | LoadedModel,
    inputs: torch.Tensor | Batch | None = None,
    *,
    settings: Sequence[str | Setting] = DEFAULT_MATRIX_SETTINGS,
    workload: workloads.Workload = "train",
    batch: int = 1,
    seq: int = 64,
    optimizer: str = "adamw",
    new_tokens: int = 4,
    seed: int = 0,
    predict: bool | None = None,
    checkpoint: bool = False,
    optimizer_impl: str | None = None,
    exact: bool = False,
    every_block: bool = False,
    on_setting: Callable[[int, str], None] | None = None,
    values: bool = False,
    gpu: str | hardware.Accelerator | None = None,
) -> tuple[Matrix, list[Trace]]:
    """Trace one workload under each setting (same weights, same batch) and line them up.

    `on_setting(i, name)` is called before setting i runs (for a progress display). `values`:
    as for `trace`. Each cuda setting's step is predicted on `gpu` (a name of
    `hardware.table()` or an `Accelerator`; default: this machine's GPU, an H100 for emulated
    CUDA): the matrix's whole-run rows show its time, bound, tokens/s and MFU. An emulated
    cuda setting also runs on `gpu` as its virtual device (as for `trace`).
    """
    if isinstance(gpu, str):
        gpu = hardware.by_name(gpu)  # an unknown name is refused before anything runs
    if values and predict is None:
        predict = False  # values need real tensors
    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed, predict, checkpoint,
                         optimizer_impl, exact or every_block, values)
    parsed = [resolved(s) for s in settings]
    if not parsed:
        raise AmpscopeError("give at least one setting")
    # One build per device: a model may make device-dependent choices when it is built
    # (nanochat's bf16 embedding on CUDA); the same seed gives every build the same weights.
    plans: dict[str, tuple[LoadedModel, bool]] = {}
    traces = []
    failures: list[tuple[str, str]] = []
    first_error: Exception | None = None
    for i, s in enumerate(parsed):
        if on_setting is not None:
            on_setting(i, s.name)
        if s.device not in plans:
            env = RunEnvironment(s, gpu=gpu)
            lm, _ = plan(model, env, options.workload_name, options.optimizer, options.predict,
                         have_inputs=inputs is not None)
            plans[s.device] = (lm, env.predict)
        lm, decided = plans[s.device]
        try:
            traces.append(trace_run(lm, inputs, setting=s,
                                    options=replace(options, predict=decided), gpu=gpu))
        except Exception as e:  # noqa: BLE001 - one setting's failure is a column, not the end
            first_error = first_error or e
            failures.append((s.name, _why(e)))
    if not traces:
        assert first_error is not None
        raise first_error
    return build_matrix(traces, tuple(failures), tuple(s.name for s in parsed),
                        predicted=[predicted_step(t, gpu) for t in traces]), traces


def _why(e: Exception) -> str:
    """A setting's failure in one line: ampscope's own message, or the error's type and text."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if isinstance(e, AmpscopeError) else f"{type(e).__name__}: {text}"


def capture(model: nn.Module, *, name: str | None = None, device: str | None = None,
            gpu: str | hardware.Accelerator | None = None
            ) -> contextlib.AbstractContextManager[Trace]:
    """`with ampscope.capture(model) as t: ...` records whatever runs inside into the Trace `t`.

    The model's own code, autocast regions and optimizer run as written; ampscope only watches.
    With `device` ("cuda", "mps", "xpu") on a machine that lacks it, the code inside runs on
    the virtual device: it sees that device, and its autocast follows that device's policy;
    `gpu` names the GPU an emulated cuda device is (as for `trace`).
    """
    if device is not None and device not in DEVICES:
        raise AmpscopeError(f"unknown device {device!r}; choose {', '.join(DEVICES)}")
    env = RunEnvironment(device=device, gpu=gpu)
    recorder = env.capture(model, model_name=name, workload="custom", judge=judged,
                           explain_failure=_explain, device=device)
    if env.virtual is None:
        return recorder
    return _on_virtual_device(env, recorder)


@contextlib.contextmanager
def _on_virtual_device(env: RunEnvironment, recorder: Capture) -> Iterator[Trace]:
    with env.emulated(), recorder as trace, env.device_active(recorder):
        yield trace
    trace.notes += env.device_notes()


def _explain(failure) -> str | None:
    """The dtype-mismatch diagnosis of the call that raised, as a note's text."""
    diagnosis = diagnose(failure)
    return diagnosis.text() if diagnosis is not None else None
