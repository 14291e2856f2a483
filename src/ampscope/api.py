"""The Python API: `trace()` runs a workload under a setting; `capture()` records user code."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ampscope import workloads
from ampscope.analysis.compare import Matrix, build_matrix
from ampscope.analysis.diagnosis import diagnose
from ampscope.analysis.findings import derive_findings
from ampscope.capture.session import Capture
from ampscope.errors import AmpscopeError, DtypeMismatchError
from ampscope.models.base import Batch, LoadedModel
from ampscope.records import dtype_name
from ampscope.settings import Setting, applied, check_available, parse_setting
from ampscope.trace import Trace


def load(model: str | nn.Module | LoadedModel, device: str = "cpu", *,
         have_inputs: bool = False) -> LoadedModel:
    """A model spec, a module or a LoadedModel, as a LoadedModel."""
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
            # With inputs given, nothing needs the vocabulary or context length.
            return LoadedModel(type(model).__name__, model, vocab_size=0, max_seq_len=2**62)
    if isinstance(model, str):
        return registry.resolve(model, device=device)
    raise AmpscopeError(f"cannot trace a {type(model).__name__}; pass a model name or an nn.Module")


def _check_run_fits(lm: LoadedModel, setting: Setting, workload: str, optimizer: str) -> None:
    """Refuse in one line a run that clearly cannot fit: the working copy of the weights, and
    for a train step their gradients and optimizer state, on top of the model as loaded."""
    from ampscope.models.registry import check_fits_in_memory

    if lm.module is None or any(p.is_meta for p in lm.module.parameters()):
        return
    per_param = 1  # the run's own copy of every weight (see settings.applied)
    if workload not in ("forward", "generate"):  # a custom step may train: count as one
        per_param += 1 + {"adamw": 2, "adam": 2, "sgd": 1}[optimizer]
    itemsize = torch.empty((), dtype=setting.param_dtype).element_size()
    what = (f"as {per_param} {dtype_name(setting.param_dtype)} copies of the weights "
            f"for a {workload} run")
    check_fits_in_memory(lm.name, lm.num_parameters, bytes_per_parameter=per_param * itemsize,
                         what=what, device=setting.device)


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
    if isinstance(inputs, dict):
        return dict(inputs)
    raise AmpscopeError("inputs must be a tensor of token ids or a dict of named tensors")


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
) -> Trace:
    """Run `workload` once under `setting` and return what every tensor's dtype was.

    The model — parameters, buffers, gradients, hooks, training flag — and torch's global state
    (autocast, matmul precision, default dtype, RNG) are exactly as before afterwards, also when
    the model raised. Random token ids are made when `inputs` is None.
    """
    setting = parse_setting(setting) if isinstance(setting, str) else setting
    check_available(setting)
    if isinstance(workload, str) and workload not in workloads.WORKLOADS:
        raise AmpscopeError(
            f"unknown workload {workload!r}; choose one of {', '.join(workloads.WORKLOADS)}"
        )
    if optimizer not in workloads.OPTIMIZERS:
        raise AmpscopeError(
            f"unknown optimizer {optimizer!r}; choose one of {', '.join(workloads.OPTIMIZERS)}"
        )
    lm = load(model, device=setting.device, have_inputs=inputs is not None)
    workload_name = workload if isinstance(workload, str) else getattr(workload, "__name__", "custom")
    _check_run_fits(lm, setting, workload_name, optimizer)
    if inputs is None:
        if seq < 1 or batch < 1:
            raise AmpscopeError("batch and seq must be positive")
        if seq > lm.max_seq_len:
            raise AmpscopeError(f"seq {seq} exceeds {lm.name}'s context length {lm.max_seq_len}")
        generator = torch.Generator().manual_seed(seed)
        data = lm.make_batch(batch, seq, workload_name, generator, device=setting.device)
    else:
        data = _as_batch(lm, inputs, workload_name)

    with applied(setting, lm.module):
        capture = Capture(lm.module, model_name=lm.name, setting=setting.to_dict(),
                          workload=workload_name)
        try:
            with capture.recording():
                outputs = workloads.run(lm, workload, data, setting, optimizer=optimizer,
                                        new_tokens=new_tokens, seed=seed)
        except Exception as e:
            diagnosis = diagnose(capture.failure)
            if diagnosis is not None:
                raise DtypeMismatchError(diagnosis) from e
            raise
        result = capture.finish(inputs=data, outputs=outputs)
    result.findings = derive_findings(result)
    return result


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
    on_setting: Callable[[int, str], None] | None = None,
) -> tuple[Matrix, list[Trace]]:
    """Trace one workload under each setting (same weights, same batch) and line them up.

    `on_setting(i, name)` is called before setting i runs (for a progress display).
    """
    parsed = [parse_setting(s) if isinstance(s, str) else s for s in settings]
    if not parsed:
        raise AmpscopeError("give at least one setting")
    for s in parsed:
        check_available(s)
    devices = {s.device for s in parsed}
    if len(devices) > 1 and isinstance(model, str):
        raise AmpscopeError("settings on several devices are not supported in one matrix yet")
    lm = load(model, device=parsed[0].device, have_inputs=inputs is not None)
    traces = []
    for i, s in enumerate(parsed):
        if on_setting is not None:
            on_setting(i, s.name)
        traces.append(trace(lm, inputs, setting=s, workload=workload, batch=batch, seq=seq,
                            optimizer=optimizer, new_tokens=new_tokens, seed=seed))
    return build_matrix(traces), traces


def capture(model: nn.Module, *, name: str | None = None) -> Capture:
    """`with ampscope.capture(model) as t: ...` records whatever runs inside into the Trace `t`.

    The model's own code, autocast regions and optimizer run as written; ampscope only watches.
    """
    return Capture(model, model_name=name, workload="custom")
