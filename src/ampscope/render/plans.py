"""`ampscope fit --gpus N`: the plans searched, best first, and the answer in one line.

Namesakes, the same concern at another layer: `analysis/plans.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.plans import Plan, PlansReport
from ampscope.render.predicted_step import duration
from ampscope.render.style import format_bytes, titled_table

# The table's word for a bound, short enough for 100 columns.
_BOUND = {"communication": "comms"}


def _speed(p) -> str:
    """" in 25.6 s on h100: 61,400 tokens/s, MFU 41%, compute-bound" ("" without a time)."""
    if p.step_seconds is None:
        return ""
    mfu = f"MFU {100 * p.mfu:.0f}%" if p.mfu is not None else "MFU n/a"
    return (f" in {duration(p.step_seconds)}: {p.tokens_per_second:,.0f} tokens/s, {mfu}, "
            f"{p.bound}-bound")


def plan_line(p: Plan) -> str:
    """The search's line for a plan as it is found: "  FSDP 64 + checkpointing: micro-batch
    2 fits, peak 52.2 GiB, reserved 61.3 GiB"."""
    if not p.fits:
        return f"  {p.name}: does not fit at micro-batch {p.searched_from}"
    fitting = (f"every micro-batch up to {p.batch:,} fits" if p.at_batch_limit
               else f"micro-batch {p.batch:,} fits")
    reserved = (f", reserved {format_bytes(p.reserved_bytes)}"
                if p.reserved_bytes is not None else "")
    return f"  {p.name}: {fitting}, peak {format_bytes(p.peak_bytes)}{reserved}"


def _memory(p, budget: str) -> str:
    """"74.5 GiB allocated, 77.9 GiB reserved of 80 GiB per rank" (the allocated peak alone
    off CUDA)."""
    if p.reserved_bytes is None:
        return f"{format_bytes(p.peak_bytes)} of {budget} per rank"
    return (f"{format_bytes(p.peak_bytes)} allocated, {format_bytes(p.reserved_bytes)} "
            f"reserved of {budget} per rank")


def _table(report: PlansReport, timed: bool, reserved: bool) -> Table:
    """Every plan: its batch and tokens a step, its step (with a GPU), its peak and room."""
    speed = ("step", "tokens/s", "MFU") if timed else ()
    # 100 columns hold the step's columns with one peak: the reserved one where there is one
    # (the allocated one is in the JSON and the first line), and a checkpointed plan's name on
    # two lines.
    peaks = (("reserved",) if timed else ("peak/rank", "reserved")) if reserved \
        else ("peak/rank",)
    numbers = ("batch", "tokens/step", *speed, *peaks, "room")
    table = titled_table(None, "plan", *numbers, *(("bound",) if timed else ()), right=numbers,
                         no_wrap=True)
    for p in report.plans:
        held = p.reserved_bytes if p.reserved_bytes is not None else p.peak_bytes
        room = report.memory_bytes - held
        at_least = "≥ " if p.at_batch_limit else ""
        times: tuple[str, ...] = ()
        if timed:
            times = ("—", "—", "—") if p.step_seconds is None else (
                duration(p.step_seconds), f"{p.tokens_per_second or 0:,.0f}",
                f"{100 * p.mfu:.0f}%" if p.mfu is not None else "n/a")
        shown = {"peak/rank": p.peak_bytes, "reserved": p.reserved_bytes}
        table.add_row(
            p.name.replace(" + ", "\n+ ") if timed else p.name,
            f"{at_least}{p.batch:,}" if p.fits else f"{p.searched_from}",
            f"{at_least}{p.tokens:,}" if p.fits else "—", *times,
            *(format_bytes(shown[k] or 0) for k in peaks),
            format_bytes(room) if room >= 0 else f"−{format_bytes(-room)}",
            *((_BOUND.get(p.bound or "—", p.bound or "—"),) if timed else ()),
            style=None if p.fits else "dim")
    return table


