"""The checks: rules that judge a run from its records and say what is wrong, as a linter does.

Each rule has a stable id (`AMP201`), a name, a severity and a page section in docs/checks.md;
it reads a `Trace` and returns `Hit`s, which `check_trace` turns into `records.Diagnostic`s.
A rule is one function in one of this package's modules, registered by `@rule(...)`:

    @rule("AMP201", "fp16-without-loss-scaling", "warning", "fp16 gradients, no loss scale")
    def fp16_without_scaling(trace: Trace) -> Iterable[Hit]: ...

The modules, by kind of mistake (the ids' hundreds):
- `reductions.py`: AMP1xx, distributed policies (gradient reductions narrower than asked, fp8
  weights all-gathered in 16 bits);
- `loss_scaling.py`: AMP2xx, fp16 without loss scaling, a GradScaler without fp16, gradients
  read while scaled;
- `constants.py`: AMP301-302, constants that overflow or vanish in the dtype they meet;
  `value_checks.py`: AMP303-304 and AMP401, what a real run's values say;
- `updates.py`: AMP402, optimizer state in 16 bits;
- `buffers.py`: AMP5xx, normalisation statistics, rotary tables and positions in 16 bits;
- `loss.py`: AMP6xx, the loss computed in 16 bits;
- `backend.py`: AMP7xx, float32 matmuls without TF32, attention on the math kernel;
- `autocast.py`: AMP8xx, autocast regions that do not do what they look like;
- `evidence.py`: what the rules read off the op records (names, phases, GradScaler's ops).

A finding is silenced by `ignore` (ids or names) or, on its own line, by a comment in the
user's source: `# ampscope: ignore[AMP201]` (or `# ampscope: ignore` for every rule).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from ampscope.analysis.findings import derive_findings
from ampscope.records import SEVERITIES, Diagnostic, Trace


class Hit(NamedTuple):
    """What a rule found: the Diagnostic's own fields; `severity` overrides the rule's."""

    message: str
    evidence: tuple[str, ...]
    consequence: str
    fix: str
    source: str | None = None
    severity: str | None = None


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    severity: str  # the usual one; a hit may say another
    summary: str  # the kind of mistake, in a few words (docs/checks.md, `check --list`)
    check: Callable[[Trace], Iterable[Hit]]

    def diagnostics(self, trace: Trace) -> list[Diagnostic]:
        return [Diagnostic(self.id, self.name, hit.severity or self.severity, hit.message,
                           tuple(hit.evidence), hit.consequence, hit.fix, hit.source)
                for hit in self.check(trace)]


RULES: dict[str, Rule] = {}
_ID = re.compile(r"AMP\d{3}")


def rule(id: str, name: str, severity: str, summary: str
         ) -> Callable[[Callable[[Trace], Iterable[Hit]]], Callable[[Trace], Iterable[Hit]]]:
    """Register the decorated function as the rule `id`."""
    assert _ID.fullmatch(id) and severity in SEVERITIES and id not in RULES, id

    def register(check: Callable[[Trace], Iterable[Hit]]) -> Callable[[Trace], Iterable[Hit]]:
        RULES[id] = Rule(id, name, severity, summary, check)
        return check
    return register


# The modules that hold the rules: importing them registers them.
_RULE_MODULES = ("reductions", "loss_scaling", "updates", "loss", "buffers", "backend", "constants",
                 "value_checks", "autocast")
for _module in _RULE_MODULES:
    importlib.import_module(f"{__name__}.{_module}")


def unknown_ids(names: Iterable[str]) -> list[str]:
    """The names among `names` that are neither a rule's id nor its name."""
    known = {r.id for r in RULES.values()} | {r.name for r in RULES.values()}
    return [n for n in names if n not in known]


# `# ampscope: ignore` or `# ampscope: ignore[AMP201, fp16-without-loss-scaling]`.
_SILENCE = re.compile(r"#\s*ampscope:\s*ignore(?:\[([^\]]*)\])?")


def silenced(diagnostic: Diagnostic, line: str | None) -> bool:
    """Whether the source `line` a diagnostic points at silences it."""
    if line is None:
        return False
    found = _SILENCE.search(line)
    if found is None:
        return False
    if found.group(1) is None:
        return True
    named = {n.strip() for n in found.group(1).split(",")}
    return diagnostic.id in named or diagnostic.name in named


def check_trace(trace: Trace, *,
                line_of: Callable[[str], str | None] | None = None) -> list[Diagnostic]:
    """Every rule's diagnostics on `trace`, most severe first, without those silenced in the
    source (`line_of("train.py:12")` gives a source line's text; the API passes the files the
    run read)."""
    found = []
    for r in sorted(RULES.values(), key=lambda r: r.id):
        for d in r.diagnostics(trace):
            if d.source is not None and line_of is not None and silenced(d, line_of(d.source)):
                continue
            found.append(d)
    return sorted(found, key=lambda d: (SEVERITIES.index(d.severity), d.id))


def judge(trace: Trace, *, line_of: Callable[[str], str | None] | None = None) -> None:
    """Fill `trace.findings` (the dtype facts) and `trace.diagnostics` (the checks), the two
    things a finished trace says of itself."""
    trace.findings = derive_findings(trace)
    trace.diagnostics = check_trace(trace, line_of=line_of)
