"""`ampscope fit`: each probe as it runs, then the limit, what fills it, and what buys room.

Namesakes, the same concern at another layer: `analysis/fit.py`, `api/fit.py`, `cli/fit.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.analysis.fit import FitReport, Probe
from ampscope.render.predicted_step import duration
from ampscope.render.style import format_bytes, titled_table


def probe_line(probe: Probe) -> Text:
    """One predicted run: `batch 4  seq 64  peak 1.2 MiB  reserved 2 MiB  fits: yes` (the
    reserved peak on CUDA, the one held to the budget; and the variant tried)."""
    reserved = (f"  reserved {format_bytes(probe.reserved_bytes):>9}"
                if probe.reserved_bytes is not None else "")
    text = Text(f"  batch {probe.batch:>4}  seq {probe.seq:>5}  peak "
                f"{format_bytes(probe.peak_bytes):>9}{reserved}  fits: ")
    text.append("yes" if probe.fits else "no ", style="green" if probe.fits else "red")
    if probe.variant != "as given":
        text.append(f"  {probe.variant}", style="dim")
    return text


def render_fit(report: FitReport) -> RenderableType:
    where = report.accelerator or "--memory"
    head = Text()
    if report.at_batch_limit:  # not the answer: only where the search stopped (see the note)
        head.append(f"Every micro-batch up to {report.batch:,} fits", style="bold")
    else:
        head.append(f"Largest micro-batch: {report.batch}", style="bold")
    head.append(f" at seq {report.seq}" + (" (the longest power of two that fits)"
                                           if report.seq_auto else ""))
    # The peaks at the answer, and the margin left under the budget by the one held to it.
    peaks = f"predicted peak {format_bytes(report.peak_bytes)} allocated"
    if report.reserved_bytes is not None:
        peaks += (f", {format_bytes(report.reserved_bytes)} reserved by the caching allocator "
                  "(the peak held to the budget)")
    head.append(f" for {report.model} under {report.setting}, train step with "
                f"{report.optimizer}: {peaks}: {format_bytes(report.margin_bytes)} under the "
                f"{format_bytes(report.memory_bytes)} budget ({where}), in the "
                f"{report.peak_phase} pass, {len(report.probes)} predicted runs.")
    parts: list[RenderableType] = [head]
    if report.step_seconds is not None:  # not with only --memory
        mfu = f"MFU {100 * report.mfu:.0f}%" if report.mfu is not None else "MFU n/a"
        parts.append(Text(f"At batch {report.batch:,}: predicted step "
                          f"{duration(report.step_seconds)} on {report.accelerator}, "
                          f"{report.tokens_per_second or 0:,.0f} tokens/s, {mfu}, "
                          f"{report.bound}-bound."))
    shares = titled_table(None, "what", "bytes", "share", right=("bytes", "share"))
    for s in report.at_limit:
        shares.add_row(s.label, format_bytes(s.bytes), f"{s.fraction:.0%}")
    title = Text(f"At the limit (batch {report.batch}): what is live at the peak",
                 style="italic")
    parts += [Text(""), title, shares]
    if report.variants:
        held = "reserved" if report.held == "reserved" else "peak"
        numbers = (f"{held} at {report.batch}", "saved", "largest batch", f"its {held}")
        room = titled_table(None, "change", "how", *numbers, right=numbers, no_wrap=True)
        for v in report.variants:
            room.add_row(v.name, v.change, format_bytes(v.peak_at_limit),
                         format_bytes(v.saved_bytes), str(v.batch) if v.batch else "none",
                         format_bytes(v.peak_bytes))
        parts += [Text(""), Text("What would buy room (each a predicted run, not a rule of "
                                 "thumb)", style="italic"), room]
    for note in report.notes:
        parts.append(Text(note, style="dim"))
    return Group(*parts)
