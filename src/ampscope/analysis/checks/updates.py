"""Optimizer state kept in a 16-bit format."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import HALF, count
from ampscope.records import Trace


@rule("AMP402", "optimizer-state-in-16-bit", "warning",
      "optimizer moments kept in float16 or bfloat16")
def state_in_16_bit(trace: Trace) -> Iterator[Hit]:
    low: dict[tuple[str, str], list[str]] = defaultdict(list)
    for s in trace.optimizer_state:
        if s.dtype in HALF and s.key != "step":
            low[(s.key, s.dtype)].append(s.param)
    if not low:
        return
    # float16's second moment is the dangerous one: squared gradients below its smallest
    # value (2^-24 ≈ 6e-8, so gradients below 2.4e-4) become 0, and Adam's update m/(√v + eps)
    # is then m/eps, up to 1e8 times too large. Elsewhere the moments keep 8 (bfloat16) or 11
    # bits, which a memory-saving optimizer may choose: worth knowing.
    squared_fp16 = [k for k in low if k[1] == "float16" and "sq" in k[0]]
    params = {p for ps in low.values() for p in ps}
    dtypes = sorted({d for _, d in low})
    consequence = ("the moments average many steps' gradients: with "
                   + " / ".join(f"{8 if d == 'bfloat16' else 11} significant bits ({d})"
                                for d in dtypes)
                   + " a small step's contribution rounds away")
    if squared_fp16:
        consequence += ("; and float16's smallest value is 2^-24 ≈ 6e-8: the square of a "
                        "gradient below 2.4e-4 is 0 there, and Adam's update m/(√v + eps) is "
                        "then m/eps, far too large")
    # Moments in their own parameter's 16-bit dtype follow from that parameter (PyTorch's
    # optimizers keep them so): the choice was the parameter's, and AMP401 measures what it
    # costs. Moments narrower than their parameter are the optimizer's own loss: a warning.
    dtype_of = {p.name: p.dtype for p in trace.parameters}
    narrower = [s.param for s in trace.optimizer_state if s.dtype in HALF and s.key != "step"
                and dtype_of.get(s.param, s.dtype) not in HALF]
    yield Hit(
        f"The optimizer keeps its state in {' and '.join(dtypes)}: "
        + ", ".join(f"{k} ({d})" for k, d in low) + ".",
        (f"{count(len(params), 'parameter')}' state: "
         + "; ".join(f"{k} in {d} for {count(len(ps), 'parameter')}"
                     for (k, d), ps in low.items()),),
        consequence,
        "keep the optimizer state in float32: float32 parameters (with torch.autocast for the "
        "compute), or an optimizer that keeps float32 moments for 16-bit weights",
        None,
        None if squared_fp16 or narrower else "note")
