"""The checks' diagnostics in the terminal: one block each, most severe first, as a linter
prints them (`ampscope check`, and the top of every trace's report).

Namesakes, the same concern at another layer: `records/diagnostics.py` (the record)."""

from __future__ import annotations

from collections import Counter

from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.text import Text

from ampscope.records import SEVERITIES, Diagnostic

_STYLE = {"error": "bold red", "warning": "bold yellow", "note": "bold cyan"}


def tally(diagnostics: list[Diagnostic]) -> str:
    """"1 error, 2 warnings" (severities with none left out); "nothing found" when empty."""
    counts = Counter(d.severity for d in diagnostics)
    parts = [f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in SEVERITIES if counts[s]]
    return ", ".join(parts) or "nothing found"


def diagnostics_text(diagnostics: list[Diagnostic], device: str) -> Group:
    """The diagnostics under a "Check" title; `device` is the run's target. Each paragraph
    wraps under its own indent."""
    parts: list[RenderableType] = [Text(f"Check: {tally(diagnostics)}", style="italic")]
    for d in diagnostics:
        head = Text("  ")
        head.append(f"{d.severity} ", style=_STYLE[d.severity])
        head.append(f"{d.id} {d.name}", style="bold")
        if d.source:
            head.append(f"  {d.source}", style="dim")
        parts += [head, _paragraph("", d.message)]
        parts += [_paragraph("evidence: ", line) for line in d.evidence]
        if d.consequence:
            parts.append(_paragraph(f"on {device}: ", d.consequence))
        if d.fix:
            parts.append(_paragraph("fix: ", d.fix))
    return Group(*parts, Text())


def _paragraph(label: str, text: str) -> Padding:
    body = Text()
    body.append(label, style="dim")
    body.append(text)
    return Padding(body, (0, 0, 0, 4))
