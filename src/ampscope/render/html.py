"""HTML: the self-contained report page (`ampscope report`, and `--report PATH` of `run` and
`trace`, with a Ranks section for a distributed run) and the notebook fragments (`_repr_html_`
of Trace, Matrix and every report of render/report_kinds.py with a section), from the same section
templates (render/templates/, rendered with autoescaping on); the functions here only gather
what each section shows. Why the page loads nothing and what is escaped: docs/report.md
("Self-contained and safe to open").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from markupsafe import Markup

from ampscope.analysis.compare import Matrix
from ampscope.analysis.diagram import build_diagram
from ampscope.analysis.flops import FlopReport
from ampscope.analysis.memory import MemoryReport
from ampscope.analysis.numerics import NumericsReport, compare_fp8_casts
from ampscope.analysis.summary import dtype_inventory
from ampscope.distributed.report import DistributedReport, summarize
from ampscope.records import STORAGE_CATEGORIES, Trace
from ampscope.render.flowgraph import section_svg
from ampscope.render.matrix import short_names
from ampscope.render.numerics import depth_rows, distinct_names
from ampscope.render.plots import (
    divergence_by_depth_svg,
    flops_by_module_svg,
    live_bytes_svg,
    memory_at_peak_svg,
)
from ampscope.render.ranks import HELD_CATEGORIES
from ampscope.render.report_kinds import REPORTS, kind_of
from ampscope.render.templating import environment, macros

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
.ampscope b.error {{ color: #b3261e; }} .ampscope b.warning {{ color: #a15c00; }}
.ampscope b.note {{ color: #1a6fa8; }}
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
.ampscope td.rank {{ text-align: right; font-weight: 600; }}
.ampscope tr.rank-total td {{ font-weight: 600; }}
"""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _sections():
    return macros("sections.html.j2")


# --- sections --------------------------------------------------------------------------------


def header(traces: Sequence[Trace]) -> Markup:
    """Model, workload, the settings and where they ran, and what the runs assumed."""
    notes = list(dict.fromkeys(n for t in traces for n in t.notes))
    return _sections().header(traces, notes)


def _checked(traces: Sequence[Trace]) -> list[tuple[str, str, Markup]]:
    """The Check section, where a trace has diagnostics (what render/diagnostics.py prints):
    what is wrong comes first."""
    if not any(t.diagnostics for t in traces):
        return []
    return [("check", "Check", _sections().diagnostics(traces))]


def flow_body(traces: Sequence[Trace]) -> Markup:
    diagrams = [build_diagram(t) for t in traces]
    columns = [{"title": t.setting.name, "diagram": g, "sections": [
        {"block": s.block, "label": s.label, "steps": len(s.steps),
         "svg": section_svg(s, last=i == len(g.sections) - 1)}
        for i, s in enumerate(g.sections)]} for t, g in zip(traces, diagrams, strict=True)]
    seen = dict.fromkeys(d for g in diagrams for s in g.sections for step in s.steps
                         for d in (*step.inputs, step.output))
    return _sections().flow(columns, list(seen))


def matrix_body(matrix: Matrix) -> Markup:
    labels = short_names([(r.name, r.depth) for r in matrix.rows])
    return _sections().matrix(matrix, labels)


def _svg(svg: str | None) -> Markup | None:
    """A matplotlib SVG (render/plots.py), whose text matplotlib escapes as XML."""
    return Markup(svg) if svg else None


def flops_body(reports: Sequence[FlopReport]) -> Markup:
    return _sections().flops(reports, [_svg(flops_by_module_svg(r)) for r in reports])


def memory_body(reports: Sequence[MemoryReport]) -> Markup:
    charts = [("Live at the peak, by category (colour) and dtype (hatching)",
               _svg(memory_at_peak_svg(reports))),
              ("Live bytes over the step", _svg(live_bytes_svg(reports)))]
    breakdowns = []
    for r in reports:
        peak = {(row.category, row.dtype): row for row in r.at_peak}
        breakdowns.append([(row, peak.get((row.category, row.dtype))) for row in r.allocated])
    return _sections().memory(reports, charts, breakdowns)


def numerics_body(reports: Sequence[NumericsReport]) -> Markup:
    return Markup().join(map(_numerics, reports))


def _numerics(report: NumericsReport) -> Markup:
    rows = depth_rows(report) if report.settings else []
    columns = ("where", *(s.setting for s in report.settings))
    fp8 = compare_fp8_casts(report)
    fp8_names = distinct_names([t.setting for t in fp8.totals]) if fp8 else []
    return _sections().numerics(report, _svg(divergence_by_depth_svg(report)), columns, rows,
                                report.fp16_overflows()[:8], report.fp16_gradient_underflow(),
                                fp8, fp8_names)


