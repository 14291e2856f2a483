"""`ampscope numerics`: divergence from the reference by depth, gradients, and ranges.

Namesakes, the same concern at another layer: `analysis/numerics.py`."""

from __future__ import annotations

import math
import statistics

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.analysis.numerics import (
    Divergence,
    Fp8Comparison,
    NumericsReport,
    compare_fp8_casts,
)
from ampscope.records.fp8 import short_fp8
from ampscope.render.style import ColumnOptions, titled_table


def _err(d: Divergence | None) -> str:
    if d is None:
        return "—"
    if d.exact:
        return "0 (exact)"
    sqnr = "∞" if math.isinf(d.sqnr_db) else f"{d.sqnr_db:.0f} dB"
    return f"{d.rel_l2:.2e} · {sqnr}"


def render_numerics(report: NumericsReport, *, all_modules: bool = False) -> RenderableType:
    head = Text()
    head.append(report.model, style="bold")
    head.append(f"  workload {report.workload}  reference {report.reference}  "
                "(relative L2 error · SQNR against the reference)")
    if report.emulated:
        head.append(f"\n  emulated: {', '.join(report.emulated)} (the device's autocast "
                    "dtypes, the CPU's kernels and rounding)", style="dim")
    settings = [s.setting for s in report.settings]
    depth = titled_table("Divergence by depth", "where", *settings, right=settings)
    for row in depth_rows(report):
        depth.add_row(*row)
    parts: list[RenderableType] = [head, Text(), depth]

    if all_modules:
        table = titled_table("Every module", ("module", {"overflow": "fold"}), "type", *settings,
                             right=settings)
        by_setting = [{m.name: m.divergence for m in s.modules} for s in report.settings]
        for m in report.settings[0].modules:
            table.add_row(m.name or "(model)", m.type, *(_err(d.get(m.name)) for d in by_setting))
        parts += [Text(), table]

    if any(s.grads for s in report.settings):
        grads = titled_table("Gradients", "setting", "median rel. L2", "worst", "worst parameter",
                             right=("median rel. L2", "worst"))
        for s in report.settings:
            errors = sorted(s.grads, key=lambda g: g[1].rel_l2)
            if errors:
                name, worst = errors[-1]
                grads.add_row(s.setting, f"{statistics.median(d.rel_l2 for _, d in errors):.2e}",
                              f"{worst.rel_l2:.2e}", name)
        parts += [Text(), grads]

    if (fp8 := compare_fp8_casts(report)) is not None:
        parts += [Text(), _fp8_casts(fp8)]
    parts += [Text(), _ranges(report)]
    return Group(*parts)


def depth_rows(report: NumericsReport) -> list[list[str]]:
    """Divergence by depth, as the terminal and the HTML report show it: a row for each block
    of the first setting, then the model output and the loss; each the place, then every
    setting's error."""
    rows = [[f"{b.container}.{b.index}", *(_err(s.blocks[i].divergence) if i < len(s.blocks)
                                          else "—" for s in report.settings)]
            for i, b in enumerate(report.settings[0].blocks)]
    roots = [next((m.divergence for m in s.modules if m.name == ""), None)
             for s in report.settings]
    return [*rows, ["model output", *map(_err, roots)],
            ["loss", *(_err(s.loss) for s in report.settings)]]


def distinct_names(names: list[str]) -> list[str]:
    """The settings' names without the parts they share ("fp32+amp-bf16+fp8-tensorwise",
    "fp32+amp-bf16+fp8-rowwise" → "fp8-tensorwise", "fp8-rowwise"): narrow columns."""
    parts = [n.split("+") for n in names]
    shared = 0
    while len(names) > 1 and all(len(p) > shared + 1 and p[shared] == parts[0][shared]
                                 for p in parts):
        shared += 1
    return ["+".join(p[shared:]) for p in parts]


def _fp8_casts(fp8: Fp8Comparison) -> RenderableType:
    """Each fp8 setting's casts side by side: what saturated and what underflowed at the scale
    its recipe used, the layers that lost most first."""
    text = Text("fp8 casts at the scales each recipe used: share of non-zero values that "
                "saturate (clamped to the format's max) and that underflow (to 0)\n",
                style="italic")
    for t in fp8.totals:
        text.append(f"  {t.setting}: {t.casts:,} casts ({'/'.join(t.granularities)} "
                    f"scales), {t.saturated:,} of {t.nonzero:,} values saturate "
                    f"({100 * t.saturated_share:.3f}%), {t.underflow:,} underflow "
                    f"({100 * t.underflow_share:.3f}%)\n")
    if not fp8.lossy:
        text.append("  No cast saturated or underflowed a value.\n")
        return text
    names = distinct_names([t.setting for t in fp8.totals])
    table = titled_table(f"Casts that lost values ({len(fp8.lossy)} of {fp8.operands} by layer "
                         "and operand; format saturated/underflow)",
                         ("layer", {"overflow": "fold"}), "phase", "operand",
                         *((name, ColumnOptions(overflow="fold")) for name in names), right=names)
    for row in fp8.lossy:
        cells = ["—" if c is None else
                 f"{short_fp8(c.dtype)} {100 * c.saturated_share:.2f}%/"
                 f"{100 * c.underflow_share:.2f}%" for c in row.casts]
        table.add_row(row.module or "(model)", row.phase, row.role, *cells)
    return Group(text, table)


def _ranges(report: NumericsReport) -> RenderableType:
    text = Text(f"Range of the {report.reference} run's values\n", style="italic")
    over = report.fp16_overflows()
    if over:
        text.append("  fp16 would overflow (|x| > 65504) in: ", style="bold red")
        text.append(", ".join(f"{r.name} ({r.kind}, amax {r.amax:.3g})" for r in over[:8]) + "\n")
    else:
        largest = max((r for r in report.ranges if r.kind != "weight"), key=lambda r: r.amax,
                      default=None)
        if largest is not None:
            text.append(f"  No activation or gradient exceeds fp16's max; the largest is "
                        f"{largest.amax:.3g} ({largest.kind} {largest.name or '(model)'}).\n")
    flushed, total = report.fp16_gradient_underflow()
    if total:
        text.append(f"  fp16 without loss scaling would flush {flushed:,} of {total:,} gradient "
                    f"values to zero ({100 * flushed / total:.2f}%).\n")
    numbers = ("amax", "fp16 ovf", "fp16 ftz", "fp16 subn", "e4m3 ovf", "e5m2 ovf", "e5m2 ftz")
    table = titled_table("Largest magnitudes", "tensor", "kind", *numbers, right=numbers)
    for r in sorted(report.ranges, key=lambda r: -r.amax)[:8]:
        f = r.formats
        table.add_row(r.name or "(model)", r.kind, f"{r.amax:.3g}",
                      *(f"{100 * v:.2f}%" for v in (
                          f["float16"].overflow, f["float16"].flush_to_zero, f["float16"].subnormal,
                          f["float8_e4m3fn"].overflow, f["float8_e5m2"].overflow,
                          f["float8_e5m2"].flush_to_zero)))
    return Group(text, table)
