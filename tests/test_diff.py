"""`ampscope diff`: dtype differences between two traces, on hand-built records and gpt2-tiny.

Regenerate the golden output after an intended change with
`AMPSCOPE_UPDATE_GOLDEN=1 pytest tests/test_diff.py` and read the diff before committing it.
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

import ampscope
from ampscope.analysis.diff import (
    SCHEMA,
    CastChange,
    ModuleChange,
    OpChange,
    Side,
    TensorChange,
    diff_traces,
)
from ampscope.records import (
    BufferRecord,
    InputRecord,
    ModelInfo,
    ModuleCall,
    OpCall,
    OptimizerStateRecord,
    ParameterRecord,
    TensorMeta,
    Trace,
)
from ampscope.render.diff import render_diff
from tests.helpers import BF16, F32, I64, check, setting_record

pytestmark = pytest.mark.fast

FP32, BF = ("float32",), ("bfloat16",)


def net(outs: list[TensorMeta], phase: str = "forward") -> list[ModuleCall]:
    """Module calls of Net > h.i (Block) > h.i.fc (Linear); block i's fc outputs outs[i]."""
    calls = [ModuleCall(0, "", "Net", phase, 0, (I64,), (F32,))]
    for i, out in enumerate(outs):
        calls.append(ModuleCall(len(calls), f"h.{i}", "Block", phase, 1, (F32,), (out,)))
        calls.append(ModuleCall(len(calls), f"h.{i}.fc", "Linear", phase, 2, (F32,), (out,)))
    return calls


def linear_ops(n: int, amp: bool) -> list[OpCall]:
    """Each block's fc: under autocast, casts of its weight and input, then a bf16 mm."""
    ops: list[OpCall] = []
    for i in range(n):
        m = f"h.{i}.fc"
        if amp:
            ops += [OpCall(0, "aten._to_copy.default", m, "forward", (F32,), (BF16,), True, None,
                           None, (f"{m}.weight",)),
                    OpCall(0, "aten._to_copy.default", m, "forward", (F32,), (BF16,), True, None,
                           None, (None,))]
        x = BF16 if amp else F32
        ops.append(OpCall(0, "aten.mm.default", m, "forward", (x, x), (x,), False, None,
                          "toy.py:7", (None, None)))
    return ops


def toy(modules=(), ops=(), setting="fp32", **tensors) -> Trace:
    return Trace(ModelInfo("toy", "Net", 48), setting_record(setting), "train", list(modules),
                 ops=list(ops), **tensors)


def test_identical_traces_have_an_empty_diff():
    t = toy(net([BF16] * 3), linear_ops(3, amp=True),
            parameters=[ParameterRecord("h.0.fc.weight", "float32", (4, 4), True, "float32")])
    d = diff_traces(t, t)
    assert d.identical
    assert (d.modules, d.ops, d.casts, d.tensors) == ((), (), (), ())
    assert d.to_dict()["summary"]["identical"] is True


def test_changed_module_rows_collapse_like_the_flow():
    d = diff_traces(toy(net([F32] * 12)), toy(net([BF16] * 12)))
    assert d.modules == (
        ModuleChange("forward", "h.0–11", "Block", Side(FP32, FP32), Side(FP32, BF), 1, 12),
        ModuleChange("forward", "h.0–11.fc", "Linear", Side(FP32, FP32), Side(FP32, BF), 2, 12),
    )
    assert d.summary.modules_changed == 24


def test_a_block_that_differs_is_its_own_row():
    d = diff_traces(toy(net([BF16] * 4)), toy(net([BF16, BF16, F32, BF16])))
    assert [(m.name, m.b.outputs) for m in d.modules] == [("h.2", FP32), ("h.2.fc", FP32)]


def test_module_calls_in_one_trace_only():
    d = diff_traces(toy(net([BF16] * 2)), toy(net([BF16] * 4)))
    assert [(m.name, m.a, m.repeats) for m in d.modules] == [("h.2–3", None, 2),
                                                             ("h.2–3.fc", None, 2)]
    assert (d.summary.modules_only_a, d.summary.modules_only_b) == (0, 4)


def test_calls_match_by_occurrence_and_steps_collapse():
    step = net([BF16])
    fp32_step = net([F32])
    d = diff_traces(toy(step * 3), toy(fp32_step * 3))
    assert [(m.name, m.note, m.repeats) for m in d.modules] == [("h.0", "× 3 steps", 3),
                                                               ("h.0.fc", "× 3 steps", 3)]


