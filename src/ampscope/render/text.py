"""Terminal rendering of a trace with rich: draws a `TraceSummary`, computes nothing of its own."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.flow import FlowRow
from ampscope.analysis.step_time import StepTime
from ampscope.analysis.summary import DtypeCount, TraceSummary
from ampscope.records import SettingRecord
from ampscope.render.diagnostics import diagnostics_text
from ampscope.render.diagram import render_diagram
from ampscope.render.predicted_step import predicted_line
from ampscope.render.style import dtype_text, short_op, titled_table


def header(summary: TraceSummary) -> Text:
    s = summary.setting
    where = s.device + (" (emulated)" if s.emulated else "")
    text = Text()
    text.append(summary.model.name, style="bold")
    text.append(f" ({summary.model.cls}, {summary.model.parameters:,} parameters)  ")
    text.append("setting ", style="dim")
    text.append(s.name, style="bold")
    if s.name == "as-run":  # what the script itself set, as it ran
        text.append(f" ({as_run_text(s)})")
    text.append(f" on {where}  ", style="")
    text.append("workload ", style="dim")
    text.append(summary.workload, style="bold")
    if summary.mode == "predict":
        text.append("  predicted", style="bold magenta")
    for note in summary.notes:
        text.append("\n  ")
        text.append(note, style="dim")
    return text


def as_run_text(s: SettingRecord) -> str:
    """A run's observed setting in words: "float32 weights, autocast float16, TF32 matmuls"."""
    parts = [f"{s.param_dtype} weights" if s.param_dtype else "no floating weights",
             f"autocast {s.autocast_dtype}" if s.autocast_dtype else "no autocast"]
    if s.fsdp_param_dtype:  # FSDP2's MixedPrecisionPolicy: what the weights compute in
        reduce = f", reduce {s.fsdp_reduce_dtype}" if s.fsdp_reduce_dtype else ""
        parts.insert(1, f"FSDP2 compute {s.fsdp_param_dtype}{reduce}")
    if s.matmul_precision != "highest":
        parts.append("TF32 matmuls" if s.matmul_precision == "high" else
                     f"float32 matmul precision {s.matmul_precision!r}")
    return ", ".join(parts)


def inventory_table(rows: list[DtypeCount]) -> Table:
    table = titled_table("Tensors by dtype", "category", "dtype", "tensors", "elements", "MB",
                         "which", right=("tensors", "elements", "MB"))
    for row in rows:
        table.add_row(row.category, dtype_text([row.dtype], short=False), str(row.tensors),
                      f"{row.elements:,}", f"{row.bytes / 1e6:.2f}", row.detail)
    return table


def flow_table(rows: list[FlowRow], title: str, kind_column: str = "type") -> Table:
    """Module or op rows: name, kind, in → out dtypes; rows that change dtype in bold."""
    table = titled_table(title, ("module", {"overflow": "fold"}), kind_column, "in", "out",
                         ("note", {"style": "dim"}))
    for r in rows:
        name = Text("  " * r.depth + r.name, style="bold" if r.changes_dtype else "")
        kind = short_op(r.kind) if kind_column == "op" else r.kind
        table.add_row(name, kind, dtype_text(r.inputs), dtype_text(r.outputs), r.note)
    return table


def render_trace(summary: TraceSummary, predicted: StepTime | None = None) -> RenderableType:
    """What `ampscope trace` prints (see analysis.summary.trace_summary for what is in it);
    with the step `predicted` on a GPU, its one line under the header."""
    parts: list[RenderableType] = [header(summary)]
    if predicted is not None:
        parts.append(predicted_line(predicted))
    parts.append(Text())
    if summary.diagnostics:  # what is wrong comes first; nothing is said when nothing is
        parts += [diagnostics_text(summary.diagnostics, summary.setting.device)]
    parts += [inventory_table(summary.inventory), Text(),
              flow_table(summary.modules, "Modules, forward pass")]
    if summary.changes:
        text = Text("Where activations change dtype\n", style="italic")
        for r in summary.changes:
            text.append(f"  {r.name} ({r.kind}): ")
            text.append_text(dtype_text(r.inputs))
            text.append(" → ")
            text.append_text(dtype_text(r.outputs))
            text.append("\n")
        parts += [Text(), text]
    for phase, rows in summary.ops.items():
        parts += [Text(), flow_table(rows, f"Ops, {phase}", kind_column="op")]
    if summary.diagram is not None:
        parts += [Text(), Text("Dtype flow of one forward pass", style="italic"),
                  render_diagram(summary.diagram)]
    findings = Text()
    findings.append("Findings\n", style="italic")
    for f in summary.findings:
        findings.append("  • ")
        findings.append(f.text)
        findings.append(f"  [{f.cause}]\n", style="dim")
    parts += [Text(), findings]
    return Group(*parts)
