"""Backend settings that cost speed on the target: float32 matmuls without TF32."""

from __future__ import annotations

from collections.abc import Iterator

from ampscope import hardware
from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.step import count
from ampscope.hardware.device_types import DEVICE_TYPES
from ampscope.records import Trace


@rule("AMP701", "fp32-matmuls-without-tf32", "note",
      "float32 matmuls in full float32 on a GPU with TF32 tensor cores")
def fp32_without_tf32(trace: Trace) -> Iterator[Hit]:
    device = DEVICE_TYPES.get(trace.setting.device)
    if device is None or device.accelerator is None:
        return
    accelerator = hardware.by_name(device.accelerator)
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