def test_backward_module_changes_are_their_own_phase():
    d = diff_traces(toy(net([F32], "backward")), toy(net([BF16], "backward")))
    assert {m.phase for m in d.modules} == {"backward"}


def test_autocast_casts_appear_named_by_parameter_and_collapsed():
    d = diff_traces(toy(net([F32] * 3), linear_ops(3, amp=False)),
                    toy(net([BF16] * 3), linear_ops(3, amp=True)))
    assert d.casts == (
        CastChange("forward", "h.0–2.fc", "h.0–2.fc.weight", "float32", "bfloat16", 0, 3),
        CastChange("forward", "h.0–2.fc", None, "float32", "bfloat16", 0, 3),
    )
    assert (d.summary.casts_a, d.summary.casts_b) == (0, 6)
    assert (d.summary.casts_appeared, d.summary.casts_disappeared) == (6, 0)
    # The casts are counted apart, not again as ops that ran in B only.
    assert d.ops == (OpChange("forward", "h.0–2.fc", "aten.mm.default", Side(FP32 * 2, FP32),
                              Side(BF * 2, BF), 3),)


def test_casts_that_disappear():
    d = diff_traces(toy(ops=linear_ops(1, amp=True)), toy(ops=linear_ops(1, amp=False)))
    assert [(c.tensor, c.a, c.b) for c in d.casts] == [("h.0.fc.weight", 1, 0), (None, 1, 0)]
    assert d.summary.casts_disappeared == 2


def test_ops_in_one_trace_only_and_tied_weights_keep_their_name():
    shared = OpCall(0, "aten.mm.default", "head", "forward", (F32, F32), (F32,), False, None,
                    None, (None, None))
    cast = OpCall(0, "aten._to_copy.default", "head", "forward", (F32,), (BF16,), True, None,
                  None, ("wte.weight",))
    extra = OpCall(0, "aten.gelu.default", "head", "forward", (F32,), (F32,), False, None, None,
                   (None,))
    d = diff_traces(toy(ops=[shared, extra]), toy(ops=[cast, shared]))
    assert d.ops == (OpChange("forward", "head", "aten.gelu.default", Side(FP32, FP32), None),)
    assert d.casts == (CastChange("forward", "head", "wte.weight", "float32", "bfloat16", 0, 1),)
    assert (d.summary.ops_only_a, d.summary.ops_only_b, d.summary.ops_changed) == (1, 0, 0)


def test_tensor_changes_of_every_kind():
    def tensors(p: str, g: str | None, state: str, buf: bool, ids: str) -> dict:
        return dict(
            parameters=[ParameterRecord("w", p, (2,), True, g),
                        ParameterRecord("b", "float32", (2,), True, "float32")],
            buffers=[BufferRecord("cos", "bfloat16", (2,), False)] if buf else [],
            optimizer_state=[OptimizerStateRecord("w", "exp_avg", state, (2,)),
                             OptimizerStateRecord("w", "step", "float32", ())],
            inputs=[InputRecord("idx", "input", ids, (2,)),
                    InputRecord("targets", "target", "int64", (2,))],
            outputs=[InputRecord("loss", "output", p, ())],
        )

    d = diff_traces(toy(**tensors("float32", "float32", "float32", True, "int64")),
                    toy(**tensors("bfloat16", None, "bfloat16", False, "int32")))
    assert d.tensors == (
        TensorChange("parameter", "w", "float32", "bfloat16"),
        TensorChange("gradient", "w", "float32", None),
        TensorChange("buffer", "cos", "bfloat16", None),
        TensorChange("optimizer state", "w:exp_avg", "float32", "bfloat16"),
        TensorChange("input", "idx", "int64", "int32"),
        TensorChange("output", "loss", "float32", "bfloat16"),
    )
    s = d.summary
    assert (s.tensors_changed, s.tensors_only_a, s.tensors_only_b) == (4, 2, 0)


def test_to_dict_names_the_schema_and_is_json():
    d = diff_traces(toy(net([F32]), linear_ops(1, amp=False), setting="fp32"),
                    toy(net([BF16]), linear_ops(1, amp=True), setting="fp32+amp-bf16"))
    data = json.loads(json.dumps(d.to_dict()))
    assert data["schema"] == SCHEMA == "ampscope.diff/1"
    assert data["a"] == {"model": "toy", "setting": "fp32", "workload": "train"}
    assert data["modules"][0] == {"phase": "forward", "name": "h.0", "type": "Block", "depth": 1,
                                  "repeats": 1, "note": "",
                                  "a": {"in": ["float32"], "out": ["float32"]},
                                  "b": {"in": ["float32"], "out": ["bfloat16"]}}
    assert data["casts"][0] == {"phase": "forward", "module": "h.0.fc", "tensor": "h.0.fc.weight",
                                "from": "float32", "to": "bfloat16", "a": 0, "b": 1}
    assert data["ops"][0]["a"] == {"in": ["float32", "float32"], "out": ["float32"]}
    assert data["summary"]["casts_appeared"] == 2 and data["summary"]["identical"] is False


