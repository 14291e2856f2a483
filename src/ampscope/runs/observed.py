"""The setting a run showed, for a capture around user code that was given none (`ampscope run`,
`ampscope.capture(model)`): what the script itself set, read off what ran."""

from __future__ import annotations

import torch
from torch import nn

from ampscope.precision import main_dtype
from ampscope.precision.matmul import ran_with
from ampscope.records import Phase, SettingRecord, Trace, dtype_name
from ampscope.torchcompat.distributed import fsdp_mixed_precision


def observed_setting(model: nn.Module, device: str | None, trace: Trace,
                     matmul_left: str, gpu: str | None = None) -> SettingRecord:
    """The setting of `trace` (its calls and ops recorded) as the run showed it: the dtype
    most parameter elements of `model` have, the autocast dtype of the step's first call under
    autocast (an evaluation pass's only where the step had none), the float32 matmul precision
    its matmuls ran with (`matmul_left`, as the run left it, where none ran in float32), and
    the dtypes FSDP2's MixedPrecisionPolicy computes and reduces in where the model (or its
    first module that has one) is sharded with one.
    `device`: the device the run stood for (a virtual one), else that of the parameters;
    `gpu`, the GPU a virtual one was (SettingRecord.gpu)."""
    floating = [p for p in model.parameters() if p.is_floating_point()]
    found = floating[0].device.type if floating else "cpu"
    main = main_dtype(model, floating)
    compute = reduce = None
    for module in model.modules():  # the root's policy first, where fully_shard wrapped it
        policy = fsdp_mixed_precision(module)
        if policy is not None and policy[0] is not None:
            compute, reduce = policy
            break
    under_autocast = [c for c in trace.calls if c.autocast]
    step = [c for c in under_autocast if c.phase != Phase.EVALUATION] or under_autocast
    return SettingRecord(name="as-run", device=device or found,
                         emulated=device is not None and device != found,
                         param_dtype=dtype_name(main) if main else None,
                         autocast_dtype=step[0].autocast if step else None,
                         matmul_precision=ran_with(trace.ops, matmul_left),
                         torch=torch.__version__,
                         fsdp_param_dtype=dtype_name(compute) if compute else None,
                         fsdp_reduce_dtype=dtype_name(reduce) if compute and reduce else None,
                         gpu=gpu)
