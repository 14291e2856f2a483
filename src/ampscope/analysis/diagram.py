"""The dtype flow of one forward pass, as people draw it by hand.

token ids → embedding → norm → q/k/v → attention → out proj → residual add → norm → MLP →
residual add → … → lm_head → loss, each step with the dtypes in and out, and the casts
autocast inserted under it, drawn from the user-level calls of the trace's first step for any
model. Which calls become steps: docs/how-it-works.md, "How the diagram chooses its steps"; a
layer whose matmul ran in fp8 is one `linear` step noted with its operands' fp8 formats, the
recipe's own calls around it left out (docs/fp8.md says why).

Namesakes, the same concern at another layer: `render/diagram.py`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import groupby

from ampscope.analysis.flow import block_parts, split_block
from ampscope.analysis.fp8 import fp8_matmul_note, fp8_modules
from ampscope.records import EXPLICIT_CASTS, FunctionCall, OpCall, Trace

# Calls that are the nodes of a hand-drawn transformer diagram, by their last name.
DRAWN = frozenset({
    "embedding", "layer_norm", "rms_norm", "group_norm", "batch_norm", "linear", "conv1d",
    "conv2d", "scaled_dot_product_attention", "softmax", "log_softmax", "matmul", "bmm",
    "gelu", "relu", "silu", "tanh", "square", "cross_entropy", "nll_loss", "mse_loss",
})
ADDS = frozenset({"add", "__add__", "__radd__", "__iadd__", "add_"})
_FLOATS = frozenset({"float64", "float32", "bfloat16", "float16"})
# Ops whose first tensor input is the activation (the others are weights and biases).
_ACTIVATION_FIRST = frozenset({"embedding", "layer_norm", "rms_norm", "group_norm",
                               "batch_norm", "linear", "conv1d", "conv2d"})


@dataclass(frozen=True)
class DiagramStep:
    func: str  # "linear", "add", "scaled_dot_product_attention", "float"
    module: str  # qualified name, "" for the model itself
    inputs: tuple[str, ...]  # dtypes of the activations flowing in
    output: str
    casts: tuple[tuple[str, str, str], ...] = ()  # autocast casts under it: (what, from, to)
    note: str = ""  # "explicit cast at model.py:12", "residual add"


@dataclass(frozen=True)
class DiagramSection:
    block: str | None  # "transformer.h.0" for a block; None before and after the blocks
    label: str  # "transformer.h.0–11" when several identical blocks are drawn once
    steps: tuple[DiagramStep, ...]


@dataclass(frozen=True)
class Diagram:
    inputs: tuple[tuple[str, str], ...]  # (name, dtype)
    sections: tuple[DiagramSection, ...]
    outputs: tuple[tuple[str, str], ...]


def _floats(dtypes) -> set[str]:
    return {d for d in dtypes if d in _FLOATS}


def _step(call: FunctionCall, casts: tuple[tuple[str, str, str], ...]) -> DiagramStep | None:
    name = call.func.rsplit(".", 1)[-1]
    ins = tuple(m.dtype for m in call.inputs)
    out = call.outputs[0].dtype if call.outputs else "—"
    changes = bool(_floats(ins)) and out in _FLOATS and _floats(ins) != {out}
    # A residual add runs in a block itself (`x = x + self.attn(...)` in Block.forward), not in
    # one of its children and not in the model (where token and position embeddings are added).
    block = split_block(call.module) if call.module else None
    residual = name in ADDS and len(call.inputs) == 2 and block is not None and block[2] == ""
    explicit = call.func in EXPLICIT_CASTS and changes
    # Adds in the model itself are drawn too (token + position embeddings), unlabelled.
    top_level_add = name in ADDS and len(call.inputs) == 2 and call.module == ""
    if not (name in DRAWN or residual or top_level_add or changes or casts):
        return None
    shown = ins[:1] if name in _ACTIVATION_FIRST else ins
    note = ("explicit cast" + (f" at {call.source}" if call.source else "")) if explicit else (
        "residual add" if residual else "")
    if changes and not explicit and not casts and len(_floats(ins)) > 1:
        note = ", ".join(filter(None, (note, "type promotion")))
    return DiagramStep(name, call.module or "", shown, out, casts, note)


def _casts_by_call(trace: Trace) -> dict[int, tuple[tuple[str, str, str], ...]]:
    casts: dict[int, list[tuple[str, str, str]]] = defaultdict(list)
    for op in trace.ops:
        if op.autocast_cast and op.caller is not None and op.inputs and op.outputs:
            what = op.input_names[0].rsplit(".", 1)[-1] if op.input_names[0] else "input"
            casts[op.caller].append((what, op.inputs[0].dtype, op.outputs[0].dtype))
    return {k: tuple(v) for k, v in casts.items()}


def _fp8_step(call: FunctionCall, ops: list[OpCall]) -> DiagramStep | None:
    """The fp8 matmul of a converted layer as its `linear` step; None for the recipe's other
    calls in it."""
    note = fp8_matmul_note(ops)
    if not note or not call.inputs or not call.outputs:
        return None
    return DiagramStep("linear", call.module or "", (call.inputs[0].dtype,),
                       call.outputs[0].dtype, (), note)


def build_diagram(trace: Trace) -> Diagram:
    casts = _casts_by_call(trace)
    fp8 = fp8_modules(trace)
    ops_by_call: dict[int, list[OpCall]] = defaultdict(list)
    if fp8:
        for op in trace.ops:
            if op.caller is not None and op.module in fp8:
                ops_by_call[op.caller].append(op)
    # The forward calls made before the model's second call (sampling calls it once a token).
    first_step = [c for c in trace.calls if c.phase == "forward" and c.step <= 1]
    steps = [_fp8_step(call, ops_by_call[call.index]) if call.module in fp8
             else _step(call, casts.get(call.index, ())) for call in first_step]
    sections = [DiagramSection(block, block or "", tuple(run))
                for block, run in groupby(filter(None, steps), key=_block)]
    return Diagram(
        inputs=tuple((i.name, i.dtype) for i in trace.inputs),
        sections=tuple(_collapse(sections)),
        outputs=tuple((o.name, o.dtype) for o in trace.outputs),
    )


def _block(step: DiagramStep) -> str | None:
    """The block a step ran in ("transformer.h.3"), None outside the blocks."""
    parts = split_block(step.module) if step.module else None
    return f"{parts[0]}.{parts[1]}" if parts else None


def _relative(step: DiagramStep, block: str) -> tuple:
    module = step.module[len(block) + 1:] if step.module.startswith(block + ".") else (
        "" if step.module == block else step.module)
    return (step.func, module, step.inputs, step.output, step.casts, step.note)


def _signature(section: DiagramSection) -> tuple | None:
    """What consecutive blocks must share to be drawn once: their container, and their steps
    with module names relative to the block. None outside the blocks."""
    if section.block is None:
        return None
    return (block_parts(section.block)[0],
            [_relative(step, section.block) for step in section.steps])


def _collapse(sections: list[DiagramSection]) -> list[DiagramSection]:
    """Consecutive blocks of one container with identical steps are drawn once."""
    out: list[DiagramSection] = []
    for signature, group in groupby(sections, key=_signature):
        run = list(group)
        first, last = run[0].block, run[-1].block
        if signature is None or len(run) == 1 or first is None or last is None:
            out.extend(run)
            continue
        container, low, _ = block_parts(first)
        out.append(DiagramSection(first, f"{container}.{low}–{block_parts(last)[1]}"
                                         f"  (× {len(run)}, drawn once)", run[0].steps))
    return out
