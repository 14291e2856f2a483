"""Terminal rendering of a trace with rich. Reads reports; computes nothing of its own."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.diagram import build_diagram
from ampscope.analysis.flow import FlowRow, dtype_changes, module_flow, op_flow
from ampscope.analysis.summary import dtype_inventory
from ampscope.records import Trace
from ampscope.render.diagram import render_diagram
from ampscope.render.style import dtype_text, short_op


def header(trace: Trace) -> Text:
    s = trace.setting
    where = s.device + (" (emulated)" if s.emulated else "")
    text = Text()
    text.append(trace.model.name, style="bold")
    text.append(f" ({trace.model.cls}, {trace.model.parameters:,} parameters)  ")
    text.append("setting ", style="dim")
    text.append(s.name, style="bold")
    text.append(f" on {where}  ", style="")
    text.append("workload ", style="dim")
    text.append(trace.workload, style="bold")
    if trace.mode == "predict":
        text.append("  predicted", style="bold magenta")
    for note in trace.notes:
        text.append("\n  ")
        text.append(note, style="dim")
    return text


def inventory_table(trace: Trace) -> Table:
    table = Table(title="Tensors by dtype", title_justify="left", show_edge=False)
    for col, kw in [("category", {}), ("dtype", {}), ("tensors", {"justify": "right"}),
                    ("elements", {"justify": "right"}), ("MB", {"justify": "right"}),
                    ("which", {})]:
        table.add_column(col, **kw)
    for row in dtype_inventory(trace):
        table.add_row(row.category, dtype_text([row.dtype], short=False), str(row.tensors),
                      f"{row.elements:,}", f"{row.bytes / 1e6:.2f}", row.detail)
    return table


def flow_table(rows: list[FlowRow], title: str, kind_column: str = "type") -> Table:
    """Module or op rows: name, kind, in → out dtypes; rows that change dtype in bold."""
    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column("module", overflow="fold")
    table.add_column(kind_column)
    table.add_column("in")
    table.add_column("out")
    table.add_column("note", style="dim")
    for r in rows:
        name = Text("  " * r.depth + r.name, style="bold" if r.changes_dtype else "")
        kind = short_op(r.kind) if kind_column == "op" else r.kind
        table.add_row(name, kind, dtype_text(r.inputs), dtype_text(r.outputs), r.note)
    return table


def findings_list(trace: Trace) -> Text:
    text = Text()
    text.append("Findings\n", style="italic")
    for f in trace.findings:
        text.append("  • ")
        text.append(f.text)
        text.append(f"  [{f.cause}]\n", style="dim")
    return text


def render_trace(trace: Trace, *, ops: bool = False, diagram: bool = False) -> RenderableType:
    flow = module_flow(trace.modules)
    parts: list[RenderableType] = [header(trace), Text(), inventory_table(trace), Text(),
                                   flow_table(flow, "Modules, forward pass")]
    changes = dtype_changes(flow)
    if changes:
        text = Text("Where activations change dtype\n", style="italic")
        for r in changes:
            text.append(f"  {r.name} ({r.kind}): ")
            text.append_text(dtype_text(r.inputs))
            text.append(" → ")
            text.append_text(dtype_text(r.outputs))
            text.append("\n")
        parts += [Text(), text]
    if ops:
        for phase in ("forward", "backward", "optimizer"):
            rows = op_flow(trace.ops, phase)
            if rows:
                parts += [Text(), flow_table(rows, f"Ops, {phase}", kind_column="op")]
    if diagram:
        # Imported here: render.diagram imports this module's dtype styles.
        parts += [Text(), Text("Dtype flow of one forward pass", style="italic"),
                  render_diagram(build_diagram(trace))]
    parts += [Text(), findings_list(trace)]
    return Group(*parts)
