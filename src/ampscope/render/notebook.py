"""Notebook display: the HTML view of a trace or a report in Jupyter.

Jupyter shows an object as HTML when its class has a `_repr_html_` method. Records and reports
sit below this layer and must not import it, so `register()` gives each class in `VIEWS` its
view: the trace's, the matrix's, and the section of every report registered with one
(render/report_kinds.py). Importing this module changes nothing: the package root calls
`register()` on the first use of any of its names (`ampscope.trace`, ...), and code that imports
the records and reports from their own modules, without those names, calls it itself.
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
