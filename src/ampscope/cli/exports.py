"""The exports, each registered once: the flag, how it writes the part of a command's result
it reads (`_show(args, render, json=…, csv=…, perfetto=…, report=…)`), the commands that take
it with each one's help line (`reports`: every registered report's, render/report_kinds.py), and
whether '-' means stdout; who reads it: docs/architecture.md ("Registries"). `write_exports`
writes them in this order, saying where on stderr. Torch-free: the parser reads it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from ampscope.errors import AmpscopeError
from ampscope.files import write_atomic
from ampscope.render.report_kinds import REPORTS, ReportKind

# The real stdout while a command with `--json -` runs with user code's prints sent to stderr.
json_stream: TextIO | None = None


def written(path: str, write: Callable[[], object]) -> None:
    """`write()` writes PATH atomically; one line on stderr then says where."""
    try:
        write()
    except OSError as e:
        raise AmpscopeError(f"cannot write {path}: {e.strerror}") from e
    print(f"Wrote {path}", file=sys.stderr)  # plain: a path must not be wrapped


def _text(text: str, path: str) -> None:
    """The text and a newline to PATH, or to stdout for '-'."""
    if path == "-":
        (json_stream or sys.stdout).write(text + "\n")
    else:
        written(path, lambda: write_atomic(path, text + "\n"))


@dataclass(frozen=True)
class Export:
    flag: str
    write: Callable[[Any, str], None]  # (the command's part, PATH)
    takes: Mapping[str, str]  # command -> its help line
    reports: Callable[[ReportKind], str | None] | None = None  # a report's help line, or None
    stdout: bool = False  # '-' writes the document alone to stdout

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--")

    def help(self, command: str) -> str | None:
        """The help line of the flag on `command`; None where the command does not take it."""
        kind = REPORTS.get(command)
        if command in self.takes or kind is None or self.reports is None:
            return self.takes.get(command)
        return self.reports(kind)


def _to(what: str, form: str, more: str = "") -> str:
    return f"write {what} as {form} ('-' for stdout{more})"


_PAGE = ("also write the HTML report of the {} (findings, dtype flow, memory, FLOPs; with {}: "
         "each rank)")
_MODULES = "the modules table (with --ops: the ops)"

EXPORTS: dict[str, Export] = {e.dest: e for e in (  # in the order they are written
    Export("--report", lambda page, path: written(path, lambda: write_atomic(path, page())),
           {"trace": _PAGE.format("trace", "--distributed"), "run": _PAGE.format("run", "--nproc")}),
    Export("--perfetto", lambda trace, path: written(path, lambda: trace.to_perfetto(path)),
           dict.fromkeys(("trace", "run"), "write the step as a timeline for ui.perfetto.dev or "
                                           "chrome://tracing (Trace Event JSON)")),
    Export("--json", lambda document, path: _text(json.dumps(document(), indent=1), path), {
        **dict.fromkeys(("trace", "matrix", "report", "diff", "fit"), _to("the result", "JSON")),
        "run": _to("the trace", "JSON", ": the script's prints go to stderr; with --nproc: the "
                                        "ranks' distributed report"),
        "models": _to("the list", "JSON"), "train": _to("the run", "JSON"),
        "check": _to("the diagnostics", "JSON"),
        "bench": _to("the table", "JSON")},
        reports=lambda kind: _to("the result", "JSON"), stdout=True),
    Export("--csv", lambda table, path: _text(table().to_csv().removesuffix("\n"), path),
           {"trace": _to(_MODULES, "CSV"), "run": _to(_MODULES, "CSV"),
            "matrix": _to("the modules table", "CSV")},
           reports=lambda kind: kind.table and _to(kind.table, "CSV"), stdout=True),
)}


def add_exports(parser: argparse.ArgumentParser, *names: str) -> None:
    """The exports `names` that the command takes; without names, every one it takes that is
    not on it yet (a report's arguments may place some), in the order registered."""
    command = parser.prog.split()[-1]
    for name in names or EXPORTS:
        help_text = EXPORTS[name].help(command)
        if help_text is None:
            continue
        try:
            parser.add_argument(EXPORTS[name].flag, metavar="PATH", help=help_text)
        except argparse.ArgumentError:  # the flag is on the parser already
            if names:  # named twice: a mistake in the parser
                raise


def given(args: argparse.Namespace) -> list[tuple[Export, str]]:
    """The exports asked for on the command line, each with its path."""
    return [(e, path) for e in EXPORTS.values()
            if (path := getattr(args, e.dest, None)) is not None]


def to_stdout(args: argparse.Namespace) -> bool:
    """Whether an export writes its document alone to stdout ('-')."""
    return any(path == "-" and e.stdout for e, path in given(args))


def write_exports(args: argparse.Namespace, **parts: Any) -> bool:
    """Each export asked for whose part the command gave, written; whether one went to stdout."""
    for export, path in given(args):
        if parts.get(export.dest) is not None:
            export.write(parts[export.dest], path)
    return to_stdout(args)
