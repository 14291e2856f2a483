"""The dtype flow diagram as text: a vertical chain of steps, dtypes on every edge; and how a
step is described (`relative_module`, `step_notes`), which the SVG (flowgraph.py) shares.

Namesakes, the same concern at another layer: `analysis/diagram.py`."""

from __future__ import annotations

from rich.text import Text

from ampscope.analysis.diagram import Diagram, DiagramStep
from ampscope.render.style import SHORT_DTYPES, dtype_text

# Short names people write in diagrams, for the calls whose torch names are long.
SHORT_FUNCS = {"scaled_dot_product_attention": "sdpa"}


def relative_module(step: DiagramStep, block: str | None) -> str:
    """The module as drawn inside its block: "attn.c_attn"; "(block)" or "(model)" for the
    block or the model itself."""
    if block and step.module.startswith(block + "."):
        return step.module[len(block) + 1:]
    if step.module in ("", block):
        return "(block)" if block else "(model)"
    return step.module


def step_notes(step: DiagramStep) -> str:
    """What autocast cast for the step, grouped by the dtype it cast to ("autocast → bf16:
    input, weight"), and the step's own note."""
    by_target: dict[str, list[str]] = {}
    for what, _src, dst in step.casts:
        by_target.setdefault(dst, []).append(what)
    casts = "; ".join(f"autocast → {SHORT_DTYPES.get(d, d)}: {', '.join(dict.fromkeys(w))}"
                      for d, w in by_target.items())
    return "; ".join(filter(None, (casts, step.note)))


def _step_line(step: DiagramStep, block: str | None, indent: str) -> Text:
    line = Text(f"{indent}├─ ")
    line.append(f"{SHORT_FUNCS.get(step.func, step.func):<13}", style="bold")
    line.append(f" {relative_module(step, block):<16} ")
    for i, d in enumerate(step.inputs):
        if i:
            line.append(" + ")
        line.append_text(dtype_text([d]))
    changed = step.output not in step.inputs
    line.append(" ⇒ " if changed else " → ")
    line.append_text(dtype_text([step.output]))
    notes = step_notes(step)
    if notes:
        line.append(f"  [{notes}]", style="dim")
    return line


def render_diagram(diagram: Diagram) -> Text:
    text = Text()
    inputs = ", ".join(f"{n} {SHORT_DTYPES.get(d, d)}" for n, d in diagram.inputs)
    text.append(f"  {inputs}\n")
    text.append("   │\n")
    for section in diagram.sections:
        indent = "   " if section.block is None else "  │"
        if section.block is not None:
            text.append(f"  ┌ {section.label}\n", style="bold")
        for step in section.steps:
            text.append_text(_step_line(step, section.block, indent))
            text.append("\n")
        if section.block is not None:
            text.append("  └\n")
    outputs = ", ".join(f"{n} {SHORT_DTYPES.get(d, d)}" for n, d in diagram.outputs)
    text.append("   │\n")
    text.append(f"  {outputs}\n")
    text.append("  → dtype kept   ⇒ dtype changed   [autocast → X: what autocast cast to X]",
                style="dim")
    return text
