"""The Python API: `trace()` runs a workload under a setting; `capture()` records user code."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn

from ampscope import hardware, workloads
from ampscope.analysis import autocast
from ampscope.analysis.autocast import PolicyReport
from ampscope.analysis.compare import Matrix, build_matrix
from ampscope.analysis.diagnosis import diagnose
from ampscope.analysis.findings import derive_findings
from ampscope.analysis.flops import FlopReport, flop_report, utilization
from ampscope.analysis.memory import MeasuredPeak, MemoryReport, memory_report
from ampscope.analysis.numerics import NumericsReport, compare_runs, ranges
from ampscope.analysis.summary import numel
from ampscope.errors import AmpscopeError, DtypeMismatchError
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import (
    DEVICES,
    DTYPES,
    Setting,
    applied,
    default_autocast_dtype,
    device_available,
    parse_setting,
    resolve_device,
)
from ampscope.precision.autocast_policy import read_policy
from ampscope.precision.emulation import Emulation, device_api_error
from ampscope.precision.predict import (
    check_matmul_dtypes,
    data_dependent,
    fake_batch,
    fake_mode,
    predicting,
    value_needed_error,
)
from ampscope.precision.quiz import quiz as run_quiz
from ampscope.precision.virtual_device import VirtualDevice
from ampscope.recorders.session import Capture
from ampscope.recorders.values import Values, as_float64, read_grads, read_weights, recording_values
from ampscope.records import SettingRecord, Trace, dtype_name
from ampscope.render.style import format_bytes
from ampscope.workloads import DEFAULT_OPTIONS, RunOptions


def load(model: str | nn.Module | LoadedModel, device: str = "cpu", *,
         have_inputs: bool = False, target_device: str | None = None,
         virtual: VirtualDevice | None = None) -> LoadedModel:
    """A model spec, a module or a LoadedModel, as a LoadedModel.

    `target_device` is the device an emulated run stands for (see registry.resolve); with
    `virtual`, a spec's own code (a factory, the module it imports) runs on that virtual device,
    backed by `device`."""
    from ampscope.models import registry

    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, nn.Module):
        try:
            return registry.wrap_module(model, type(model).__name__)
        except AmpscopeError:
            if not have_inputs:
                raise AmpscopeError(
                    f"pass inputs= (a tensor or a dict of tensors) to trace this "
                    f"{type(model).__name__}: it has no config.vocab_size and block_size to "
                    "make token ids from"
                ) from None
            # With inputs given, nothing needs the vocabulary or context length; the batch is
            # the forward's arguments by name (train: the forward returns the loss).
            return LoadedModel(type(model).__name__, model, vocab_size=0, max_seq_len=2**62,
                               logits_fn=_call_with_batch, loss_fn=_loss_of_call)
    if isinstance(model, str):
        if virtual is None:
            return registry.resolve(model, device=device, target_device=target_device)
        with virtual.active(backing=device):
            return registry.resolve(model, device=device, target_device=target_device,
                                    build_device=virtual.target)
    raise AmpscopeError(f"cannot trace a {type(model).__name__}; pass a model name or an nn.Module")


def _run_shortfall(lm: LoadedModel, setting: Setting, workload: str, optimizer: str, *,
                   built_on_meta: bool) -> str | None:
    """Why a real run clearly cannot fit, in one line, or None: the working copy of the
    weights, and for a train step their gradients and optimizer state, on top of the model as
    loaded (a model still on meta would first be built in float32)."""
    from ampscope.models.registry import memory_needed_message

    per_param = 1  # the run's own copy of every weight (see precision.applied)
    if workload not in ("forward", "generate"):  # a custom step may train: count as one
        per_param += 1 + {"adamw": 2, "adam": 2, "sgd": 1}[optimizer]
    itemsize = torch.empty((), dtype=setting.param_dtype).element_size()
    what = (f"as {per_param} {dtype_name(setting.param_dtype)} copies of the weights "
            f"for a {workload} run")
    bytes_per_parameter = per_param * itemsize
    if built_on_meta:
        bytes_per_parameter += 4
        what = "built in float32 and " + what
    return memory_needed_message(lm.name, lm.num_parameters, bytes_per_parameter=bytes_per_parameter,
                                 what=what, device=setting.run_device)


def _inputs_in_param_dtype(data: Batch, setting: Setting) -> tuple[Batch, list[str]]:
    """Under a low-precision setting without autocast, float inputs in another float dtype
    become the parameters' dtype (a model's first layer would refuse them otherwise)."""
    low = setting.param_dtype in (torch.bfloat16, torch.float16)
    if not low or setting.autocast_dtype is not None:
        return data, []
    cast = [k for k, v in data.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
            and v.dtype != setting.param_dtype]
    return {k: v.to(setting.param_dtype) if k in cast else v for k, v in data.items()}, cast


def _call(module: nn.Module, batch: Batch):
    """The forward called with the batch: by name where the forward has those parameters,
    else in order (a lone tensor named `idx` for a forward that takes `x`)."""
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        names = {}
    if set(batch) <= set(names):
        return module(**batch)
    return module(*batch.values())


def _call_with_batch(module: nn.Module, batch: Batch):
    out = _call(module, batch)
    return out[0] if isinstance(out, tuple) else out


def _loss_of_call(module: nn.Module, batch: Batch) -> torch.Tensor:
    out = _call(module, batch)
    candidates = out if isinstance(out, tuple) else (out,)
    loss = next((t for t in candidates if isinstance(t, torch.Tensor) and t.dim() == 0), None)
    if loss is None:
        raise AmpscopeError(f"a train step needs a loss: {type(module).__name__}.forward returned "
                            "no scalar tensor; pass workload=a callable that computes it")
    return loss


def _as_batch(lm: LoadedModel, inputs, workload: str) -> Batch:
    if isinstance(inputs, torch.Tensor):
        batch = {lm.input_name: inputs}
        if workload == "train" and not lm.targets_are_shifted_inputs:
            batch[lm.target_name] = inputs  # HF-style: labels are the inputs, shifted inside
        elif workload == "train":
            raise AmpscopeError(
                f"a train step needs targets: pass inputs={{'{lm.input_name}': ..., "
                f"'{lm.target_name}': ...}}"
            )
        return batch
    if isinstance(inputs, tuple):
        # Positional arguments, as torch.export and torch.jit.trace take them: named by the
        # forward's own parameters, so the trace names them and a call passes them back.
        try:
            bound = inspect.signature(lm.module.forward).bind(*inputs)
        except TypeError as e:
            raise AmpscopeError(f"inputs={len(inputs)} positional arguments do not fit "
                                f"{type(lm.module).__name__}.forward: {e}") from e
        inputs = dict(bound.arguments)
    if isinstance(inputs, dict):
        # A tensor made under the caller's inference_mode cannot take part in autograd.
        return {k: v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v
                for k, v in inputs.items()}
    raise AmpscopeError("inputs must be a tensor of token ids, a dict of named tensors, or a "
                        "tuple of the forward's positional arguments")


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
) -> Trace:
    """Run `workload` once under `setting` and return what every tensor's dtype was.

    A setting on a device this machine lacks (`cuda:fp32+amp-bf16` on a laptop) is emulated:
    the run happens on the CPU with the device's autocast policy. `predict=True` runs on fake
    tensors (no memory: any model size); `None` chooses it when a real run would not fit.

    The model — parameters, buffers, gradients, hooks, training flag — and torch's global state
    (autocast, matmul precision, default dtype, RNG) are exactly as before afterwards, also when
    the model raised. Random token ids are made when `inputs` is None.
    """
    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed, predict)
    return trace_run(model, inputs, setting=setting, options=options)


def trace_run(model: str | nn.Module | LoadedModel, inputs: torch.Tensor | Batch | None = None,
              *, setting: str | Setting = "fp32", options: RunOptions = DEFAULT_OPTIONS) -> Trace:
    """`trace` with its run options as one `RunOptions` (what the CLI and `matrix` pass on)."""
    # Built and run outside the caller's inference_mode: its tensors cannot take part in a
    # train step (precision.applied sets the other modes the run needs).
    with torch.inference_mode(False):
        return _trace_run(model, inputs, setting, options)


def _trace_run(model: str | nn.Module | LoadedModel, inputs: torch.Tensor | Batch | None,
               setting: str | Setting, options: RunOptions) -> Trace:
    setting = _resolved(setting)
    workload_name = options.workload_name
    lm, predict, notes = _plan(model, setting, workload_name, options.optimizer, options.predict,
                               have_inputs=inputs is not None)
    if not predict and inputs is None and options.batch * options.seq >= _PEAK_CHECK_TOKENS:
        predict = _peak_check(lm, setting, options, notes)
    fake = fake_mode() if predict else None
    virtual = VirtualDevice(setting.device) if setting.emulated else None
    with applied(setting, lm.module, fake=fake) as emulation:
        data = _batch_for(lm, inputs, options, device=setting.run_device)
        if inputs is not None:
            data, cast = _inputs_in_param_dtype(data, setting)
            if cast:
                notes.append(f"Float inputs {', '.join(cast)} were cast to "
                             f"{dtype_name(setting.param_dtype)}, the parameters' dtype, as a "
                             f"script would under {setting.name} (no autocast to do it).")
        capture = Capture(lm.module, model_name=lm.name, setting=setting.record(),
                          workload=workload_name,
                          op_check=check_matmul_dtypes if fake is not None else None)
        try:
            with predicting(fake) if fake is not None else contextlib.nullcontext():
                run_data = fake_batch(data, fake) if fake is not None else data
                with capture.recording(), _on_virtual(virtual, capture):
                    outputs = workloads.run(lm, run_data, setting, options, predict=predict)
        except Exception as e:
            if predict and data_dependent(e):
                raise value_needed_error(lm.name, workload_name, e) from e
            if setting.emulated and (device_error := device_api_error(e, setting.device)):
                raise device_error from e
            diagnosis = diagnose(capture.failure)
            if diagnosis is not None:
                raise DtypeMismatchError(diagnosis) from e
            raise
        result = capture.finish(inputs=run_data, outputs=outputs)
    result.mode = "predict" if predict else "run"
    if predict and any(o.op == "aten._amp_update_scale_.default" for o in result.ops):
        notes.append("GradScaler's check for inf/NaN gradients reads a value, which a fake "
                     "tensor has none of: the step was predicted as taken (finite gradients).")
    result.notes = (notes + (emulation.notes(workload_name) if emulation is not None else [])
                    + result.notes)  # what the capture itself noted comes last
    if virtual is not None:
        result.notes += virtual.notes()
    result.findings = derive_findings(result)
    return result


@contextlib.contextmanager
def _on_virtual(virtual: VirtualDevice | None, capture: Capture):
    """The run's code on the virtual device (when emulated), its memory calls answered by the
    capture's storage tracker."""
    if virtual is None:
        yield
        return
    virtual.memory = capture.memory_now
    with virtual.active():
        yield


