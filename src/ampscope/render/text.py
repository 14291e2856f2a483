"""Terminal rendering of a trace with rich. Reads reports; computes nothing of its own."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.flow import FlowRow, module_flow, op_flow
from ampscope.analysis.summary import dtype_inventory
from ampscope.trace import Trace

DTYPE_STYLES = {
    "float64": "blue", "float32": "green", "bfloat16": "cyan", "float16": "magenta",
    "float8_e4m3fn": "red", "float8_e5m2": "red",
}


def dtype_text(dtypes: tuple[str, ...] | list[str]) -> Text:
    text = Text()
    for i, d in enumerate(dtypes):
        if i:
            text.append(", ")
        text.append(d, style=DTYPE_STYLES.get(d, "yellow"))
    return text or Text("—", style="dim")


def header(trace: Trace) -> Text:
    s = trace.setting
    where = s.get("device", "?") + (" (emulated)" if s.get("emulated") else "")
    text = Text()
    text.append(trace.model.name, style="bold")
    text.append(f" ({trace.model.cls}, {trace.model.parameters:,} parameters)  ")
    text.append("setting ", style="dim")
    text.append(s.get("name", "?"), style="bold")
    text.append(f" on {where}  ", style="")
    text.append("workload ", style="dim")
    text.append(trace.workload, style="bold")
    return text


def inventory_table(trace: Trace) -> Table:
    table = Table(title="Tensors by dtype", title_justify="left", show_edge=False)
    for col, kw in [("category", {}), ("dtype", {}), ("tensors", {"justify": "right"}),
                    ("elements", {"justify": "right"}), ("MB", {"justify": "right"}),
                    ("which", {})]:
        table.add_column(col, **kw)
    for row in dtype_inventory(trace):
        table.add_row(row.category, dtype_text([row.dtype]), str(row.tensors),
                      f"{row.elements:,}", f"{row.bytes / 1e6:.2f}", row.detail)
    return table


def flow_table(rows: list[FlowRow], title: str, first_column: str = "module") -> Table:
    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column(first_column)
    table.add_column("type")
    table.add_column("in")
    table.add_column("out")
    table.add_column("", style="dim")
    for r in rows:
        name = Text("  " * r.depth + r.name, style="bold" if r.changes_dtype else "")
        note = "dtype changes" if r.changes_dtype else ""
        note = ", ".join(x for x in (note, r.note) if x)
        table.add_row(name, r.kind, dtype_text(r.inputs), dtype_text(r.outputs), note)
    return table


def findings_list(trace: Trace) -> Text:
    text = Text()
    text.append("Findings\n", style="italic")
    for f in trace.findings:
        text.append("  • ")
        text.append(f.text)
        text.append(f"  [{f.cause}]\n", style="dim")
    return text


def render_trace(trace: Trace, *, ops: bool = False) -> RenderableType:
    parts: list[RenderableType] = [header(trace), Text(), inventory_table(trace), Text(),
                                   flow_table(module_flow(trace.modules), "Modules, forward pass")]
    changes = [r for r in module_flow(trace.modules) if r.changes_dtype]
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
                parts += [Text(), flow_table(rows, f"Ops, {phase}", first_column="module")]
    parts += [Text(), findings_list(trace)]
    return Group(*parts)
