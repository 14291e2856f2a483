"""The reports, each registered once and looked up by name (as torchtitan's `register_train_spec`).

A `ReportKind` names all one kind of report has, each field commented below; its class's
`to_dict()` is the JSON `--json` writes, described by `schemas/NAME.schema.json`. Why parts are
"module:attribute" strings, imported only when used: docs/architecture.md ("Registries").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReportKind:
    name: str  # the command, the schema file, "ampscope.NAME/1", the docs/json-schema.md section
    help: str  # the command's line in `ampscope --help`
    report: str | type  # the class
    api: str | Callable[..., Any]  # the public function that makes one
    view: str | Callable[..., Any]  # report (and the command's view options) -> rich renderable
    section: str | None = None  # the title of its section in the HTML report and notebook view
    body: str | Callable[..., Any] | None = None  # [reports] -> that section's HTML
    table: str | None = None  # what `report.table()` holds, for --csv ("FLOPs by module")
    # (parser) -> None: the command's arguments; the exports it did not add follow them
    arguments: str | Callable[..., Any] | None = None
    examples: tuple[str, ...] = ()  # the end of the command's --help, one pastable line each
    public: bool = True  # `api` is `ampscope.NAME` and `ampscope.api.NAME` (docs/api.md)

    def load(self, part: str) -> Any:
        """A part (`"report"`, `"api"`, `"view"`, `"body"`, `"arguments"`), imported on first
        use."""
        ref = getattr(self, part)
        if not isinstance(ref, str):
            return ref
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)


REPORTS: dict[str, ReportKind] = {}


def register_report(kind: ReportKind) -> ReportKind:
    """Register one kind of report under its name (once: a name is never taken twice)."""
    if kind.name in REPORTS:
        raise ValueError(f"a report named {kind.name!r} is already registered")
    REPORTS[kind.name] = kind
    return kind


def kind_of(report: object) -> ReportKind:
    """The registered kind of `report`, found by its class's name: nothing is imported."""
    cls = type(report)
    for kind in REPORTS.values():
        if kind.report in (cls, f"{cls.__module__}:{cls.__qualname__}"):
            return kind
    raise ValueError(f"{cls.__name__} is not a registered report (render/report_kinds.py)")


def public_functions() -> dict[str, ReportKind]:
    """The registered reports whose function is public under the report's name."""
    return {name: kind for name, kind in REPORTS.items() if kind.public}


register_report(ReportKind(
    "memory", "every byte of one step by category and dtype; the peak and where it happens",
    "ampscope.analysis.memory:MemoryReport", "ampscope.api.reports:memory",
    "ampscope.render.memory:render_memory", "Memory", "ampscope.render.html:memory_body",
    table="bytes by category and dtype", arguments="ampscope.cli.parser:memory_arguments",
    examples=(
        "ampscope memory gpt2-tiny --seq 32 -w forward",
        "ampscope memory gpt2 --device cuda --seq 256 --predict",
        "ampscope memory llama-3-8b -d cuda -s bf16 --predict --json mem.json",
    )))
register_report(ReportKind(
    "flops", "FLOPs of one step by phase, dtype and module; MFU",
    "ampscope.analysis.flops:FlopReport", "ampscope.api.reports:flops",
    "ampscope.render.flops:render_flops", "FLOPs by module", "ampscope.render.html:flops_body",
    table="FLOPs by module", arguments="ampscope.cli.parser:flops_arguments", examples=(
        "ampscope flops gpt2-tiny --seq 8",
        "ampscope flops gpt2 -d cuda -b 8 -t 1024 --predict --step-time 0.25 --gpu a100",
        "ampscope flops gpt2 -d cuda --predict --step-time 0.25 --peak-flops bf16=989e12,fp32=67e12",
    )))
register_report(ReportKind(
    "numerics", "how far each setting's values drift from a high-precision reference, layer by "
                "layer",
    "ampscope.analysis.numerics:NumericsReport", "ampscope.api.reports:numerics",
    "ampscope.render.numerics:render_numerics", "Numerics per layer",
    "ampscope.render.html:numerics_body", arguments="ampscope.cli.parser:numerics_arguments",
    examples=(
        "ampscope numerics gpt2-tiny",
        "ampscope numerics gpt2-tiny --workload train --settings fp32+amp-bf16,bf16",
    )))
register_report(ReportKind(
    "formats", "number formats: range, eps, and how each stores given values",
    "ampscope.analysis.format_table:FormatsReport", "ampscope.analysis.formats:formats_report",
    "ampscope.render.formats:render_formats", arguments="ampscope.cli.parser:formats_arguments",
    examples=(
        "ampscope formats                 # range, eps and layout of every format",
        "ampscope formats 0.1 65504 1e-8  # how each format stores these values",
        "ampscope formats -inf -1e-8      # negative values as they are",
    ), public=False))  # (its function is analysis's, not the API's: `ampscope formats` only)
register_report(ReportKind(
    "policy", "the autocast policy of this PyTorch build, per op",
    "ampscope.analysis.autocast:PolicyReport", "ampscope.api.reports:policy",
    "ampscope.render.autocast:render_policy", arguments="ampscope.cli.parser:policy_arguments",
    examples=(
        "ampscope policy -d cuda --op softmax",
        "ampscope policy --compare cpu cuda --op norm",
        "ampscope policy --quiz",
    )))
