"""Notebook display: the HTML view of a trace or a report in Jupyter.

Jupyter shows an object as HTML when its class has a `_repr_html_` method. Records and reports
sit below this layer and must not import it, so `register()` gives each class in `VIEWS` its
view. Importing this module changes nothing: the package root calls `register()` on the first
use of any of its names (`ampscope.trace`, ...), and code that imports the records and reports
from their own modules, without those names, calls it itself.
"""

from __future__ import annotations

from collections.abc import Callable

from ampscope.analysis.compare import Matrix
from ampscope.analysis.flops import FlopReport
from ampscope.analysis.memory import MemoryReport
from ampscope.analysis.numerics import NumericsReport
from ampscope.records import Trace
from ampscope.render.html import flops_html, matrix_html, memory_html, numerics_html, trace_html

VIEWS: dict[type, Callable[..., str]] = {
    Trace: trace_html,
    Matrix: matrix_html,
    FlopReport: flops_html,
    MemoryReport: memory_html,
    NumericsReport: numerics_html,
}


def register() -> None:
    """Give every class in VIEWS its notebook view (idempotent)."""
    for cls, view in VIEWS.items():
        cls._repr_html_ = view  # type: ignore[attr-defined]
