"""What the rules read off a step's op records: op names, phases, the GradScaler's own ops."""

from __future__ import annotations

from collections.abc import Iterable

from ampscope.analysis.findings import op_name
from ampscope.records import FunctionCall, OpCall, Phase, Trace, module_label
from ampscope.torchcompat.ops import AMP_UNSCALE_OP, AMP_UPDATE_SCALE_OP

HALF = ("float16", "bfloat16")
# GradScaler's kernels: unscale_ (and step, which unscales when the script did not) runs the
# first, update() the second. Either one in a step says a GradScaler was there.
UNSCALE = AMP_UNSCALE_OP
UPDATE_SCALE = AMP_UPDATE_SCALE_OP


def named(trace: Trace, *names: str) -> list[OpCall]:
    wanted = set(names)
    return [o for o in trace.ops if op_name(o) in wanted]


def trains(trace: Trace) -> bool:
    """A backward pass and an optimizer step both ran."""
    phases = {o.phase for o in trace.ops}
    return Phase.BACKWARD in phases and Phase.OPTIMIZER in phases


def dtypes_of(op: OpCall) -> set[str]:
    return {m.dtype for m in (*op.inputs, *op.outputs)}


def where(op: OpCall) -> str:
    """"aten.mm in blocks.0.fc at model.py:12"."""
    name = ".".join(op.op.split(".")[:2])
    text = name
    if op.module is not None:
        text += f" in module {module_label(op.module)}" if op.module else " in the model"
    if op.source:
        text += f" at {op.source}"
    return text


def first_source(records: Iterable[OpCall | FunctionCall]) -> str | None:
    return next((r.source for r in records if r.source), None)


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