# --- rendering ----------------------------------------------------------------------------

def golden_diff():
    a = toy(net([F32] * 3), linear_ops(3, amp=False), setting="fp32",
            parameters=[ParameterRecord(f"h.{i}.fc.weight", "float32", (4, 4), True, "float32")
                        for i in range(3)],
            optimizer_state=[OptimizerStateRecord("h.0.fc.weight", "exp_avg", "float32", (4, 4))],
            buffers=[BufferRecord("mask", "bool", (4,), False)])
    b = toy(net([BF16] * 4), linear_ops(3, amp=True), setting="fp32+amp-bf16",
            parameters=[ParameterRecord(f"h.{i}.fc.weight", "float32", (4, 4), True, "bfloat16")
                        for i in range(3)],
            optimizer_state=[OptimizerStateRecord("h.0.fc.weight", "exp_avg", "bfloat16",
                                                  (4, 4))])
    return diff_traces(a, b)


def render(d, label_a: str, label_b: str, **kw) -> str:
    out = io.StringIO()
    Console(file=out, width=100, color_system=None, legacy_windows=False).print(
        render_diff(d, label_a, label_b, **kw))
    return out.getvalue()


def test_diff_render_matches_golden():
    check("diff_toy.txt", render(golden_diff(), "fp32", "fp32+amp-bf16", ops=True))


def test_identical_render_says_so():
    t = toy(net([F32]))
    text = render(diff_traces(t, t), "fp32", "fp32")
    assert "A: fp32  vs  B: fp32" in text and "no dtype differences" in text


# --- a real model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_tiny() -> dict[str, Trace]:
    return {s: ampscope.trace("gpt2-tiny", setting=s, workload="train", seq=8)
            for s in ("fp32", "fp32+amp-bf16", "bf16")}


def test_gpt2_autocast_diff(gpt2_tiny):
    a, b = gpt2_tiny["fp32"], gpt2_tiny["fp32+amp-bf16"]
    d = diff_traces(a, b)
    linears = [m for m in d.modules if m.type == "Linear" and m.phase == "forward"]
    assert linears and all(m.a.outputs == FP32 and m.b.outputs == BF for m in linears)
    # Every Linear's weight is cast to bf16 by autocast, once per call (lm_head's is the tied wte).
    weight_casts = {c.module: c for c in d.casts
                    if c.tensor and c.tensor.endswith(".weight") and c.dst == "bfloat16"}
    assert {m.name for m in linears} <= set(weight_casts)
    assert weight_casts["lm_head"].tensor == "transformer.wte.weight"
    linear_calls = sum(m.type == "Linear" and m.phase == "forward" for m in b.modules)
    assert sum(c.b - c.a for c in weight_casts.values()) == linear_calls
    assert d.summary.casts_a == 0 and d.summary.casts_appeared == d.summary.casts_b > 0
    # Gradients and optimizer state stay float32: no tensor changes at all.
    assert d.tensors == ()
    assert "no dtype differences" not in render(d, "fp32", "fp32+amp-bf16")


def test_gpt2_fp32_vs_bf16_changes_gradients_and_optimizer_state(gpt2_tiny):
    d = diff_traces(gpt2_tiny["fp32"], gpt2_tiny["bf16"])
    kinds = {(t.category, t.a, t.b) for t in d.tensors}
    assert ("gradient", "float32", "bfloat16") in kinds
    assert ("optimizer state", "float32", "bfloat16") in kinds
    assert ("parameter", "float32", "bfloat16") in kinds
    grads = [t for t in d.tensors if t.category == "gradient"]
    assert len(grads) == len(gpt2_tiny["bf16"].parameters)


def test_diff_of_json_round_trip_is_the_same(gpt2_tiny):
    a, b = gpt2_tiny["fp32"], gpt2_tiny["fp32+amp-bf16"]

    def reread(t: Trace) -> Trace:
        return Trace.from_dict(json.loads(t.to_json()))

    assert diff_traces(reread(a), reread(b)) == diff_traces(a, b)
    assert diff_traces(reread(a), a).identical