def render_plans(report: PlansReport) -> RenderableType:
    budget = format_bytes(report.memory_bytes)
    where = report.accelerator or "--memory"
    # "Best plan: …, micro-batch 3 — … tokens per step in …: … tokens/s …; … per rank …".
    head = Text()
    best = report.best
    if best is None:
        head.append("No plan fits", style="bold")
        head.append(f" in {budget} per rank.")
    elif best.at_batch_limit:  # not its largest batch: where the search stopped (the note)
        head.append(f"Best plan: {best.name}, every micro-batch up to {best.batch:,} fits",
                    style="bold")
        head.append(f" — at least {best.tokens:,} tokens per step{_speed(best)}; "
                    f"{_memory(best, budget)} at {best.batch:,}, its peak in the "
                    f"{best.phase} pass.")
    else:
        head.append(f"Best plan: {best.name}, micro-batch {best.batch:,}", style="bold")
        head.append(f" — {best.tokens:,} tokens per step{_speed(best)}; "
                    f"{_memory(best, budget)}, its peak in the {best.phase} pass.")
    policy = ", ".join(f"{k}={v}" for k, v in report.mp_policy.items() if v) or "none"
    context = Text(f"{report.model} ({report.depth} blocks) on {report.gpus} GPUs of {budget} "
                   f"({where}) · {report.setting} · FSDP2 mixed precision: {policy} · seq "
                   f"{report.seq:,} · {report.optimizer}", style="dim")
    timed = any(p.step_seconds is not None for p in report.plans)
    reserved = any(p.reserved_bytes is not None for p in report.plans)
    table = _table(report, timed, reserved)
    depths = report.probe_depths or [2, 3]
    shallow, deep = depths[0], depths[-1]
    at = (f"at its {report.depth} blocks" if depths == [report.depth]
          else f"at {' and '.join(map(str, depths))} blocks")
    extended = "" if depths == [report.depth] else "the full depth and "
    how = Text(
        f"Each plan's rank 0 was traced on fake tensors and PyTorch's fake process group {at}, "
        "at micro-batch 2, and 3 where 2 fits (1 where 2 does not and could win); its peak at "
        f"{extended}every micro-batch follows by exact rules (docs/fit.md).", style="dim")
    if reserved:
        how.append(
            " A plan fits when its reserved peak does: the CUDA caching allocator replayed over "
            "the probes' storages at the plan's micro-batch, exact at the probes' depths; at "
            + ("its depth it is the largest of their gaps to the allocated peak and their "
               "line, an estimate." if extended else "its depth, exact."))
    if timed:
        how.append(
            f" Its step on {where} is each probe's ops timed (analysis/step_time, collectives "
            "included), taken affine "
            + (f"in the depth (a block: {deep} blocks' time less {shallow} blocks') and in the "
               "micro-batch: the depth exactly, the batch approximately" if extended else
               "in the micro-batch, approximately")
            + " (a matmul's wave quantization and a launch-bound op are not affine in it); "
            "plans rank by tokens/s.")
    took = Text(f"Searched in {report.seconds:.1f} s.", style="dim")
    parts: list[RenderableType] = [head, context, Text(""), table, Text(""), how, took]
    if any(not p.fits and p.searched_from > 1 for p in report.plans):
        parts.append(Text("A plan that does not fit at micro-batch 2 was not traced at 1: its " + (
            "tokens/s at batch 1 are at most its tokens/s at 2, no more than the best plan's."
            if timed else "dp × seq tokens at batch 1 are no more than the best plan's."),
            style="dim"))
    limited = [p.name for p in report.plans if p.at_batch_limit]
    if limited:
        parts.append(Text(
            f"{', '.join(limited)}: every micro-batch up to {report.batch_limit:,} fits in "
            f"{budget} per rank (≥ in the table); the search derives no larger batch, as no "
            "probe ran near one.", style="dim"))
    parts += [Text(note, style="dim") for note in report.notes]
    return Group(*parts)
