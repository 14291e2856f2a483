"""Loss scaling: fp16 gradients with no GradScaler, a GradScaler with nothing in fp16, and
gradients read while they are still scaled."""

from __future__ import annotations

from collections.abc import Iterator

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import (
    UNSCALE,
    UPDATE_SCALE,
    count,
    dtypes_of,
    first_source,
    named,
    op_name,
    trains,
    where,
)
from ampscope.records import Phase, Trace
from ampscope.torchcompat.ops import FOREACH_PREFIX

_SCALER_FIX = ("scale the loss: scaler = torch.amp.GradScaler(device); "
               "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()")


def _fp16_origin(trace: Trace) -> str:
    """Where the step's fp16 came from: autocast, or the parameters themselves."""
    autocast = [c for c in trace.calls if c.phase == Phase.FORWARD and c.autocast == "float16"]
    if autocast:
        at = first_source(autocast)
        return "the forward pass ran under torch.autocast(dtype=torch.float16)" + (
            f" (first at {at})" if at else "")
    fp16 = [p.name for p in trace.parameters if p.dtype == "float16" and p.requires_grad]
    if fp16:
        return f"{count(len(fp16), 'trained parameter')} {'is' if len(fp16) == 1 else 'are'} float16"
    return "float16 tensors reached the backward pass"


@rule("AMP201", "fp16-without-loss-scaling", "warning",
      "gradients computed in float16 with no loss scaling")
def fp16_without_scaling(trace: Trace) -> Iterator[Hit]:
    if not trains(trace) or named(trace, UNSCALE, UPDATE_SCALE):
        return
    fp16 = [o for o in trace.ops if o.phase == Phase.BACKWARD and o.flops > 0
            and "float16" in dtypes_of(o)]
    if not fp16:
        return
    backward = next((c for c in trace.calls if c.func == "Tensor.backward"), None)
    params_fp16 = any(p.dtype == "float16" and p.requires_grad for p in trace.parameters)
    fix = ("keep float32 parameters, run the forward under torch.autocast(dtype=torch.float16) "
           "and " + _SCALER_FIX + " (GradScaler refuses float16 gradients)"
           if params_fp16 else _SCALER_FIX) + "; or use bfloat16, whose range is float32's"
    yield Hit(
        f"Gradients are computed in float16 and the loss is not scaled: "
        f"{_fp16_origin(trace)}, and no GradScaler ran in the step.",
        (f"{count(len(fp16), 'backward op')} with FLOPs ran in float16, the first "
         f"{where(fp16[0])}",
         f"no GradScaler kernel (aten.{UPDATE_SCALE}, aten.{UNSCALE}) ran"),
        "float16's smallest positive value is 2^-24 ≈ 6e-8 (full precision from 2^-14 ≈ 6.1e-5): "
        "smaller gradients flush to zero or lose their digits, and the loss stops falling",
        fix, backward.source if backward is not None else fp16[0].source)


@rule("AMP202", "loss-scaling-without-fp16", "warning",
      "a GradScaler where nothing runs in float16")
def scaler_without_fp16(trace: Trace) -> Iterator[Hit]:
    scaler = named(trace, UNSCALE, UPDATE_SCALE)
    if not scaler:
        return
    if any("float16" in dtypes_of(o) for o in trace.ops
           if o.phase in (Phase.FORWARD, Phase.BACKWARD)):
        return
    half = sorted({d for o in trace.ops if o.phase == Phase.FORWARD for d in dtypes_of(o)
                   if d == "bfloat16"})
    ran = "bfloat16" if half else "float32"
    yield Hit(
        f"A GradScaler scales the loss, but nothing in the step ran in float16 (it ran in "
        f"{ran}).",
        (f"GradScaler's {' and '.join(sorted({'aten.' + op_name(o) for o in scaler}))} ran "
         f"at {first_source(scaler) or 'an unknown line'}",
         "no forward or backward op had a float16 input or output"),
        "cost without benefit: every step unscales every gradient and checks it for inf/NaN, "
        "and scaler.step() waits for the device to read the result; bfloat16 and float32 "
        "have float32's range and need no loss scaling",
        "drop the GradScaler, or make it torch.amp.GradScaler(device, "
        "enabled=(dtype == torch.float16))",
        first_source(scaler))


# Ops that read gradients' values before the optimizer uses them: clip_grad_norm_,
# clip_grad_value_, a logged gradient norm.
_GRADIENT_READS = frozenset({"linalg_vector_norm", "norm", "clamp_", "abs",
                             *(FOREACH_PREFIX + n for n in ("norm", "clamp_max_", "clamp_min_",
                                                            "abs"))})


@rule("AMP203", "scaled-gradients-read", "warning",
      "gradients clipped or measured before scaler.unscale_")
def scaled_gradients_read(trace: Trace) -> Iterator[Hit]:
    unscale = named(trace, UNSCALE)
    if not unscale:
        return
    first = unscale[0]
    reads = [o for o in trace.ops[:first.index] if o.phase == Phase.OPTIMIZER
             and op_name(o) in _GRADIENT_READS and o.source != first.source]
    if not reads:
        return
    lines = list(dict.fromkeys(o.source for o in reads if o.source))
    yield Hit(
        f"Gradients are read while they are still scaled: {where(reads[0])} ran before "
        f"GradScaler unscaled them{f' at {first.source}' if first.source else ''}.",
        (f"{count(len(reads), 'op')} read gradients before aten.{UNSCALE}"
         + (f", at {', '.join(lines)}" if lines else ""),),
        "their values are the true gradients times the loss scale (65536 at the start, "
        "then whatever the scaler settles on): clip_grad_norm_'s max_norm clips nearly every "
        "step, and a logged gradient norm is off by the scale",
        "call scaler.unscale_(optimizer) after backward and before clipping or measuring the "
        "gradients (scaler.step then does not unscale them again)",
        reads[0].source)
