"""HTML: the self-contained report page (`ampscope report`) and the notebook fragments
(`_repr_html_` of Trace, Matrix, FlopReport and NumericsReport), from the same section renderers.

The page loads nothing: no script, no web font, no image file, no stylesheet link. Plots are
inline SVG (render/plots.py with matplotlib, render/flowgraph.py by hand), collapsing uses
`<details>`, and a Content-Security-Policy that allows no source at all backs that up in the
browser. Everything that comes from the model or the user (module, class and parameter names,
source paths, finding text, setting names) goes through `escape`.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from ampscope.analysis.compare import Cell, Matrix
from ampscope.analysis.diagram import Diagram, build_diagram
from ampscope.analysis.flops import FlopReport
from ampscope.analysis.memory import MemoryReport
from ampscope.analysis.numerics import NumericsReport
from ampscope.analysis.summary import dtype_inventory
from ampscope.records import Trace, module_label
from ampscope.render.flops import human
from ampscope.render.flowgraph import section_svg
from ampscope.render.matrix import short_names
from ampscope.render.numerics import _err as divergence_text
from ampscope.render.plots import (
    divergence_by_depth_svg,
    dtype_color,
    flops_by_module_svg,
    live_bytes_svg,
    memory_at_peak_svg,
)
from ampscope.render.style import SHORT_DTYPES, format_bytes, short_op

MONO = 'ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace'
CSS = f"""
.ampscope {{ font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue",
  Arial, sans-serif; color: #1d2127; }}
.ampscope h1 {{ font-size: 22px; margin: 0 0 2px; }}
.ampscope h2 {{ font-size: 18px; margin: 28px 0 8px; padding-bottom: 4px;
  border-bottom: 1px solid #e3e5e8; }}
.ampscope h3 {{ font-size: 15px; margin: 12px 0 6px; }}
.ampscope nav a {{ margin-right: 14px; color: #1f57a8; }}
.ampscope .meta, .ampscope .hint {{ color: #5f6670; }}
.ampscope .hint {{ font-size: 13px; }}
.ampscope table {{ border-collapse: collapse; font-size: 13px; margin: 6px 0 10px; }}
.ampscope th, .ampscope td {{ padding: 3px 10px; text-align: left; vertical-align: top;
  border-bottom: 1px solid #eceef1; }}
.ampscope th {{ font-weight: 600; background: #f6f7f9; }}
.ampscope td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.ampscope td.name {{ white-space: pre; font-family: {MONO}; font-size: 12px; }}
.ampscope td.differs {{ background: #fff1bf; }}
.ampscope .dt {{ font-family: {MONO}; font-size: 12px; font-weight: 600; }}
.ampscope .cause {{ font-size: 11px; color: #5f6670; border: 1px solid #d5d8dd;
  border-radius: 8px; padding: 0 6px; margin-left: 6px; white-space: nowrap; }}
.ampscope ul.findings {{ margin: 4px 0 10px; padding-left: 22px; }}
.ampscope ul.findings li {{ margin: 3px 0; }}
.ampscope details > summary {{ cursor: pointer; }}
.ampscope details.setting > summary {{ font-weight: 600; margin: 8px 0 4px; }}
.ampscope .flows {{ display: flex; flex-wrap: wrap; gap: 28px; align-items: flex-start; }}
.ampscope .flow h3 {{ margin-left: 44px; }}
.ampscope .flow svg {{ display: block; }}
.ampscope .io {{ font-family: {MONO}; font-size: 12px; margin-left: 44px; width: fit-content;
  padding: 3px 10px; border: 1px dashed #9aa0a8; border-radius: 6px; }}
.ampscope details.block {{ background: #f2f4f8; border-radius: 8px; }}
.ampscope details.block > summary {{ font-size: 13px; font-weight: 600; padding: 4px 10px; }}
.ampscope .fg-func {{ font-size: 13px; font-weight: 600; fill: #1d2127; }}
.ampscope .fg-module {{ font-weight: 400; fill: #5f6670; }}
.ampscope .fg-flow {{ font-family: {MONO}; font-size: 12px; fill: #1d2127; }}
.ampscope .fg-note {{ font-family: system-ui, sans-serif; font-size: 11px; fill: #6d7177;
  font-style: italic; }}
.ampscope .fg-edge {{ font-family: {MONO}; font-size: 11px; font-weight: 600; }}
.ampscope .legend span {{ margin-right: 16px; white-space: nowrap; }}
.ampscope .swatch {{ display: inline-block; width: 18px; height: 4px; margin-right: 4px;
  vertical-align: middle; }}
.ampscope .plot svg {{ max-width: 100%; height: auto; }}
"""
# No source of any kind may be loaded: inline styles only, no script, no fetch, no image file.
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def dtype_span(dtype: str) -> str:
    return (f'<span class="dt" style="color: {dtype_color(dtype)}">'
            f"{escape(SHORT_DTYPES.get(dtype, dtype))}</span>")


def dtypes_html(dtypes: Sequence[str]) -> str:
    return " ".join(map(dtype_span, dtypes)) or '<span class="meta">—</span>'


def table(columns: Sequence[str], rows: Sequence[Sequence[str]],
          classes: Sequence[str] = ()) -> str:
    """A table of already escaped cells; `classes[i]` is column i's class ("num", "name")."""
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = classes[i] if i < len(classes) else ""
            cells.append(f'<td class="{cls}">{cell}</td>' if cls else f"<td>{cell}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def section(key: str, title: str, body: str) -> str:
    return f'<section id="{key}"><h2>{escape(title)}</h2>{body}</section>'


def setting_name(trace: Trace) -> str:
    return trace.setting.name


def _details(summary: str, body: str, *, open_: bool = True, cls: str = "setting") -> str:
    return (f'<details class="{cls}"{" open" if open_ else ""}><summary>{summary}</summary>'
            f"{body}</details>")


# --- sections --------------------------------------------------------------------------------


def header(traces: Sequence[Trace]) -> str:
    """Model, workload, the settings and where they ran, and what the runs assumed."""
    first = traces[0]
    where = []
    for t in traces:
        device = t.setting.device + (" (emulated)" if t.setting.emulated else "")
        where.append(f"<b>{escape(setting_name(t))}</b> on {escape(device)}"
                     + (" (predicted)" if t.mode == "predict" else ""))
    notes = list(dict.fromkeys(n for t in traces for n in t.notes))
    return (f'<p class="meta"><b>{escape(first.model.name)}</b> ({escape(first.model.cls)}, '
            f"{first.model.parameters:,} parameters) · workload <b>{escape(first.workload)}</b> · "
            f"{', '.join(where)}</p>"
            + "".join(f'<p class="hint">{escape(n)}</p>' for n in notes))


def findings_body(traces: Sequence[Trace]) -> str:
    parts = []
    for t in traces:
        items = "".join(f'<li>{escape(f.text)}<span class="cause">{escape(f.cause)}</span></li>'
                        for f in t.findings) or "<li>No findings.</li>"
        parts.append(_details(f"{escape(setting_name(t))} · {len(t.findings)} findings",
                              f'<ul class="findings">{items}</ul>'))
    return "".join(parts)


def inventory_body(trace: Trace) -> str:
    rows = [(escape(r.category), dtype_span(r.dtype), str(r.tensors), f"{r.elements:,}",
             f"{r.bytes / 1e6:.2f}", escape(r.detail)) for r in dtype_inventory(trace)]
    return table(("category", "dtype", "tensors", "elements", "MB", "which"), rows,
                 ("", "", "num", "num", "num", ""))


def _flow_column(title: str, diagram: Diagram) -> str:
    parts = [f'<div class="flow"><h3>{escape(title)}</h3>',
             '<div class="io">' + ", ".join(f"{escape(n)} {dtype_span(d)}"
                                             for n, d in diagram.inputs) + "</div>"]
    if not diagram.sections:
        parts.append('<p class="hint">No forward call was recorded.</p>')
    for i, s in enumerate(diagram.sections):
        svg = section_svg(s, last=i == len(diagram.sections) - 1)
        if s.block is None:
            parts.append(svg)
        else:
            parts.append(_details(f"{escape(s.label)} · {len(s.steps)} steps", svg, cls="block"))
    parts.append('<div class="io">' + ", ".join(f"{escape(n)} {dtype_span(d)}"
                                                for n, d in diagram.outputs) + "</div></div>")
    return "".join(parts)


def _legend(diagrams: Sequence[Diagram]) -> str:
    seen = dict.fromkeys(d for g in diagrams for s in g.sections for step in s.steps
                         for d in (*step.inputs, step.output))
    swatches = "".join(f'<span><i class="swatch" style="background: {dtype_color(d)}"></i>'
                       f"{escape(SHORT_DTYPES.get(d, d))}</span> " for d in seen)
    return (f'<p class="legend hint">Edge colour: the dtype flowing. {swatches}<br>'
            "<span>◆ on an edge: casts autocast inserted (colour: the dtype cast to)</span> "
            "<span>thick border, ⇒: the step changed dtype</span> "
            "<span>dashed lane: the residual stream into a residual add</span> "
            "<span>shaded: one block, drawn once for identical repeats (click to fold)</span></p>")


def flow_body(traces: Sequence[Trace]) -> str:
    diagrams = [build_diagram(t) for t in traces]
    columns = "".join(_flow_column(setting_name(t), g)
                      for t, g in zip(traces, diagrams, strict=True))
    return (_legend(diagrams) + f'<div class="flows">{columns}</div>'
            '<p class="hint">Steps of one forward pass, as the user-level calls ran them; '
            "hover a step for its full text.</p>")


def _cell(cell: Cell, differs: bool) -> str:
    if cell is None:
        return '<span class="meta">not run</span>'
    return dtypes_html(cell[0]) + " → " + dtypes_html(cell[1]) + (" *" if differs else "")


def _row(label: str, kind: str, cells: Sequence[str], differs: Sequence[bool]) -> str:
    tds = "".join(f'<td class="differs">{c}</td>' if d else f"<td>{c}</td>"
                  for c, d in zip(cells, differs, strict=True))
    return f'<tr><td class="name">{escape(label)}</td>{kind}{tds}</tr>'


def matrix_body(matrix: Matrix) -> str:
    names = [escape(n) for n in matrix.names]
    head = "".join(f"<th>{n}</th>" for n in names)
    labels = short_names([(r.name, r.depth) for r in matrix.rows])
    modules = "".join(
        _row(label, f"<td>{escape(r.kind)}</td>",
             [_cell(c, d) for c, d in zip(r.cells, r.differs, strict=True)], r.differs)
        for label, r in zip(labels, matrix.rows, strict=True))
    summary = "".join(
        _row(s.what, "", [escape(v) + (" *" if d else "") for v, d in zip(s.values, s.differs,
                                                                          strict=True)], s.differs)
        for s in matrix.summary)
    return (f'<p class="hint">{escape(matrix.model)} · workload {escape(matrix.workload)} · '
            f'highlighted and *: differs from {names[0]}</p>'
            f"<h3>Modules, forward pass: in → out</h3><table><thead><tr><th>module</th>"
            f"<th>type</th>{head}</tr></thead><tbody>{modules}</tbody></table>"
            f"<h3>Whole run</h3><table><thead><tr><th></th>{head}</tr></thead>"
            f"<tbody>{summary}</tbody></table>")


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "—"


def flops_body(reports: Sequence[FlopReport]) -> str:
    rows = []
    for r in reports:
        by_dtype = ", ".join(f"{dtype_span(d)} {_share(n, r.total)}"
                             for d, n in sorted(r.by_dtype.items(), key=lambda kv: -kv[1]))
        rows.append((escape(r.setting.name), f"{r.tokens:,}",
                     *(human(r.by_phase.get(p, 0)) for p in ("forward", "backward", "optimizer")),
                     human(r.total), human(r.total / r.tokens) if r.tokens else "—",
                     by_dtype or "—"))
    parts = [table(("setting", "tokens", "forward", "backward", "optimizer", "total",
                    "per token", "matmuls by dtype"), rows,
                   ("", "num", "num", "num", "num", "num", "num", ""))]
    for i, r in enumerate(reports):
        chart = flops_by_module_svg(r)
        conventions = table(
            ("convention", "FLOPs", "vs counted", "what it assumes"),
            [(escape(c.name), human(c.flops),
              f"{100 * (c.flops / r.total - 1):+.1f}%" if r.total else "—", escape(c.note))
             for c in r.conventions], ("", "num", "num", ""))
        parts.append(_details(
            f"{escape(r.setting.name)}: own FLOPs of each module, and the conventions",
            (f'<div class="plot">{chart}</div>' if chart else
             '<p class="hint">No op with a FLOP formula ran.</p>') + conventions,
            open_=i == 0))
    return "".join(parts)


def memory_body(reports: Sequence[MemoryReport]) -> str:
    rows = []
    for r in reports:
        p = r.peak
        where = (f"op {p.op} {escape(short_op(p.op_name or '?'))} in "
                 f"{escape(module_label(p.module))} ({escape(p.phase or '?')})"
                 if p.op is not None else "before the first op")
        rows.append((escape(r.setting), format_bytes(p.bytes), where,
                     format_bytes(r.before_bytes), format_bytes(r.end_bytes)))
    parts = [table(("setting", "peak", "where", "before the step", "after it"), rows,
                   ("", "num", "", "num", "num"))]
    for title, chart in (("Live at the peak, by category (colour) and dtype (hatching)",
                          memory_at_peak_svg(reports)),
                         ("Live bytes over the step", live_bytes_svg(reports))):
        if chart:
            parts.append(f'<h3>{title}</h3><div class="plot">{chart}</div>')
    for i, r in enumerate(reports):
        peak = {(row.category, row.dtype): row for row in r.at_peak}
        breakdown = table(("category", "dtype", "at peak", "allocated in the step"), [
            (escape(row.category.replace("_", " ")), dtype_span(row.dtype),
             format_bytes(peak[key].bytes) if (key := (row.category, row.dtype)) in peak else "—",
             format_bytes(row.bytes)) for row in r.allocated], ("", "", "num", "num"))
        estimates = table(("formula", "estimate", "counted", "note"), [
            (f"<b>{escape(e.label)}</b><br>{escape(e.formula)}", format_bytes(e.bytes),
             format_bytes(e.counted) + (f"<br>{escape(e.counted_label)}" if e.counted_label
                                        else ""), escape(e.note)) for e in r.estimates],
            ("", "num", "num", ""))
        notes = "".join(f'<p class="hint">{escape(n)}</p>' for n in r.notes)
        parts.append(_details(f"{escape(r.setting)}: by category and dtype, and the formulas",
                              breakdown + estimates + notes, open_=i == 0))
    return "".join(parts)


def numerics_body(report: NumericsReport) -> str:
    parts = [f'<p class="hint">{escape(report.model)} · workload {escape(report.workload)} · '
             f"each setting against {escape(report.reference)}: relative L2 error · SQNR</p>"]
    chart = divergence_by_depth_svg(report)
    if chart:
        parts.append(f'<div class="plot">{chart}</div>')
    if report.settings:
        first = report.settings[0]
        rows = [[escape(f"{b.container}.{b.index}")] + [
            divergence_text(s.blocks[i].divergence) if i < len(s.blocks) else "—"
            for s in report.settings] for i, b in enumerate(first.blocks)]
        roots = [next((m.divergence for m in s.modules if m.name == ""), None)
                 for s in report.settings]
        rows.append(["model output", *map(divergence_text, roots)])
        rows.append(["loss", *(divergence_text(s.loss) for s in report.settings)])
        parts.append(table(("where", *(s.setting for s in report.settings)), rows,
                           ("", *("num",) * len(report.settings))))
    over = report.fp16_overflows()
    if over:
        parts.append("<p><b>fp16 would overflow</b> (|x| &gt; 65504) in: " + ", ".join(
            f"{escape(r.name or '(model)')} ({escape(r.kind)}, amax {r.amax:.3g})"
            for r in over[:8]) + "</p>")
    flushed, total = report.fp16_gradient_underflow()
    if total:
        parts.append(f"<p>fp16 without loss scaling would flush {flushed:,} of {total:,} "
                     f"gradient values to zero ({100 * flushed / total:.2f}%).</p>")
    return "".join(parts)


# --- fragments and the page ------------------------------------------------------------------


def fragment(*parts: str) -> str:
    """A notebook cell's HTML: the styles travel with it (no <html> wrapper)."""
    return f'<div class="ampscope"><style>{CSS}</style>{"".join(parts)}</div>'


def trace_html(trace: Trace) -> str:
    return fragment(header([trace]), section("tensors", "Tensors by dtype", inventory_body(trace)),
                    section("findings", "Findings", findings_body([trace])),
                    section("flow", "Dtype flow", flow_body([trace])))


def matrix_html(matrix: Matrix) -> str:
    return fragment(section("matrix", "Settings matrix", matrix_body(matrix)))


def flops_html(report: FlopReport) -> str:
    return fragment(section("flops", "FLOPs by module", flops_body([report])))


def memory_html(report: MemoryReport) -> str:
    return fragment(section("memory", "Memory", memory_body([report])))


def numerics_html(report: NumericsReport) -> str:
    return fragment(section("numerics", "Numerics per layer", numerics_body(report)))


def report_html(traces: Sequence[Trace], matrix: Matrix, *,
                memory: Sequence[MemoryReport] = (), flops: Sequence[FlopReport] = (),
                numerics: NumericsReport | None = None, title: str | None = None) -> str:
    """The whole report as one HTML page that opens offline: the traces of one model and
    workload under several settings, their matrix, and optionally their memory and FLOP
    reports (one per trace) and a numerics report — each computed beforehand: this only
    renders. A section whose report is not given is left out."""
    if not traces:
        raise ValueError("a report needs at least one trace")
    sections = [("findings", "Findings", findings_body(traces)),
                ("flow", "Dtype flow", flow_body(traces)),
                ("matrix", "Settings matrix", matrix_body(matrix))]
    if memory:
        sections.append(("memory", "Memory", memory_body(memory)))
    if flops:
        sections.append(("flops", "FLOPs by module", flops_body(flops)))
    if numerics is not None:
        sections.append(("numerics", "Numerics per layer", numerics_body(numerics)))
    title = title or f"ampscope: {traces[0].model.name}, {traces[0].workload}"
    nav = "".join(f'<a href="#{key}">{escape(name)}</a>' for key, name, _ in sections)
    body = "".join(section(key, name, html) for key, name, html in sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}\nbody {{ margin: 24px 32px; }}</style>"
        f'</head><body><div class="ampscope"><h1>{escape(title)}</h1>{header(traces)}'
        f"<nav>{nav}</nav>{body}"
        '<p class="hint">Written by ampscope. Self-contained: this file loads nothing.</p>'
        "</div></body></html>\n"
    )
