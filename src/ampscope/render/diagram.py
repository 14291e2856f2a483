"""The dtype flow diagram as text: a vertical chain of steps, dtypes on every edge."""

from __future__ import annotations

from rich.text import Text

from ampscope.analysis.diagram import Diagram, DiagramStep
from ampscope.render.style import DTYPE_STYLES, SHORT_DTYPES


def _dtype(d: str) -> Text:
    return Text(SHORT_DTYPES.get(d, d), style=DTYPE_STYLES.get(d, "yellow"))


# Short names people write in diagrams, for the calls whose torch names are long.
SHORT_FUNCS = {"scaled_dot_product_attention": "sdpa"}


def _casts_note(casts: tuple[tuple[str, str, str], ...]) -> str:
    """"autocast → bf16: input, weight" (grouped by the dtype they were cast to)."""
    by_target: dict[str, list[str]] = {}
    for what, _src, dst in casts:
        by_target.setdefault(dst, []).append(what)
    return "; ".join(f"autocast → {SHORT_DTYPES.get(d, d)}: {', '.join(dict.fromkeys(w))}"
                     for d, w in by_target.items())


def _step_line(step: DiagramStep, block: str | None, indent: str) -> Text:
    module = step.module
    if block and module.startswith(block + "."):
        module = module[len(block) + 1:]
    elif module == block or module == "":
        module = "(block)" if block else "(model)"
    line = Text(f"{indent}├─ ")
    line.append(f"{SHORT_FUNCS.get(step.func, step.func):<13}", style="bold")
    line.append(f" {module:<16} ")
    for i, d in enumerate(step.inputs):
        if i:
            line.append(" + ")
        line.append_text(_dtype(d))
    changed = step.output not in step.inputs
    line.append(" ⇒ " if changed else " → ")
    line.append_text(_dtype(step.output))
    notes = []
    if step.casts:
        notes.append(_casts_note(step.casts))
    if step.note:
        notes.append(step.note)
    if notes:
        line.append("  [" + "; ".join(notes) + "]", style="dim")
    return line


def render_diagram(diagram: Diagram) -> Text:
    text = Text()
    inputs = ", ".join(f"{n} {SHORT_DTYPES.get(d, d)}" for n, d in diagram.inputs)
    text.append(f"  {inputs}\n")
    text.append("   │\n")
    for section in diagram.sections:
        if section.block is None:
            for step in section.steps:
                text.append_text(_step_line(step, None, "   "))
                text.append("\n")
            continue
        text.append(f"  ┌ {section.label}\n", style="bold")
        for step in section.steps:
            text.append_text(_step_line(step, section.block, "  │"))
            text.append("\n")
        text.append("  └\n")
    outputs = ", ".join(f"{n} {SHORT_DTYPES.get(d, d)}" for n, d in diagram.outputs)
    text.append("   │\n")
    text.append(f"  {outputs}\n")
    text.append("  → dtype kept   ⇒ dtype changed   [autocast → X: what autocast cast to X]",
                style="dim")
    return text