# From this many tokens a step's activations can outgrow its weights: a real run is first
# predicted on fake tensors (seconds, whatever the size) and its peak held to the free memory.
_PEAK_CHECK_TOKENS = 4096


def _peak_check(lm: LoadedModel, setting: Setting, options: RunOptions, notes: list[str]) -> bool:
    """Whether the run must be predicted: its predicted peak, plus the model as loaded, does not
    fit in the memory free here. Refused instead when predicting was ruled out (--no-predict)."""
    from ampscope.models.registry import available_memory_bytes

    available = available_memory_bytes() if setting.run_device == "cpu" else None
    if available is None:
        return False
    predicted = _trace_run(lm, None, setting, replace(options, predict=True))
    loaded = sum(p.numel() * p.element_size() for p in lm.module.parameters())
    needed = memory_report(predicted).peak.bytes + loaded
    if needed <= available:
        return False
    why = (f"its predicted peak is {format_bytes(needed)} (the step's "
           f"{format_bytes(needed - loaded)} and the model as loaded), more than the "
           f"{format_bytes(available)} free here")
    if options.predict is False:
        raise AmpscopeError(f"a real run of {lm.name} would not fit: {why}; predict it on fake "
                            "tensors (--predict) or make the batch or sequence smaller")
    notes.append(f"Predicted on fake tensors because a real run would not fit: {why}.")
    return True


