"""The loss itself computed in a 16-bit format."""

from __future__ import annotations

from collections.abc import Iterator

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import HALF, count, op_name, where
from ampscope.records import Phase, Trace

# ATen's loss kernels (what F.cross_entropy, F.mse_loss, ... run), by name without overload.
_LOSSES = frozenset({
    "nll_loss_forward", "nll_loss2d_forward", "nll_loss", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "kl_div", "soft_margin_loss", "multilabel_margin_loss_forward", "cross_entropy_loss",
})


@rule("AMP601", "loss-in-16-bit", "warning", "the training loss computed in float16 or bfloat16")
def loss_in_16_bit(trace: Trace) -> Iterator[Hit]:
    losses = [o for o in trace.ops if o.phase == Phase.FORWARD and op_name(o) in _LOSSES
              and o.outputs and o.outputs[0].dtype in HALF]
    if not losses or not any(o.phase == Phase.BACKWARD for o in trace.ops):
        return
    dtype = losses[0].outputs[0].dtype
    # Where every trained weight is in that dtype and no autocast ran, the whole step is
    # 16-bit by choice and the loss comes with it: worth knowing (a note). Where the step is
    # mixed (float32 weights, or autocast), the loss escaped the float32 it should have had.
    trained = [p for p in trace.parameters if p.requires_grad]
    pure = (all(p.dtype == dtype for p in trained)
            and not any(c.autocast for c in trace.calls if c.phase == Phase.FORWARD))
    yield Hit(
        f"The training loss is computed in {dtype}: {where(losses[0])}.",
        (f"{count(len(losses), 'loss op')} returned {dtype}, the first "
         f"aten.{op_name(losses[0])} on {' and '.join(m.dtype for m in losses[0].inputs)} "
         "inputs",),
        f"{dtype} keeps {8 if dtype == 'bfloat16' else 11} significant bits: the log-softmax "
        "and the mean over tokens round (a loss near 2.0 is only resolved to "
        f"{2 ** (1 - (8 if dtype == 'bfloat16' else 11)):.0e}), and the gradient "
        "that starts from it inherits the error",
        "compute the loss in float32: F.cross_entropy(logits.float(), targets), or run the "
        "forward under torch.autocast, whose policy computes losses in float32",
        losses[0].source, "note" if pure else None)
