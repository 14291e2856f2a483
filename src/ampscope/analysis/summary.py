"""What the terminal shows of a trace (`TraceSummary`), and its tensor inventory by dtype: how
many tensors and elements of each category are in each dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import torch

from ampscope.analysis.diagram import Diagram, build_diagram
from ampscope.analysis.flow import FlowRow, dtype_changes, module_flow, op_flow, repeat_unit
from ampscope.analysis.fp8 import fp8_module_notes
from ampscope.records import Diagnostic, Finding, ModelInfo, PassKind, Phase, SettingRecord, Trace


@cache
def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in records ("bfloat16" -> 2)."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class DtypeCount:
    category: str  # "parameters", "gradients", "buffers", "optimizer state", "inputs", "outputs"
    dtype: str
    tensors: int
    elements: int
    detail: str = ""  # e.g. optimizer state keys, input names

    @property
    def bytes(self) -> int:
        return self.elements * itemsize(self.dtype)


def _count(category: str, items: list[tuple[str, tuple[int, ...], str]]) -> list[DtypeCount]:
    """items: (dtype, shape, label) -> one row per dtype, labels joined when few."""
    rows: dict[str, list] = {}
    for dtype, shape, label in items:
        row = rows.setdefault(dtype, [0, 0, []])
        row[0] += 1
        row[1] += numel(shape)
        row[2].append(label)
    out = []
    for dtype, (tensors, elements, labels) in rows.items():
        distinct = list(dict.fromkeys(labels))
        detail = ", ".join(distinct) if len(distinct) <= 4 else ""
        out.append(DtypeCount(category, dtype, tensors, elements, detail))
    return out


def forward_passes(trace: Trace) -> int:
    """How many times the model itself was called forward in the traced step: 1 for one step,
    more for a script traced over several optimizer steps or with gradient accumulation
    (micro-steps). In a run that trained, only its training passes count: its evaluation and
    sampling passes are not part of the step (runs/passes.py)."""
    train = [p for p in trace.passes if p.kind == PassKind.TRAIN]
    if train:
        return len(train)
    return max(1, sum(1 for m in trace.modules if m.depth == 0 and m.name == ""
                      and m.phase == "forward"))


def tokens_of(trace: Trace) -> int:
    """Tokens the traced steps processed: the elements of the model's integer input (batch ×
    sequence), once per forward pass of a training run (its training passes only, each with
    its own input where they were recorded)."""
    train = [p for p in trace.passes if p.kind == PassKind.TRAIN]
    if train and trace.workload == "train" and all(p.tokens for p in train):
        return sum(p.tokens for p in train)
    for record in trace.inputs:
        if record.role == "input" and record.dtype.startswith(("int", "uint")):
            passes = forward_passes(trace) if trace.workload == "train" else 1
            return numel(record.shape) * passes
    return 0


def evaluation_passes(trace: Trace) -> dict[str, int]:
    """The passes of a run that trained which were not backpropagated, by kind
    ("evaluation", "sampling"): none in a run that did not train."""
    if not any(p.kind == PassKind.TRAIN for p in trace.passes):
        return {}
    counts: dict[str, int] = {}
    for p in trace.passes:
        if p.kind not in (PassKind.TRAIN, PassKind.DISCARDED):  # (discarded: a note of its own)
            counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts


def pass_notes(trace: Trace, steps: int) -> list[str]:
    """What a run's forward passes were, in words: gradient accumulation where its training
    passes outnumber its `steps` optimizer steps, and the passes that were not part of a step."""
    notes = []
    passes = forward_passes(trace)
    if steps and passes > steps:
        step_text = "an optimizer step" if steps == 1 else f"{steps} optimizer steps"
        notes.append(f"The model ran {passes} training passes for {step_text} (gradient "
                     "accumulation): each pass is its own forward and backward phase in the "
                     "trace; counts and tokens cover them all.")
    discarded = [p for p in trace.passes if p.kind == PassKind.DISCARDED]
    if discarded:
        n = len(discarded)
        notes.append(f"{n} training pass{'es' if n > 1 else ''} of the run (forward and backward) "
                     f"{'were' if n > 1 else 'was'} discarded: {'their' if n > 1 else 'its'} "
                     "gradients were cleared before any optimizer step read them, so "
                     f"{'they are' if n > 1 else 'it is'} in the evaluation phase, outside the "
                     "step's tokens, FLOPs and MFU, and no gradient accumulation.")
    others = evaluation_passes(trace)
    if others:
        kinds = " and ".join(f"{n} {kind} pass{'es' if n > 1 else ''}"
                             for kind, n in others.items())
        flops = sum(o.flops for o in trace.ops if o.phase == Phase.EVALUATION)
        one = sum(others.values()) == 1
        notes.append(f"It also ran {kinds} (no gradient reached {'it' if one else 'them'}): "
                     f"{'its' if one else 'their'} ops are in the evaluation phase ({flops:,} "
                     "FLOPs), outside the step's tokens, FLOPs and MFU.")
    return notes


def dtype_inventory(trace: Trace) -> list[DtypeCount]:
    rows = _count("parameters", [(p.dtype, p.shape, p.name) for p in trace.parameters])
    rows += _count("gradients", [(p.grad_dtype, p.shape, p.name) for p in trace.parameters
                                 if p.grad_dtype is not None])
    rows += _count("buffers", [(b.dtype, b.shape, b.name.rsplit(".", 1)[-1]) for b in trace.buffers])
    rows += _count("optimizer state", [(s.dtype, s.shape, s.key) for s in trace.optimizer_state])
    rows += _count("inputs", [(i.dtype, i.shape, i.name) for i in trace.inputs])
    rows += _count("outputs", [(o.dtype, o.shape, o.name) for o in trace.outputs])
    rows += _count("held state", [(h.dtype, h.shape, h.name.split(".")[0].split("[")[0])
                                  for h in trace.held])
    return rows



@dataclass
class TraceSummary:
    """Everything `ampscope trace` prints, computed from a trace; render/text.py only draws it."""

    model: ModelInfo
    setting: SettingRecord
    workload: str
    mode: str  # "run" or "predict"
    notes: list[str]
    inventory: list[DtypeCount]
    modules: list[FlowRow]  # the forward pass's module calls, repeated blocks collapsed
    changes: list[FlowRow]  # the module rows whose output dtype differs from their input's
    findings: list[Finding]
    diagnostics: list[Diagnostic]  # what the checks judged, most severe first
    ops: dict[str, list[FlowRow]] = field(default_factory=dict)  # phase → op rows, when asked
    diagram: Diagram | None = None  # the dtype flow of one forward pass, when asked


def trace_summary(trace: Trace, *, ops: bool = False, diagram: bool = False) -> TraceSummary:
    """The summary of `trace`; `ops` adds the op listing per phase, `diagram` the dtype flow
    of one forward pass."""
    flow = module_flow(trace.modules, notes=fp8_module_notes(trace),
                       unit=repeat_unit(trace.workload))
    by_phase = {}
    if ops:
        by_phase = {phase: rows for phase in ("forward", "backward", "optimizer")
                    if (rows := op_flow(trace.ops, phase))}
    return TraceSummary(
        model=trace.model, setting=trace.setting, workload=trace.workload, mode=trace.mode,
        notes=list(trace.notes), inventory=dtype_inventory(trace), modules=flow,
        changes=dtype_changes(flow), findings=list(trace.findings),
        diagnostics=list(trace.diagnostics), ops=by_phase,
        diagram=build_diagram(trace) if diagram else None,
    )
