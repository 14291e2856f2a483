"""How records and reports get their notebook view: `render.notebook.register()`, called
explicitly (by the package root on first use of its names), never as a side effect of an
import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import modules_after

pytestmark = pytest.mark.fast

_IMPORT_THEN_REGISTER = """
import sys
from ampscope.analysis.memory import MemoryReport
from ampscope.records import Trace
import ampscope.render.notebook as notebook

before = [hasattr(c, "_repr_html_") for c in (Trace, MemoryReport)]
notebook.register()
print(before, Trace._repr_html_ is notebook.VIEWS[Trace],
      MemoryReport._repr_html_ is notebook.VIEWS[MemoryReport])
"""


def test_importing_the_views_gives_no_class_a_view_until_registered():
    result = subprocess.run([sys.executable, "-c", _IMPORT_THEN_REGISTER], capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == ["[False,", "False]", "True", "True"]


def test_the_records_import_no_view():
    assert modules_after("import ampscope.records", "ampscope.render") == []