def _resolved(setting: str | Setting) -> Setting:
    return resolve_device(parse_setting(setting) if isinstance(setting, str) else setting)


def _batch_for(lm: LoadedModel, inputs: torch.Tensor | Batch | None, options: RunOptions, *,
               device: str = "cpu") -> Batch:
    """The run's batch: the inputs given, or random token ids of the options' size."""
    if inputs is not None:
        return _as_batch(lm, inputs, options.workload_name)
    if options.seq > lm.max_seq_len:
        raise AmpscopeError(f"seq {options.seq} exceeds {lm.name}'s context length "
                            f"{lm.max_seq_len}")
    generator = torch.Generator().manual_seed(options.seed)
    return lm.make_batch(options.batch, options.seq, options.workload_name, generator,
                         device=device)


def _plan(model: str | nn.Module | LoadedModel, setting: Setting, workload: str, optimizer: str,
          predict: bool | None, *, have_inputs: bool) -> tuple[LoadedModel, bool, list[str]]:
    """The model to run and whether to predict: a named model is first built on the meta device
    (nothing allocated) to count what a real run would need."""
    notes: list[str] = []
    target = setting.device if setting.emulated else None
    virtual = VirtualDevice(target) if target else None
    on_meta = isinstance(model, str)
    lm = load(model, device="meta" if on_meta else setting.run_device, have_inputs=have_inputs,
              target_device=target, virtual=virtual)
    shortfall = _run_shortfall(lm, setting, workload, optimizer, built_on_meta=on_meta)
    if predict is None:
        predict = shortfall is not None
        if predict:
            notes.append(f"Predicted on fake tensors because a real run would not fit: {shortfall}.")
    elif predict:
        notes.append("Predicted on fake tensors, as asked: no weight was materialised.")
    elif shortfall is not None:
        raise AmpscopeError(f"{shortfall}, or predict it on fake tensors (--predict)")
    if on_meta and not predict:
        assert isinstance(model, str)
        lm = load(model, device=setting.run_device, target_device=target, virtual=virtual)
    return lm, predict, notes


