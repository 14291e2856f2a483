"""Plots for the HTML report: matplotlib figures rendered to inline SVG strings, never through
pyplot (docs/report.md: the user's matplotlib is left alone). matplotlib is imported when a plot
is drawn, not with ampscope. Text stays text in the SVG (`svg.fonttype: none`): smaller,
searchable, and escaped by matplotlib's SVG writer like any XML text. The page carries the
`<svg>` element only, without the metadata and the URLs in it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

from ampscope.analysis.flops import FlopReport
from ampscope.analysis.memory import MemoryReport
from ampscope.analysis.numerics import NumericsReport
from ampscope.render.flops import human

# The terminal's dtype colours (render/style.py DTYPE_STYLES), as colours that read on white.
DTYPE_COLORS = {
    "float64": "#1f57a8", "float32": "#2e7d32", "bfloat16": "#00838f", "float16": "#ad1457",
    "float8_e4m3fn": "#c62828", "float8_e5m2": "#c62828",
}
INTEGER_COLOR = "#6d7177"
OTHER_COLOR = "#a56a00"

_PROLOG = re.compile(r"^.*?(?=<svg\b)", re.S)
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)
# matplotlib's `<style>*{stroke-linejoin: round; ...}</style>`: inline in HTML, a style element
# applies to the whole page, so it goes; the default line joins are fine.
_STYLE = re.compile(r"<style[^>]*>.*?</style>\s*", re.S)
# Namespace declarations: the HTML parser puts inline `<svg>` (and `xlink:href`) in the right
# namespaces by itself, and the page then holds no URL at all, not even one never fetched.
_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')


def dtype_color(dtype: str) -> str:
    if dtype in DTYPE_COLORS:
        return DTYPE_COLORS[dtype]
    return INTEGER_COLOR if dtype.startswith(("int", "uint", "bool")) else OTHER_COLOR


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def figure_svg(fig, key: str) -> str:
    """The figure as an `<svg>` element. `key` salts matplotlib's element ids, so two plots on
    one page do not share ids, and the same plot gives the same SVG every time."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    out = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": key}):
        FigureCanvasSVG(fig).print_svg(out, metadata={"Date": None})
    svg = _PROLOG.sub("", out.getvalue(), count=1)
    return _XMLNS.sub("", _STYLE.sub("", _METADATA.sub("", svg, count=1), count=1))


def _style(ax) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=8)
    ax.grid(axis="x", color="#e3e5e8", linewidth=0.8)
    ax.set_axisbelow(True)


def flops_by_module_svg(report: FlopReport, *, top: int = 20) -> str | None:
    """Horizontal bars: each module's own FLOPs over all its blocks, forward and backward
    stacked, coloured by the dtype its matmuls ran in; the `top` largest, largest first."""
    rows = sorted(report.rows, key=lambda r: -(r.forward + r.backward) * r.repeats)[:top]
    if not rows:
        return None
    rows.reverse()  # barh draws bottom-up
    labels = [r.name + (f"  ×{r.repeats}" if r.repeats > 1 else "") for r in rows]
    forward = [r.forward * r.repeats for r in rows]
    backward = [r.backward * r.repeats for r in rows]
    colors = [dtype_color(r.dtype) for r in rows]
    fig = _figure(7.6, 0.9 + 0.24 * len(rows))
    ax = fig.add_subplot()
    ax.barh(labels, forward, color=colors, label="forward")
    if any(backward):
        ax.barh(labels, backward, left=forward, color=colors, alpha=0.4, label="backward")
        ax.legend(fontsize=8, frameon=False, loc="lower right")
    ax.xaxis.set_major_formatter(lambda x, _pos: human(x))
    ax.set_xlabel("FLOPs (all blocks; bar colour: the dtype the matmuls ran in)", fontsize=8)
    _style(ax)
    return figure_svg(fig, f"flops-{report.setting.name}")


def divergence_by_depth_svg(report: NumericsReport) -> str | None:
    """Relative L2 error of each block's output against the reference, one line per setting
    (log scale; exact blocks, error 0, are left out)."""
    fig = _figure(7.6, 2.8)
    ax = fig.add_subplot()
    drawn = False
    for s in report.settings:
        points = [(b.index, b.divergence.rel_l2) for b in s.blocks if b.divergence.rel_l2 > 0]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=s.setting)
            drawn = True
    if not drawn:
        return None
    ax.set_yscale("log")
    ax.set_xlabel("block", fontsize=8)
    ax.set_ylabel(f"relative L2 error vs {report.reference}", fontsize=8)
    ax.legend(fontsize=8, frameon=False)
    _style(ax)
    ax.grid(axis="y", color="#e3e5e8", linewidth=0.8)
    return figure_svg(fig, f"numerics-{report.model}")


