"""The dtype flow diagram (analysis/diagram.py) drawn as SVG, for the HTML report.

What it draws: docs/report.md ("Dtype flow"). Each section (the steps before the blocks, one
block drawn once, the steps after) is its own SVG, so the HTML page can put a repeated block
inside a collapsible `<details>`.

The SVG is drawn by hand (no matplotlib): a few dozen rectangles and lines, computed here and
written by the template render/templates/flowgraph.svg.j2 with autoescaping on.
"""

from __future__ import annotations

from markupsafe import Markup

from ampscope.analysis.diagram import DiagramSection, DiagramStep
from ampscope.render.diagram import SHORT_FUNCS, relative_module, step_notes
from ampscope.render.style import SHORT_DTYPES
from ampscope.render.templating import macros

# Geometry, in CSS pixels.
LANE = 44  # left lane for the residual stream
NODE_W = 380
NODE_H = 40
GAP = 26  # vertical room for an edge between two nodes
WIDTH = LANE + NODE_W + 8
CENTER = LANE + NODE_W // 2
MAX_CHARS = 52  # a node's second line is cut here; the full text is in its tooltip


def short(dtype: str) -> str:
    return SHORT_DTYPES.get(dtype, dtype)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _node(step: DiagramStep, block: str | None, y: float) -> tuple[str, dict]:
    module = relative_module(step, block)
    changed = step.output not in step.inputs
    arrow = " ⇒ " if changed else " → "
    notes = step_notes(step)
    title = (f"{step.func} in {step.module or '(model)'}: {' + '.join(step.inputs)}{arrow}"
             f"{step.output}" + (f"  [{notes}]" if notes else ""))
    room = MAX_CHARS - len(" + ".join(map(short, step.inputs))) - len(short(step.output)) - 3
    # One diamond per target dtype, on the edge just above the node: the casts happen there.
    diamonds = [(CENTER - 14 - 14 * i, y - 9, dst) for i, dst in
                enumerate(dict.fromkeys(dst for _what, _src, dst in step.casts))]
    return "node", {"y": y, "title": title, "func": SHORT_FUNCS.get(step.func, step.func),
                    "module": _cut(module, 40), "inputs": step.inputs, "output": step.output,
                    "changed": changed, "note": _cut(notes, room) if notes else "",
                    "diamonds": diamonds}


GEOMETRY = {"lane": LANE, "node_w": NODE_W, "node_h": NODE_H, "width": WIDTH, "center": CENTER}


def section_svg(section: DiagramSection, *, last: bool = False) -> Markup:
    """One section of the diagram as an SVG: an edge in, its nodes, and (last) an edge out."""
    steps = section.steps
    height = GAP + len(steps) * (NODE_H + GAP) - (0 if last else GAP)
    parts = []
    residual_from = GAP / 2  # where the residual stream leaves the main line
    previous = steps[0].inputs[0] if steps[0].inputs else steps[0].output
    for i, step in enumerate(steps):
        y = GAP + i * (NODE_H + GAP)
        parts.append(("edge", {"y0": y - GAP, "y1": y, "dtype": previous, "label": True}))
        if "residual add" in step.note:  # from the main line, down the left lane, into the add
            parts.append(("residual", {"src_y": residual_from, "mid": y + NODE_H / 2,
                                       "lane": LANE - 10, "dtype": step.inputs[0]}))
            residual_from = y + NODE_H + GAP / 2
        parts.append(_node(step, section.block, y))
        previous = step.output
    if last:
        parts.append(("edge", {"y0": height - GAP, "y1": height, "dtype": previous,
                               "label": False}))
    return macros("flowgraph.svg.j2").svg(GEOMETRY, section.label or "steps", height, parts)