def _rank_rows(report: DistributedReport, same_as: Mapping[int, int | None] | None
               ) -> list[dict]:
    """One row per rank that ran, in rank order, and one per run of consecutive ranks that did
    not (a predicted job runs ranks 0 and N-1 of up to 4096): `same_as` the run rank they are
    taken to be, None where not known. Ranks of the world neither ran nor in `same_as` (rank 0
    of N predicted by `trace --distributed --predict`) are not known."""
    ran = {r.rank: r for r in report.ranks}
    rows: list[dict] = []
    for k in range(max(report.parallel.world_size, max(ran, default=-1) + 1)):
        r = ran.get(k)
        if r is None:
            taken = (same_as or {}).get(k)
            if rows and rows[-1]["report"] is None and rows[-1]["same_as"] == taken:
                rows[-1]["last"] = k
            else:
                rows.append({"first": k, "last": k, "report": None, "same_as": taken,
                             "peak": None})
            continue
        live = r.peak.live if r.peak is not None else {}
        rows.append({"first": k, "last": k, "report": r, "total": r.held_total,
                     "held": [sorted(r.held.get(c, {}).items()) for c in HELD_CATEGORIES],
                     "collectives": summarize(r.collectives), "peak": r.peak,
                     "live": {c: sorted(d.items()) for c, d in live.items()}})
    return rows


def ranks_body(report: DistributedReport,
               same_as: Mapping[int, int | None] | None = None) -> Markup:
    """Each rank of a DDP or FSDP2 job: what it holds by category and dtype, its collectives
    by kind, phase and dtype, and its memory peak where the report has one."""
    rows = _rank_rows(report, same_as)
    order = {str(c): i for i, c in enumerate(STORAGE_CATEGORIES)}  # the memory report's order
    categories = sorted(dict.fromkeys(c for row in rows for c in row.get("live", {})),
                        key=lambda c: order.get(c, len(order)))
    policy = {k: v for k, v in report.parallel.policy_dict().items() if v}
    strategy = (report.parallel.strategy if any(r.collectives for r in report.ranks)
                else "none")
    return _sections().ranks(report, rows, strategy, policy, categories)


# --- fragments and the page ------------------------------------------------------------------


def section(key: str, title: str, body: Markup) -> Markup:
    return _sections().section(key, title, body)


def fragment(*parts: Markup) -> str:
    """A notebook cell's HTML: the styles travel with it (no <html> wrapper)."""
    return environment().get_template("fragment.html.j2").render(css=Markup(CSS), parts=parts)


def trace_html(trace: Trace) -> str:
    checked = [section(*c) for c in _checked([trace])]
    return fragment(header([trace]), *checked,
                    section("tensors", "Tensors by dtype",
                            _sections().inventory(dtype_inventory(trace))),
                    section("findings", "Findings", _sections().findings([trace])),
                    section("flow", "Dtype flow", flow_body([trace])))


def matrix_html(matrix: Matrix) -> str:
    return fragment(section("matrix", "Settings matrix", matrix_body(matrix)))


def section_html(report: object) -> str:
    """A registered report's notebook view: its section of the HTML report (render/report_kinds.py)."""
    kind = kind_of(report)
    return fragment(section(kind.name, kind.section or kind.name, kind.load("body")([report])))


def ranks_html(report: DistributedReport,
               same_as: Mapping[int, int | None] | None = None) -> str:
    return fragment(section("ranks", "Ranks", ranks_body(report, same_as)))


def report_html(traces: Sequence[Trace], matrix: Matrix, *, reports: Sequence[object] = (),
                title: str | None = None,
                distributed: DistributedReport | None = None,
                same_as: Mapping[int, int | None] | None = None) -> str:
    """The whole report as one HTML page that opens offline: the traces of one model and
    workload under several settings, their matrix, and optionally `reports` (memory and FLOPs
    one per trace, numerics, any registered report with a section: one section a kind, in the
    order of render/report_kinds.py) and the distributed report of a DDP or FSDP2 job (with
    `same_as`, the run rank each rank that did not run is taken to be, None where not known) —
    each computed beforehand: this only renders. A section whose report is not given is left
    out."""
    if not traces:
        raise ValueError("a report needs at least one trace")
    sections = [*_checked(traces), ("findings", "Findings", _sections().findings(traces)),
                ("flow", "Dtype flow", flow_body(traces)),
                ("matrix", "Settings matrix", matrix_body(matrix))]
    for kind in REPORTS.values():
        mine = [r for r in reports if kind_of(r) is kind]
        if mine and kind.section:
            sections.append((kind.name, kind.section, kind.load("body")(mine)))
    if distributed is not None:
        sections.append(("ranks", "Ranks", ranks_body(distributed, same_as)))
    return environment().get_template("page.html.j2").render(
        title=title or f"ampscope: {traces[0].model.name}, {traces[0].workload}",
        css=Markup(CSS), csp=Markup(CSP), header=header(traces), sections=sections)
