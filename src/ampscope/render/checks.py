"""The checks' diagnostics in the terminal: one block each, most severe first, as a linter
prints them (`ampscope check`, and the top of every trace's report)."""

from __future__ import annotations

from collections import Counter

from rich.text import Text

from ampscope.records import SEVERITIES, Diagnostic

_STYLE = {"error": "bold red", "warning": "bold yellow", "note": "bold cyan"}


def tally(diagnostics: list[Diagnostic]) -> str:
    """"1 error, 2 warnings" (severities with none left out); "nothing found" when empty."""
    counts = Counter(d.severity for d in diagnostics)
    parts = [f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in SEVERITIES if counts[s]]
    return ", ".join(parts) or "nothing found"


def diagnostics_text(diagnostics: list[Diagnostic], device: str) -> Text:
    """The diagnostics under a "Check" title; `device` is the run's target."""
    text = Text()
    text.append(f"Check: {tally(diagnostics)}\n", style="italic")
    for d in diagnostics:
        text.append(f"  {d.severity} ", style=_STYLE[d.severity])
        text.append(f"{d.id} {d.name}", style="bold")
        if d.source:
            text.append(f"  {d.source}", style="dim")
        text.append(f"\n    {d.message}\n")
        for line in d.evidence:
            text.append("    evidence: ", style="dim")
            text.append(f"{line}\n")
        if d.consequence:
            text.append(f"    on {device}: ", style="dim")
            text.append(f"{d.consequence}\n")
        if d.fix:
            text.append("    fix: ", style="dim")
            text.append(f"{d.fix}\n")
    return text
