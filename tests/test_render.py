"""The terminal rendering of a hand-built trace, compared with saved output.

Regenerate after an intended change with `AMPSCOPE_UPDATE_GOLDEN=1 pytest tests/test_render.py`
and read the diff before committing it.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ampscope.analysis.findings import derive_findings
from ampscope.analysis.summary import trace_summary
from ampscope.records import InputRecord, ModelInfo, OpCall, ParameterRecord, Trace
from ampscope.render.text import render_trace
from tests.helpers import BF16, F32, blocks, check, setting_record

pytestmark = pytest.mark.fast


def toy_trace() -> Trace:
    trace = Trace(
        model=ModelInfo("toy", "Net", 1234),
        setting=setting_record("fp32+amp-bf16"),
        workload="train",
        modules=blocks(3),
        ops=[OpCall(0, "aten._to_copy.default", "h.0.fc", "forward", (F32,), (BF16,), True, 0,
                    None, ("h.0.fc.weight",)),
             OpCall(1, "aten.addmm.default", "h.0.fc", "forward", (BF16, BF16, BF16), (BF16,),
                    False, 0, "toy.py:12", (None, None, None))],
        parameters=[ParameterRecord("h.0.fc.weight", "float32", (4, 4), True, "float32")],
        inputs=[InputRecord("idx", "input", "int64", (2,))],
        outputs=[InputRecord("loss", "output", "float32", ())],
    )
    trace.findings = derive_findings(trace)
    return trace


def render(trace: Trace, **kw) -> str:
    out = io.StringIO()
    Console(file=out, width=100, color_system=None, legacy_windows=False).print(
        render_trace(trace_summary(trace, **kw)))
    return out.getvalue()


def test_trace_summary_matches_golden():
    check("trace_summary.txt", render(toy_trace()))


def test_trace_with_ops_matches_golden():
    check("trace_ops.txt", render(toy_trace(), ops=True))
