"""A predicted step (analysis/step_time.py's `StepTime`) in words, for every view that shows
one: the one-line summary of `trace` and `run`, the section of `flops` (measured beside
predicted when a step time was given), and the short forms of the `run --nproc` table."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope import hardware
from ampscope.analysis.op_time import BOUNDS
from ampscope.analysis.step_time import StepTime
from ampscope.analysis.time_diff import block_modules
from ampscope.render.style import titled_table

TOP_MODULES = 5  # rows of the flops section's module table


def gpu_title(predicted: StepTime) -> str:
    """The product the step was predicted on ("NVIDIA A100 SXM4 80GB"), or its short name
    where the table lacks it (an accelerator of the user's own figures)."""
    titles = {a.name: a.title for a in hardware.table()}
    return titles.get(predicted.accelerator, predicted.accelerator)


def duration(seconds: float) -> str:
    """"312 ms", "1.59 s", "85.0 µs": three significant figures."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "—"


def bound_shares(predicted: StepTime) -> str:
    """"compute 58%, memory 35%, launch 7%": the bounds that take any time, largest first."""
    shares = sorted(((b, s) for b, s in predicted.by_bound.items() if s > 0),
                    key=lambda kv: -kv[1])
    return ", ".join(f"{b} {_percent(s, predicted.seconds)}" for b, s in shares)


def mfu_text(predicted: StepTime) -> str:
    return f"MFU {100 * predicted.mfu:.2g}%" if predicted.mfu is not None else "MFU n/a"


def predicted_line(predicted: StepTime) -> Text:
    """"Predicted step on NVIDIA H100: 312 ms (compute 58%, memory 35%, launch 7%),
    52,500 tokens/s, MFU 41%"."""
    text = Text()
    text.append(f"Predicted step on {gpu_title(predicted)}: ", style="italic")
    text.append(duration(predicted.seconds), style="bold")
    text.append(f" ({bound_shares(predicted)}), {predicted.tokens_per_second:,.0f} tokens/s, "
                f"{mfu_text(predicted)}")
    return text


def predicted_section(predicted: StepTime, measured: float | None = None) -> RenderableType:
    """`flops`' section: the step's time, by bound, by phase and for the top modules, tokens/s
    and MFU; a measured step time beside it (and the ratio) where one was given."""
    whole = predicted.seconds
    head = Text(f"Predicted step on {gpu_title(predicted)}  ", style="italic")
    head.append(duration(whole), style="bold")
    head.append(f"  {predicted.tokens_per_second:,.0f} tokens/s  {mfu_text(predicted)}")
    if measured is not None:
        head.append(f"\n  measured {duration(measured)}: the prediction is "
                    f"{whole / measured:.2f}× the measured step (the measured time wins for "
                    "throughput and MFU below)", style="dim")
    numbers = ("ms", "share")
    bounds = titled_table("By bound", "bound", *numbers, right=numbers)
    for bound in BOUNDS:
        seconds = predicted.by_bound.get(bound, 0.0)
        if seconds or bound != "communication":
            bounds.add_row(bound, f"{seconds * 1e3:,.2f}", _percent(seconds, whole))
    phases = titled_table("By phase", "phase", *numbers, right=numbers)
    for phase, seconds in predicted.by_phase.items():
        phases.add_row(phase, f"{seconds * 1e3:,.2f}", _percent(seconds, whole))
    modules = titled_table("Modules that take longest (own ops, a stack's blocks together)",
                           ("module", {"overflow": "fold"}), *numbers, right=numbers)
    longest = sorted(block_modules(predicted).items(), key=lambda kv: -kv[1])
    for name, seconds in longest[:TOP_MODULES]:
        modules.add_row(name, f"{seconds * 1e3:,.2f}", _percent(seconds, whole))
    note = Text("Eager PyTorch, one op after another; how each op is costed, the figures and "
                "their sources: docs/performance.md", style="dim")
    if predicted.hidden_seconds:
        note.append(f"\n{duration(predicted.hidden_seconds)} of collectives hidden behind "
                    "compute (FSDP2/DDP overlap)", style="dim")
    return Group(head, Text(), bounds, Text(), phases, Text(), modules, note)
