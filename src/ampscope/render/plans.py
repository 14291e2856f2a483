"""`ampscope fit --gpus N`: the plans searched, best first, and the answer in one line.

Namesakes, the same concern at another layer: `analysis/plans.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.analysis.plans import PlansReport
from ampscope.render.style import format_bytes, titled_table


def render_plans(report: PlansReport) -> RenderableType:
    budget = format_bytes(report.memory_bytes)
    where = report.accelerator or "--memory"
    head = Text()
    best = report.best
    if best is not None:
        if best.at_batch_limit:  # not its largest batch: where the search stopped (the note)
            head.append(f"Best plan: {best.name}, every micro-batch up to {best.batch:,} fits",
                        style="bold")
            head.append(f" — at least {best.tokens:,} tokens per step, "
                        f"{format_bytes(best.peak_bytes)} of {budget} per rank at "
                        f"{best.batch:,}, its peak in the {best.phase} pass.")
        else:
            head.append(f"Best plan: {best.name}, micro-batch {best.batch:,}", style="bold")
            head.append(f" — {best.tokens:,} tokens per step, {format_bytes(best.peak_bytes)} "
                        f"of {budget} per rank, its peak in the {best.phase} pass.")
    else:
        head.append("No plan fits", style="bold")
        head.append(f" in {budget} per rank.")
    policy = ", ".join(f"{k}={v}" for k, v in report.mp_policy.items() if v) or "none"
    context = Text(f"{report.model} ({report.depth} blocks) on {report.gpus} GPUs of {budget} "
                   f"({where}) · {report.setting} · FSDP2 mixed precision: {policy} · seq "
                   f"{report.seq:,} · {report.optimizer}", style="dim")
    numbers = ("batch", "tokens/step", "peak/rank", "room")
    table = titled_table(None, "plan", *numbers, right=numbers, no_wrap=True)
    for p in report.plans:
        room = report.memory_bytes - p.peak_bytes
        at_least = "≥ " if p.at_batch_limit else ""
        table.add_row(
            p.name, f"{at_least}{p.batch:,}" if p.fits else f"{p.searched_from}",
            f"{at_least}{p.tokens:,}" if p.fits else "—",
            format_bytes(p.peak_bytes),
            format_bytes(room) if room >= 0 else f"{format_bytes(-room)} over",
            style=None if p.fits else "dim")
    depths = report.probe_depths
    at = (f"at its {report.depth} blocks" if depths == [report.depth]
          else f"at {' and '.join(map(str, depths or [2, 3]))} blocks")
    extended = "" if depths == [report.depth] else "the full depth and "
    how = Text(
        f"Each plan's rank 0 was traced on fake tensors and PyTorch's fake process group {at}, "
        "at micro-batch 2, and 3 where 2 fits (1 where 2 does not and could win); its peak at "
        f"{extended}every micro-batch follows by exact rules (docs/fit.md).", style="dim")
    took = Text(f"Searched in {report.seconds:.1f} s.", style="dim")
    parts: list[RenderableType] = [head, context, Text(""), table, Text(""), how, took]
    if any(not p.fits and p.searched_from > 1 for p in report.plans):
        parts.append(Text("A plan that does not fit at micro-batch 2 was not traced at 1: its "
                          "dp × seq tokens at batch 1 are no more than the best plan's.",
                          style="dim"))
    limited = [p.name for p in report.plans if p.at_batch_limit]
    if limited:
        parts.append(Text(
            f"{', '.join(limited)}: every micro-batch up to {report.batch_limit:,} fits in "
            f"{budget} per rank (≥ in the table); the search derives no larger batch, as no "
            "probe ran near one.", style="dim"))
    parts += [Text(note, style="dim") for note in report.notes]
    return Group(*parts)
