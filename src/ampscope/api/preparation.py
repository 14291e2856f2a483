"""What a run needs before it runs: the model as a LoadedModel, its batch, and whether it
fits in memory for real or must be predicted on fake tensors."""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from ampscope.errors import AmpscopeError
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import (
    Setting,
    main_dtype,
    parse_setting,
    resolve_device,
)
from ampscope.records import dtype_name
from ampscope.runs.environment import RunEnvironment
from ampscope.workloads import RunOptions

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)


def run_shortfall(lm: LoadedModel, setting: Setting, workload: str, optimizer: str, *,
                  built_on_meta: bool) -> str | None:
    """Why a real run clearly cannot fit, in one line, or None: the working copy of the
    weights, and for a train step their gradients and optimizer state, on top of the model as
    loaded (a model still on meta would first be built in float32)."""
    from ampscope.models.registry import memory_needed_message

    per_param = 1  # the run's own copy of every weight (see precision.applied)
    if workload not in ("forward", "generate"):  # a custom step may train: count as one
        per_param += 1 + {"adamw": 2, "adam": 2, "sgd": 1}[optimizer]
    dtype = setting.param_dtype or main_dtype(lm.module) or torch.float32  # native: the model's
    what = (f"as {per_param} {dtype_name(dtype)} copies of the weights "
            f"for a {workload} run")
    bytes_per_parameter = per_param * dtype.itemsize
    if built_on_meta:
        bytes_per_parameter += 4
        what = "built in float32 and " + what
    return memory_needed_message(lm.name, lm.num_parameters, bytes_per_parameter=bytes_per_parameter,
                                 what=what, device=setting.run_device)


def inputs_in_param_dtype(data: Batch, setting: Setting) -> tuple[Batch, list[str]]:
    """Under a low-precision setting without autocast, float inputs in another float dtype
    become the parameters' dtype (a model's first layer would refuse them otherwise)."""
    low = setting.param_dtype in (torch.bfloat16, torch.float16)
    if not low or setting.autocast_dtype is not None:
        return data, []
    cast = [k for k, v in data.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
            and v.dtype != setting.param_dtype]
    return {k: v.to(setting.param_dtype) if k in cast else v for k, v in data.items()}, cast


def as_batch(lm: LoadedModel, inputs, workload: str) -> Batch:
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


def resolved(setting: str | Setting) -> Setting:
    return resolve_device(parse_setting(setting) if isinstance(setting, str) else setting)


def batch_for(lm: LoadedModel, inputs: torch.Tensor | Batch | None, options: RunOptions, *,
              device: str = "cpu") -> Batch:
    """The run's batch: the inputs given, or random token ids of the options' size."""
    if inputs is not None:
        return as_batch(lm, inputs, options.workload_name)
    if options.seq > lm.max_seq_len:
        raise AmpscopeError(f"seq {options.seq} exceeds {lm.name}'s context length "
                            f"{lm.max_seq_len}")
    _ids_fit(options)
    generator = torch.Generator().manual_seed(options.seed)
    return lm.make_batch(options.batch, options.seq, options.workload_name, generator,
                         device=device)


# Bytes of real memory each token of a run's batch takes: its id and its target, as int64.
ID_BYTES_PER_TOKEN = 2 * 8


def _ids_fit(options: RunOptions) -> None:
    """The token ids are made for real even when the run is predicted: refuse a batch whose ids
    (and the targets, as int64) alone would not fit before allocating them."""
    from ampscope.models.registry import available_memory_bytes
    from ampscope.render.style import format_bytes

    needed = ID_BYTES_PER_TOKEN * options.batch * options.seq
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise AmpscopeError(
            f"{options.batch:,}×{options.seq:,} tokens would not fit: their ids alone need "
            f"{format_bytes(needed)}, more than the {format_bytes(available)} free here; make the "
            "batch or sequence smaller")


def plan(model: str | nn.Module | LoadedModel, env: RunEnvironment, workload: str,
         optimizer: str, predict: bool | None, *, have_inputs: bool
         ) -> tuple[LoadedModel, list[str]]:
    """The model to run, built by `env` (on its virtual device where it has one), and whether
    to predict, decided on `env`: a named model is first built on the meta device (nothing
    allocated) to count what a real run would need."""
    setting = env.setting
    assert setting is not None  # (a traced run has a setting)
    notes: list[str] = []
    on_meta = isinstance(model, str)
    lm = env.load(model, device="meta" if on_meta else setting.run_device,
                  have_inputs=have_inputs)
    if predict is None:
        # Values only when needed: dtypes, shapes, FLOPs and memory need none, and a fake run
        # takes seconds at any size (a real bf16 step on a CPU without fast bf16 takes minutes).
        # trace_run runs it for real instead when the model reads a value.
        predict = True
        notes.append("Predicted on fake tensors (the default: dtypes, shapes, FLOPs and memory "
                     "need no values; --real runs the step for real).")
    elif predict:
        notes.append("Predicted on fake tensors, as asked: no weight was materialised.")
    else:
        shortfall = run_shortfall(lm, setting, workload, optimizer, built_on_meta=on_meta)
        if shortfall is not None:
            raise AmpscopeError(f"{shortfall}, or predict it on fake tensors (drop --real)")
        log.info("%s runs for real under %s, as asked: its weights, gradients and optimizer "
                 "state fit in memory", lm.name, setting.name)
    for note in notes:
        log.info("%s", note)
    if on_meta and not predict:
        lm = env.load(model)
    env.predict = predict
    return lm, notes
