"""Notebook display: the HTML view of a trace or a report in Jupyter (`_repr_html_`), given
to each class in `VIEWS` by `register()`: the trace's, the matrix's, and the section of every
report registered with one (render/report_kinds.py). Importing this module changes nothing;
why, and who calls `register()`: docs/report.md ("In a notebook").
"""

from __future__ import annotations

from collections.abc import Callable

from ampscope.analysis.compare import Matrix
from ampscope.records import Trace
from ampscope.render.html import matrix_html, section_html, trace_html
from ampscope.render.report_kinds import REPORTS

VIEWS: dict[type, Callable[..., str]] = {Trace: trace_html, Matrix: matrix_html}


def register() -> None:
    """Give every class in VIEWS, the registered reports' with a section added, its notebook
    view (idempotent)."""
    VIEWS.update((k.load("report"), section_html) for k in REPORTS.values() if k.section)
    for cls, view in VIEWS.items():
        cls._repr_html_ = view  # type: ignore[attr-defined]
