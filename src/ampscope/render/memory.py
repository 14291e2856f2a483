"""Terminal rendering of a `MemoryReport`: the peak, bytes by category and dtype, the formulas
beside the counts, and the live bytes over the step as one line of blocks.

Namesakes, the same concern at another layer: `analysis/memory.py`, `runs/memory.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.memory import MemoryReport, MemoryRow
from ampscope.hardware.cuda_allocator import AllocatorReplay
from ampscope.records import module_label
from ampscope.render.style import dtype_text, format_bytes, short_op, titled_table

_BLOCKS = "▁▂▃▄▅▆▇█"
_PHASE_STYLES = {"forward": "green", "backward": "magenta", "optimizer": "yellow"}


def peak_line(report: MemoryReport) -> Text:
    p = report.peak
    text = Text()
    text.append("Peak ", style="bold")
    text.append(format_bytes(p.bytes), style="bold")
    text.append(f" ({p.bytes:,} B)")
    if p.op is not None:
        text.append(f" at op {p.op} {short_op(p.op_name or '?')}, {p.phase}")
        if p.module is not None:
            text.append(f", in {module_label(p.module)}")
    if p.rounded_bytes is not None:
        text.append(f"; in the CUDA allocator's 512-byte blocks {format_bytes(p.rounded_bytes)}")
        if p.rounded_op != p.op:
            text.append(f" (at op {p.rounded_op})")
    if report.reserved is not None:
        text.append("\n")
        text.append(reserved_text(report.reserved))
    text.append(f"\nBefore the step {format_bytes(report.before_bytes)}, "
                f"after it {format_bytes(report.end_bytes)}", style="dim")
    return text


def reserved_text(r: AllocatorReplay) -> Text:
    """The caching allocator replay's reserved peak beside the allocated one, and what the
    reserved bytes held beyond the requests where they peaked."""
    allocated = r.allocated_peak
    gap = f", {100 * (r.reserved_peak - allocated) / allocated:+.1f}%" if allocated else ""
    text = Text("Reserved (allocator replay", style="bold")
    text.append(", expandable segments" if r.config.expandable_segments else "", style="bold")
    text.append(f") {format_bytes(r.reserved_peak)}", style="bold")
    at = "before the step" if r.reserved_at is None else f"at op {r.reserved_at}"
    text.append(f" beside allocated {format_bytes(allocated)}{gap}; {at}: rounding "
                f"{format_bytes(r.rounding)}, segment tails {format_bytes(r.segments)}, "
                f"fragmentation {format_bytes(r.fragmentation)}")
    if r.other_streams:
        text.append(f" ({format_bytes(r.other_streams)} on other streams)")
    return text


def breakdown_table(report: MemoryReport) -> Table:
    """Category × dtype: what is live at the peak beside everything the step allocated."""
    numbers = ("at peak", "storages", "allocated", "storages ")
    table = titled_table("Memory by category and dtype", "category", "dtype", *numbers,
                         right=numbers)
    peak: dict[tuple[str, str], MemoryRow] = {(r.category, r.dtype): r for r in report.at_peak}
    for r in report.allocated:
        p = peak.get((r.category, r.dtype))
        table.add_row(r.category.replace("_", " "), dtype_text([r.dtype], short=False),
                      format_bytes(p.bytes) if p else "—", str(p.count) if p else "—",
                      format_bytes(r.bytes), str(r.count))
    table.add_row(Text("total", style="bold"), "",
                  Text(format_bytes(sum(r.bytes for r in report.at_peak)), style="bold"),
                  str(sum(r.count for r in report.at_peak)),
                  format_bytes(sum(r.bytes for r in report.allocated)),
                  str(sum(r.count for r in report.allocated)))
    return table


def estimates_table(report: MemoryReport) -> Table:
    table = titled_table("Formulas beside the counted bytes",
                         ("formula", {"overflow": "fold", "ratio": 3}), "estimate",
                         ("counted", {"ratio": 1}),
                         ("note", {"style": "dim", "overflow": "fold", "ratio": 3}),
                         right=("estimate", "counted"))
    for e in report.estimates:
        label = Text(e.label, style="bold")
        label.append("\n" + e.formula, style="")
        counted = Text(format_bytes(e.counted))
        if e.counted_label:
            counted.append("\n" + e.counted_label, style="dim")
        table.add_row(label, format_bytes(e.bytes), counted, e.note)
    return table


def timeline_text(report: MemoryReport) -> Text:
    """One block per bucket of ops, its height the most bytes live in it, its colour the
    phase there; the peak bucket is marked below."""
    buckets = report.timeline
    text = Text("Live bytes over the step\n", style="italic")
    if not buckets:
        return text.append("  (no ops)\n", style="dim")
    top = max(b.bytes for b in buckets) or 1
    low = min(b.bytes for b in buckets)
    span = max(top - low, 1)
    text.append("  ")
    for b in buckets:
        level = round((b.bytes - low) / span * (len(_BLOCKS) - 1))
        text.append(_BLOCKS[level], style=_PHASE_STYLES.get(b.phase, ""))
    text.append(f"  {format_bytes(low)} … {format_bytes(top)}\n", style="dim")
    at = next((i for i, b in enumerate(buckets) if b.first_op <= (report.peak.op or 0) <= b.last_op), 0)
    text.append("  " + " " * at + "^ peak", style="bold")
    text.append(f"   ops 0–{buckets[-1].last_op}, {buckets[0].last_op - buckets[0].first_op + 1} "
                "per block;  ", style="dim")
    for phase, style in _PHASE_STYLES.items():
        if any(b.phase == phase for b in buckets):
            text.append(phase + " ", style=style)
    return text.append("\n")


def largest_table(report: MemoryReport) -> Table:
    table = titled_table("Largest storages live at the peak", "bytes", "category", "dtype",
                         "shape", ("what", {"overflow": "fold"}), right=("bytes",))
    for s in report.largest_at_peak:
        what = ", ".join(s.names) if s.names else (
            short_op(s.op or "?") + (f" in {module_label(s.module)}" if s.module is not None else "")
            + f", {s.phase}")
        table.add_row(format_bytes(s.nbytes), s.category.replace("_", " "),
                      dtype_text([s.dtype], short=False), "×".join(map(str, s.shape)) or "()",
                      what)
    return table


def render_memory(report: MemoryReport) -> RenderableType:
    how = [w for w, on in (("emulated", report.emulated), ("predicted", report.mode == "predict"))
           if on]
    where = report.device + (f" ({', '.join(how)})" if how else "")
    parts: list[RenderableType] = [
        Text.assemble(("Memory ", "bold"), f"of {report.model}, {report.setting} on {where}, "
                      f"{report.workload} workload"),
        peak_line(report), Text(), breakdown_table(report), Text(), timeline_text(report),
        largest_table(report), Text(), estimates_table(report),
    ]
    if report.shared:
        shared = Text("Shared storages, counted once\n", style="italic")
        for s in report.shared:
            shared.append(f"  {' = '.join(s.names)}: {format_bytes(s.bytes)} {s.dtype}\n")
        parts += [Text(), shared]
    for note in report.notes:
        parts.append(Text(note, style="dim"))
    if report.measured is not None:
        m = report.measured
        predicted = report.peak.rounded_bytes or report.peak.bytes
        parts += [Text(), Text(f"Measured on {m.device} ({m.source}): peak "
                               f"{m.max_memory_allocated:,} B; predicted {predicted:,} B "
                               f"({predicted - m.max_memory_allocated:+,} B, "
                               f"{100 * m.error(predicted):+.3f}%)")]
    return Group(*parts)
