"""Analysis on hand-built records: block and step collapsing, dtype changes, findings."""

from __future__ import annotations

import pytest

from ampscope.analysis.findings import derive_findings
from ampscope.analysis.flow import FlowRow, collapse_blocks, dtype_changes, module_flow, split_block
from ampscope.records import ModelInfo, OpCall, ParameterRecord, Trace
from tests.helpers import BF16, F32, blocks, call, setting_record

pytestmark = pytest.mark.fast


def names(rows):
    return [r.name for r in rows]


def test_split_block():
    assert split_block("transformer.h.3.attn.c_attn") == ("transformer.h", 3, ".attn.c_attn")
    assert split_block("h.11") == ("h", 11, "")
    assert split_block("lm_head") is None


def test_identical_blocks_collapse_into_one_range():
    rows = module_flow(blocks(12))
    assert names(rows) == ["(model)", "h.0–11", "h.0–11.fc", "head"]
    assert [r.repeats for r in rows] == [1, 12, 12, 1]


def test_a_block_that_differs_splits_the_range():
    rows = module_flow(blocks(6, odd=3))
    assert names(rows) == ["(model)", "h.0–2", "h.0–2.fc", "h.3", "h.3.fc", "h.4–5", "h.4–5.fc",
                           "head"]
    assert rows[4].outputs == ("float32",)


def test_backward_order_collapses_too():
    rows = collapse_blocks([FlowRow(f"h.{i}.fc", "Linear", ("bfloat16",), ("float32",))
                            for i in (3, 2, 1, 0)])
    assert names(rows) == ["h.0–3.fc"]


def test_repeated_sampling_steps_collapse():
    step = blocks(2)
    calls = step + [call(len(step) + c.index, c.name, c.type, c.depth, c.inputs, c.outputs)
                    for c in step]
    rows = module_flow(calls)
    assert names(rows) == ["(model)", "h.0–1", "h.0–1.fc", "head"]
    assert rows[0].note == "× 2 steps"


def test_dtype_changes_keep_only_the_innermost_module():
    rows = module_flow(blocks(2))
    assert [(r.name, r.kind) for r in dtype_changes(rows)] == [("h.0–1.fc", "Linear"),
                                                              ("head", "Linear")]


def test_findings_from_hand_built_records():
    trace = Trace(
        model=ModelInfo("toy", "Toy", 24), setting=setting_record("fp32+amp-bf16"), workload="train",
        parameters=[
            ParameterRecord("emb.weight", "bfloat16", (4, 2), True, "bfloat16"),
            ParameterRecord("fc.weight", "float32", (4, 4), True, "float32", ("head.weight",)),
        ],
        ops=[OpCall(0, "aten._to_copy.default", "fc", "forward", (F32,), (BF16,), True, 0,
                    "toy.py:3", ("fc.weight",))],
    )
    texts = [f.text for f in derive_findings(trace)]
    assert "All 2 parameters are bfloat16, except fc.weight (float32)." in texts
    assert "fc.weight is tied to head.weight: one tensor, counted once." in texts
    assert ("Autocast inserted 1 cast in the forward pass (0.00 MB): 1 to bfloat16; "
            "1 of them cast parameters or buffers.") in texts
    assert "Gradients have their parameters' dtypes (2 gradients)." in texts
