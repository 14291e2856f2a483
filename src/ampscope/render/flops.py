"""`ampscope flops`: FLOPs by phase, dtype and module, the conventions, the step predicted on
a GPU (render/predicted_step.py draws it), and MFU.

Namesakes, the same concern at another layer: `analysis/flops.py`, `runs/flops.py`,
`torchcompat/flops.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.analysis.flops import FlopReport
from ampscope.render.predicted_step import predicted_section
from ampscope.render.style import ColumnOptions, dtype_text, titled_table


def human(flops: float, unit: str = "FLOP") -> str:
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(flops) >= size:
            return f"{flops / size:.2f} {prefix}{unit}"
    return f"{flops:.0f} {unit}"


def share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "—"


def render_flops(report: FlopReport) -> RenderableType:
    used = report.utilization
    s = report.setting
    where = s.device + (" (emulated)" if s.emulated else "")
    head = Text()
    head.append(report.model, style="bold")
    head.append(f"  setting {s.name} on {where}  workload {report.workload}  "
                f"{report.tokens:,} tokens  ")
    if report.mode == "predict":
        head.append("predicted  ", style="bold magenta")
    head.append(human(report.total), style="bold")
    head.append(f" counted ({human(report.total / report.tokens) if report.tokens else '—'} "
                "per token)")

    phases = titled_table("By phase", "phase", "FLOPs", "share", right=("FLOPs", "share"))
    for phase, n in report.by_phase.items():
        phases.add_row(phase, human(n), share(n, report.total))
    if report.evaluation:  # not the step's: no share of it
        phases.add_row("evaluation (not in the step)", human(report.evaluation), "—")

    numbers = ("FLOPs", "share", "peak", "time at peak")
    dtypes = titled_table("By the dtype the matmuls ran in", "dtype", *numbers, right=numbers)
    for dtype, n in sorted(report.by_dtype.items(), key=lambda kv: -kv[1]):
        peak = used.peaks.get(dtype) if used else None
        dtypes.add_row(dtype_text([dtype], short=False), human(n), share(n, report.total),
                       human(peak, "FLOP/s") if peak else "n/a",
                       f"{1e3 * n / peak:.1f} ms" if peak else "n/a")

    counts = ("×", "forward", "backward")
    modules = titled_table("By module (own ops, per block)", *(
        (col, ColumnOptions(overflow="fold")) for col in ("module", *counts, "dtype")), right=counts)
    for r in report.rows:
        modules.add_row(r.name, str(r.repeats), human(r.forward), human(r.backward),
                        dtype_text([r.dtype], short=False))

    conv = titled_table("Conventions", "convention", "FLOPs", "vs counted", "what it assumes",
                        right=("FLOPs", "vs counted"))
    for c in report.conventions:
        conv.add_row(c.name, human(c.flops),
                     f"{100 * (c.flops / report.total - 1):+.1f}%" if report.total else "—",
                     Text(c.note, style="dim"))

    parts: list[RenderableType] = [head, Text(), phases, Text(), dtypes, Text(), modules, Text(),
                                   conv]
    if report.predicted is not None:
        parts += [Text(), predicted_section(report.predicted,
                                            used.seconds if used is not None else None)]
    if used is not None:
        line = Text("\nThroughput  ", style="italic")
        line.append(f"step {used.seconds * 1e3:.1f} ms, {used.tokens_per_second:,.0f} tokens/s, "
                    f"{human(used.flops_per_second, 'FLOP/s')} counted")
        line.append("\nMFU         ", style="italic")
        if used.mfu is not None:
            line.append(f"{100 * used.mfu:.1f}%", style="bold")
            line.append(f" of {used.device}'s peak for the dtype each matmul ran in "
                        "(counted FLOPs, full attention)")
        else:
            line.append("n/a", style="bold")
            line.append(f" ({'no peak FLOP/s known for ' + used.device if used.device else 'no accelerator named: --gpu NAME'})")
        parts.append(line)
    return Group(*parts)
