"""Backend settings that cost speed on the target: float32 matmuls without TF32, attention on
the math kernel."""

from __future__ import annotations

from collections.abc import Iterator

from ampscope import hardware
from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import count
from ampscope.analysis.summary import itemsize, numel
from ampscope.hardware.device_types import DEVICE_TYPES
from ampscope.records import Trace
from ampscope.torchcompat.ops import FUSED_ATTENTION_NAMES


@rule("AMP701", "fp32-matmuls-without-tf32", "note",
      "float32 matmuls in full float32 on a GPU with TF32 tensor cores")
def fp32_without_tf32(trace: Trace) -> Iterator[Hit]:
    accelerator = hardware.stood_for(trace.setting.device, trace.setting.gpu)
    if accelerator is None:  # a device type without one (the CPU)
        return
    fp32, tf32 = accelerator.peak_flops.get("float32"), accelerator.peak_flops.get("tf32")
    if not fp32 or not tf32 or tf32 <= fp32:
        return
    full = [o for o in trace.ops if o.fp32_precision == "ieee" and o.flops > 0]
    total = sum(o.flops for o in trace.ops)
    flops = sum(o.flops for o in full)
    if not full or flops < 0.01 * total:
        return
    yield Hit(
        f"{flops / total:.0%} of the step's FLOPs are float32 matmuls in full float32 "
        f"precision, on {accelerator.title}, whose TF32 tensor cores run them "
        f"{tf32 / fp32:.1f}× faster.",
        (f"{count(len(full), 'op')} ({flops:,} FLOPs of {total:,}) ran with float32 "
         "precision 'ieee', the first " + ".".join(full[0].op.split(".")[:2])
         + (f" at {full[0].source}" if full[0].source else ""),
         f"{accelerator.title}: float32 {fp32 / 1e12:g} TFLOP/s, TF32 {tf32 / 1e12:g} TFLOP/s "
         "dense (hardware/known.py)"),
        "those matmuls run at the float32 peak; TF32 rounds their inputs to 10 mantissa "
        "bits and keeps float32's range, which training tolerates",
        'torch.set_float32_matmul_precision("high") (or torch.backends.cuda.matmul.'
        "allow_tf32 = True), or train under torch.autocast",
        full[0].source)


_SDPA = "torch.nn.functional.scaled_dot_product_attention"


@rule("AMP702", "attention-math-fallback", "warning",
      "scaled_dot_product_attention on the math kernel of a GPU")
def attention_math_fallback(trace: Trace) -> Iterator[Hit]:
    device = DEVICE_TYPES.get(trace.setting.device)
    if device is None or device.attention != "cuda":
        return
    calls = [c for c in trace.calls if c.func == _SDPA and c.inputs]
    if not calls:
        return
    fused = {o.caller for o in trace.ops if o.caller is not None
             and any(o.op.startswith(f"aten.{name}.") for name in FUSED_ATTENTION_NAMES)}
    math = [c for c in calls if c.index not in fused]
    if not math:
        return
    first = math[0]
    q, k = first.inputs[0], first.inputs[1] if len(first.inputs) > 1 else first.inputs[0]
    # The math kernel materialises the scores: batch·heads·Lq·Lk values in the input's dtype.
    size = numel((*q.shape[:-1], k.shape[-2])) * itemsize(q.dtype)
    why = ("no fused kernel takes float64" if q.dtype == "float64"
           else "the fused kernels (flash, memory-efficient, cuDNN) refused these inputs' "
                "shapes, strides or mask")
    yield Hit(
        f"{count(len(math), 'scaled_dot_product_attention call')} of {len(calls)} ran the math "
        f"kernel on the GPU: {why}.",
        (f"the first at {first.source or 'an unknown line'}: query {q.dtype} "
         f"{list(q.shape)}, key {list(k.shape)}; no flash, memory-efficient or cuDNN op ran "
         "in it",),
        f"the math kernel writes the whole attention matrix to memory ({size:,} B "
        "for this call, growing with the square of the sequence) and runs a matmul, a softmax "
        "and a second matmul as separate kernels, where a fused kernel keeps the scores on "
        "chip: slower, and more memory saved for backward",
        "give it float16 or bfloat16 (or float32) inputs, contiguous in the last dimension, "
        "and a boolean or additive mask of the documented shape, or is_causal=True instead of "
        "a mask",
        first.source)