DEFAULT_MATRIX_SETTINGS = ("fp32", "bf16", "fp32+amp-bf16", "bf16+amp-bf16")


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
    on_setting: Callable[[int, str], None] | None = None,
) -> tuple[Matrix, list[Trace]]:
    """Trace one workload under each setting (same weights, same batch) and line them up.

    `on_setting(i, name)` is called before setting i runs (for a progress display).
    """
    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed, predict)
    parsed = [_resolved(s) for s in settings]
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
            lm, decided, _ = _plan(model, s, options.workload_name, options.optimizer,
                                   options.predict, have_inputs=inputs is not None)
            plans[s.device] = (lm, decided)
        lm, decided = plans[s.device]
        try:
            traces.append(trace_run(lm, inputs, setting=s,
                                    options=replace(options, predict=decided)))
        except Exception as e:  # one setting's failure is a column, not the end of the table
            first_error = first_error or e
            failures.append((s.name, _why(e)))
    if not traces:
        assert first_error is not None
        raise first_error
    return build_matrix(traces, tuple(failures)), traces


def _why(e: Exception) -> str:
    """A setting's failure in one line: ampscope's own message, or the error's type and text."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if isinstance(e, AmpscopeError) else f"{type(e).__name__}: {text}"


def capture(model: nn.Module, *, name: str | None = None,
            device: str | None = None) -> contextlib.AbstractContextManager[Trace]:
    """`with ampscope.capture(model) as t: ...` records whatever runs inside into the Trace `t`.

    The model's own code, autocast regions and optimizer run as written; ampscope only watches.
    With `device` ("cuda", "mps", "xpu") on a machine that lacks it, the code inside runs on
    the virtual device: it sees that device, and its autocast follows that device's policy.
    """
    recorder = Capture(model, model_name=name, workload="custom", findings=derive_findings,
                       explain_failure=_explain)
    if device is None:
        return recorder
    if device not in DEVICES:
        raise AmpscopeError(f"unknown device {device!r}; choose {', '.join(DEVICES)}")
    recorder.device = device
    if device_available(device):
        return recorder
    return _on_virtual_device(recorder, device)


@contextlib.contextmanager
def _on_virtual_device(recorder: Capture, device: str) -> Iterator[Trace]:
    virtual = VirtualDevice(device)
    with Emulation(device, default_autocast_dtype(device)), recorder as trace:
        virtual.memory = recorder.memory_now
        with virtual.active():
            yield trace
    trace.notes += virtual.notes()


def _explain(failure) -> str | None:
    """The dtype-mismatch diagnosis of the call that raised, as a note's text."""
    diagnosis = diagnose(failure)
    return diagnosis.text() if diagnosis is not None else None