# Memory categories in their precedence order (records.STORAGE_CATEGORIES), one colour each;
# the dtype of a segment is its hatching.
CATEGORY_COLORS = {
    "parameter": "#4e79a7", "buffer": "#9c755f", "input": "#bab0ac", "gradient": "#f28e2b",
    "optimizer_state": "#e15759", "output": "#76b7b2", "autocast_cast": "#00838f",
    "fp8_cast": "#b07aa1", "fp8_scale": "#ff9da7", "activation": "#59a14f", "temporary": "#edc948",
}
# Line hatches only: dotted and circled ones are drawn as thousands of curves in SVG.
DTYPE_HATCHES = {"float32": "", "bfloat16": "///", "float16": "\\\\\\", "float64": "|||",
                 "float8_e4m3fn": "xxx", "float8_e5m2": "xxx"}
OTHER_HATCH = "---"  # integers and anything else
PHASE_COLORS = {"forward": "#59a14f", "backward": "#b07aa1", "optimizer": "#edc948"}


def _mib(n: float) -> float:
    return n / 2**20


def memory_at_peak_svg(reports: Sequence[MemoryReport]) -> str | None:
    """One horizontal bar per setting: the bytes live at its peak, stacked by category
    (colour) and dtype (hatching), in MiB."""
    if not any(r.at_peak for r in reports):
        return None
    from matplotlib.patches import Patch

    fig = _figure(7.6, 1.3 + 0.42 * len(reports))
    ax = fig.add_subplot()
    labels = [r.setting for r in reports][::-1]
    seen_categories: dict[str, None] = {}
    seen_dtypes: dict[str, None] = {}
    for y, report in enumerate(reversed(reports)):
        left = 0.0
        for row in report.at_peak:
            width = _mib(row.bytes)
            ax.barh(y, width, left=left, color=CATEGORY_COLORS.get(row.category, "#999"),
                    hatch=DTYPE_HATCHES.get(row.dtype, OTHER_HATCH), edgecolor="white", linewidth=0.6)
            left += width
            seen_categories[row.category] = None
            seen_dtypes[row.dtype] = None
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("MiB live at the peak", fontsize=8)
    handles = [Patch(color=CATEGORY_COLORS.get(c, "#999"), label=c.replace("_", " "))
               for c in seen_categories]
    handles += [Patch(facecolor="white", edgecolor="#555", hatch=DTYPE_HATCHES.get(d, OTHER_HATCH),
                      label=d) for d in seen_dtypes]
    fig.legend(handles=handles, loc="outside right upper", fontsize=7, frameon=False)
    _style(ax)
    return figure_svg(fig, "memory-at-peak")


def live_bytes_svg(reports: Sequence[MemoryReport]) -> str | None:
    """Live bytes after every op of the step, one panel per setting, the area under the line
    coloured by the phase of the ops (per timeline bucket); the peak is marked."""
    shown = [r for r in reports if r.live_bytes]
    if not shown:
        return None
    fig = _figure(7.6, 0.6 + 1.5 * len(shown))
    axes = fig.subplots(len(shown), 1, sharey=True, squeeze=False)[:, 0]
    for ax, report in zip(axes, shown, strict=True):
        live = [_mib(b) for b in report.live_bytes]
        # At most ~2000 points: each is the most bytes of its run of ops, so peaks survive.
        step = -(-len(live) // 2000)
        xs = range(0, len(live), step)
        ax.plot(xs, [max(live[x:x + step]) for x in xs], color="#1d2127", linewidth=0.8)
        for bucket in report.timeline:
            # Into the next bucket's first op, so neighbouring areas meet.
            span = range(bucket.first_op, min(bucket.last_op + 1, len(live) - 1) + 1, step)
            ax.fill_between(span, [live[x] for x in span],
                            color=PHASE_COLORS.get(bucket.phase, "#ccc"), alpha=0.5, linewidth=0)
        if report.peak.op is not None:
            ax.plot([report.peak.op], [live[report.peak.op]], "v", color="#c62828", markersize=5)
        ax.set_title(f"{report.setting}: peak {_mib(report.peak.bytes):.2f} MiB", fontsize=8,
                     loc="left")
        ax.set_ylabel("MiB", fontsize=8)
        ax.set_xlim(0, max(len(live) - 1, 1))
        _style(ax)
    axes[-1].set_xlabel("op", fontsize=8)
    phases = dict.fromkeys(b.phase for r in shown for b in r.timeline)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=PHASE_COLORS.get(p, "#ccc"), alpha=0.5, label=p)
                        for p in phases], loc="outside right upper", fontsize=7, frameon=False)
    return figure_svg(fig, "memory-live-bytes")
