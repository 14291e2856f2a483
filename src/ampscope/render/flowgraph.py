"""The dtype flow diagram (analysis/diagram.py) drawn as SVG, for the HTML report.

One node per step, top to bottom; the edge into a node is coloured by the dtype flowing along
it; a diamond on an edge marks the casts autocast inserted for that step; a node whose output
leaves in another dtype than its inputs has a thick border in the new dtype's colour; a residual
add gets the residual stream as a second edge on a lane to the left. Each section (the steps
before the blocks, one block drawn once, the steps after) is its own SVG, so the HTML page can
put a repeated block inside a collapsible `<details>`.

The SVG is written by hand (no matplotlib): it is a few dozen rectangles and lines, and every
text from the model goes through `html.escape`.
"""

from __future__ import annotations

from html import escape

from ampscope.analysis.diagram import DiagramSection, DiagramStep
from ampscope.render.plots import dtype_color
from ampscope.render.style import SHORT_DTYPES

# Geometry, in CSS pixels.
LANE = 44  # left lane for the residual stream
NODE_W = 380
NODE_H = 40
GAP = 26  # vertical room for an edge between two nodes
WIDTH = LANE + NODE_W + 8
CENTER = LANE + NODE_W // 2
MAX_CHARS = 52  # a node's second line is cut here; the full text is in its tooltip

SHORT_FUNCS = {"scaled_dot_product_attention": "sdpa"}


def short(dtype: str) -> str:
    return SHORT_DTYPES.get(dtype, dtype)


def relative_module(step: DiagramStep, block: str | None) -> str:
    """The module as drawn inside its block: "attn.c_attn"; "(block)" or "(model)" for the
    block or the model itself."""
    if block and step.module.startswith(block + "."):
        return step.module[len(block) + 1:]
    if step.module in ("", block):
        return "(block)" if block else "(model)"
    return step.module


def casts_note(casts: tuple[tuple[str, str, str], ...]) -> str:
    """"autocast → bf16: bias, weight, input", grouped by the dtype they were cast to."""
    by_target: dict[str, list[str]] = {}
    for what, _src, dst in casts:
        by_target.setdefault(dst, []).append(what)
    return "; ".join(f"autocast → {short(d)}: {', '.join(dict.fromkeys(w))}"
                     for d, w in by_target.items())


def step_notes(step: DiagramStep) -> str:
    return "; ".join(filter(None, (casts_note(step.casts), step.note)))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _arrow(x: float, y: float, color: str) -> str:
    """An arrowhead pointing down whose tip is at (x, y)."""
    return f'<polygon points="{x - 4},{y - 7} {x + 4},{y - 7} {x},{y}" fill="{color}"/>'


def _edge(y0: float, y1: float, dtype: str, *, label: bool = True) -> str:
    color = dtype_color(dtype)
    parts = [f'<line x1="{CENTER}" y1="{y0}" x2="{CENTER}" y2="{y1 - 6}" stroke="{color}" '
             f'stroke-width="2.5"/>', _arrow(CENTER, y1, color)]
    if label:
        parts.append(f'<text x="{CENTER + 8}" y="{(y0 + y1) / 2 + 4}" class="fg-edge" '
                     f'fill="{color}">{escape(short(dtype))}</text>')
    return "".join(parts)


def _residual(src_y: float, node_y: float, dtype: str) -> str:
    """The residual stream: from the main edge at `src_y`, down the left lane, into the add."""
    color = dtype_color(dtype)
    mid = node_y + NODE_H / 2
    lane = LANE - 10
    return (f'<path d="M{CENTER},{src_y} H{lane} V{mid} H{LANE - 6}" fill="none" '
            f'stroke="{color}" stroke-width="2" stroke-dasharray="5 3"/>'
            f'<polygon points="{LANE - 7},{mid - 4} {LANE - 7},{mid + 4} {LANE},{mid}" '
            f'fill="{color}"/>'
            f'<text x="{lane - 4}" y="{mid - 6}" text-anchor="end" class="fg-edge" '
            f'fill="{color}">{escape(short(dtype))}</text>')


def _node(step: DiagramStep, block: str | None, y: float) -> str:
    module = relative_module(step, block)
    func = SHORT_FUNCS.get(step.func, step.func)
    changed = step.output not in step.inputs
    stroke = (f'stroke="{dtype_color(step.output)}" stroke-width="2.5"' if changed
              else 'stroke="#c4c8ce" stroke-width="1"')
    arrow = " ⇒ " if changed else " → "
    notes = step_notes(step)
    title = (f"{step.func} in {step.module or '(model)'}: {' + '.join(step.inputs)}{arrow}"
             f"{step.output}" + (f"  [{notes}]" if notes else ""))
    dtypes = [f'<tspan fill="{dtype_color(d)}">{escape(short(d))}</tspan>' for d in step.inputs]
    flow = " + ".join(dtypes) + arrow + (f'<tspan fill="{dtype_color(step.output)}" '
                                         f'font-weight="bold">{escape(short(step.output))}</tspan>')
    room = MAX_CHARS - len(" + ".join(map(short, step.inputs))) - len(short(step.output)) - 3
    note = f'<tspan class="fg-note">  {escape(_cut(notes, room))}</tspan>' if notes else ""
    parts = [
        f'<g class="fg-node"><title>{escape(title)}</title>',
        f'<rect x="{LANE}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="6" fill="#fff" {stroke}/>',
        f'<text x="{LANE + 10}" y="{y + 16}" class="fg-func">{escape(func)}'
        f'<tspan class="fg-module">  {escape(_cut(module, 40))}</tspan></text>',
        f'<text x="{LANE + 10}" y="{y + 33}" class="fg-flow">{flow}{note}</text>',
    ]
    # One diamond per target dtype, on the edge just above the node: the casts happen there.
    for i, dst in enumerate(dict.fromkeys(dst for _what, _src, dst in step.casts)):
        cx, cy = CENTER - 14 - 14 * i, y - 9
        parts.append(f'<polygon points="{cx},{cy - 6} {cx + 6},{cy} {cx},{cy + 6} {cx - 6},{cy}" '
                     f'fill="{dtype_color(dst)}" stroke="#fff" stroke-width="1"/>')
    parts.append("</g>")
    return "".join(parts)


def section_svg(section: DiagramSection, *, last: bool = False) -> str:
    """One section of the diagram as an SVG: an edge in, its nodes, and (last) an edge out."""
    steps = section.steps
    height = GAP + len(steps) * (NODE_H + GAP) - (0 if last else GAP)
    out = [f'<svg class="flowgraph" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" role="img" '
           f'aria-label="{escape(section.label or "steps")}: dtype flow">']
    residual_from = GAP / 2  # where the residual stream leaves the main line
    previous = steps[0].inputs[0] if steps[0].inputs else steps[0].output
    for i, step in enumerate(steps):
        y = GAP + i * (NODE_H + GAP)
        out.append(_edge(y - GAP, y, previous))
        if "residual add" in step.note:
            out.append(_residual(residual_from, y, step.inputs[0]))
            residual_from = y + NODE_H + GAP / 2
        out.append(_node(step, section.block, y))
        previous = step.output
    if last:
        out.append(_edge(height - GAP, height, previous, label=False))
    out.append("</svg>")
    return "".join(out)