def memory(
    model: str | nn.Module | LoadedModel,
    inputs: torch.Tensor | Batch | None = None,
    *,
    measure: bool = False,
    **options,
) -> MemoryReport:
    """Trace one step (options as for `trace`) and account for every byte it held: by category
    and dtype, the peak and where it happens, the live-bytes timeline, and the formulas people
    use beside the counted figure. `measure=True` (a real CUDA device only; refused before
    anything is traced elsewhere) also runs the step untraced and adds the allocator's peak."""
    if measure:
        cuda_to_measure(options.get("setting", "fp32"))
    report = memory_report(trace(model, inputs, **options))
    if measure:
        timed = {k: v for k, v in options.items() if k != "predict"}
        report.measured = measure_peak_memory(model, **timed)
    return report


def flops(
    model: str | nn.Module | LoadedModel,
    inputs: torch.Tensor | Batch | None = None,
    *,
    step_time: float | None = None,
    measure: bool = False,
    gpu: str | None = None,
    **options,
) -> FlopReport:
    """Trace one step (options as for `trace`) and count its FLOPs by phase, dtype and module,
    beside the conventions people quote (6·N·D, nanoGPT's 6N + 12·L·H·Q·T).

    With the step's wall time — `step_time` seconds, or `measure=True` to time the untraced
    step on this machine's real device — the report adds throughput and MFU against `gpu`'s
    peaks (default: this machine's GPU; an H100 for emulated CUDA)."""
    if step_time is not None and not (math.isfinite(step_time) and step_time > 0):
        raise AmpscopeError("the step time must be a positive number of seconds")
    result = trace(model, inputs, **options)
    report = flop_report(result, tokens=tokens_of(result))
    if measure:
        step_time = measure_step(model, **{k: v for k, v in options.items() if k != "predict"})
    if step_time is not None:
        report.utilization = utilization(report, step_time, _accelerator(gpu, report.setting),
                                         report.setting.matmul_precision)
    return report


def _accelerator(name: str | None, setting: SettingRecord):
    """The accelerator whose peaks MFU is held to: the one named, this machine's GPU, or the
    H100 an emulated CUDA run stands for; None when unknown (MFU n/a)."""
    if name:
        return hardware.by_name(name)
    if setting.device != "cuda":
        return None
    if setting.emulated:
        return hardware.by_name("h100")
    return hardware.lookup(torch.cuda.get_device_name())


def tokens_of(result: Trace) -> int:
    """Tokens the step processed: the elements of its integer input (batch × sequence)."""
    for record in result.inputs:
        if record.role == "input" and record.dtype.startswith(("int", "uint")):
            return numel(record.shape)
    return 0


def _real_step(model: str | nn.Module | LoadedModel, setting: Setting,
               options: RunOptions) -> tuple[LoadedModel, Batch]:
    """The model and batch of an untraced, measured step on this machine's real device."""
    lm = load(model, device=setting.run_device)
    return lm, _batch_for(lm, None, options, device=setting.run_device)


def cuda_to_measure(setting: str | Setting) -> Setting:
    """The setting, if it runs on a real CUDA device here; else the one-line refusal of
    `memory --measure` (checked before any tracing)."""
    setting = _resolved(setting)
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
    repeats: int = 3,
) -> float:
    """Median wall seconds of the untraced step on this machine, after one warm-up run.

    Only a real device can be timed: an emulated setting is refused (give the step time
    instead)."""
    import statistics
    import time

    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed)
    setting = _resolved(setting)
    if setting.emulated:
        raise AmpscopeError(
            f"cannot time {setting.name} here: this machine has no {setting.device}; "
            "give the measured step time with --step-time SECONDS"
        )
    lm, data = _real_step(model, setting, options)
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


DEFAULT_NUMERICS_SETTINGS = ("fp32", "fp32+amp-bf16", "bf16")


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
        return _numerics(model, inputs, settings, reference, workload, batch, seq, optimizer,
                         seed, on_setting)


def _numerics(model, inputs, settings, reference, workload, batch, seq, optimizer, seed,
              on_setting) -> NumericsReport:
    options = RunOptions(workload, batch, seq, optimizer, seed=seed, predict=False)
    if workload not in ("forward", "train"):
        raise AmpscopeError(f"numerics runs the forward or train workload, not {workload!r}")
    if reference not in ("fp64", "fp32"):
        raise AmpscopeError(f"the reference is fp64 or fp32, not {reference!r}")
    parsed = [_resolved(s) for s in settings]
    if not parsed:
        raise AmpscopeError("give at least one setting")
    ref_setting = _resolved(reference)
    lm = load(model, device="cpu", have_inputs=inputs is not None)
    shortfall = _run_shortfall(lm, ref_setting, workload, optimizer, built_on_meta=False)
    if shortfall is not None:
        raise AmpscopeError(f"{shortfall}; numerics needs real values (no predict mode)")
    data = _batch_for(lm, inputs, options)
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
    with applied(setting, lm.module):
        run_data = {k: v.to(setting.run_device, copy=v.is_inference()) for k, v in data.items()}
        torch.manual_seed(options.seed)  # the same dropout masks in every run (restored after)
        with recording_values(lm.module) as values:
            read_weights(lm.module, values)
            out = workloads.run(lm, run_data, setting, options)
        if "loss" in out:
            values.loss = as_float64(out["loss"])
        read_grads(lm.module, values)
    return values


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
) -> MeasuredPeak:
    """The step's peak on a real CUDA device, counted as the prediction counts it: CUDA's
    `max_memory_allocated` over the step, less what was allocated before it (the model as
    loaded and the batch), plus the batch (the prediction counts the inputs, not the model as
    loaded: its step works on its own copies of the weights, see precision.applied)."""
    options = RunOptions(workload, batch, seq, optimizer, new_tokens, seed)
    setting = cuda_to_measure(setting)
    lm, data = _real_step(model, setting, options)
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


def policy(device: str = "cpu", dtype: str | None = None, *, op: str | None = None,
           compare: tuple[str, str] | None = None, quiz: bool = False) -> PolicyReport:
    """The autocast policy of this PyTorch build, read from the build itself: `device`'s ops by
    category; with `compare`, only the ops where two devices differ; with `quiz`, what common
    expressions return on cpu, cuda and mps (or the two compared devices). `dtype` is "bf16" or
    "fp16" (default: the first device's own autocast dtype); `op` keeps op names containing it."""
    devices = tuple(compare) if compare else (device,)
    for d in devices:
        if d not in DEVICES:
            raise AmpscopeError(f"unknown device {d!r}; choose {', '.join(DEVICES)}")
    if dtype is not None and dtype not in DTYPES:
        raise AmpscopeError(f"unknown autocast dtype {dtype!r}; choose bf16 or fp16")
    torch_dtype = DTYPES[dtype] if dtype else default_autocast_dtype(devices[0])
    name = dtype_name(torch_dtype)
    if quiz:
        asked = devices if compare else ("cpu", "cuda", "mps")
        return PolicyReport(name, quiz={d: run_quiz(d, torch_dtype) for d in asked})
    if compare:
        a, b = (read_policy(d, torch_dtype) for d in devices)
        return PolicyReport(name, devices=(devices[0], devices[1]),
                            rows=autocast.compare(a, b, op))
    rules = read_policy(device, torch_dtype)
    rows = autocast.table(rules, op)
    if not rows and op:
        raise AmpscopeError(
            f"no op containing {op!r} is on {device}'s autocast list: it follows "
            f"its inputs there (try --compare cpu cuda --op {op})"
        )
    return PolicyReport(name, device=device, rows=rows, total=len(rules))
