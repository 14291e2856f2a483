"""Every forward dtype change gets exactly one cause: hand-built records for each cause, then
real traces whose causes are known facts (and the user line that made them)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import ampscope
from ampscope.analysis.causes import CAUSES, FLOATS, dtype_changes
from ampscope.analysis.findings import derive_findings
from ampscope.models import gpt2, nanochat
from ampscope.records import (
    BufferRecord,
    FunctionCall,
    ModelInfo,
    ModuleCall,
    OpCall,
    ParameterRecord,
    TensorMeta,
    Trace,
)
from tests.helpers import setting_record

F32, BF16 = TensorMeta("float32", (2, 4)), TensorMeta("bfloat16", (2, 4))
I64 = TensorMeta("int64", (2,))
CAST = "aten._to_copy.default"


def fn(i, func, ins, outs, source="toy.py:1", autocast=None, module="m"):
    return FunctionCall(i, func, module, "forward", ins, outs, source, autocast)


def op(i, name, ins, outs, caller=0, autocast_cast=False, names=None, module="m", source="toy.py:1"):
    return OpCall(i, name, module, "forward", ins, outs, autocast_cast, caller, source,
                  names or (None,) * len(ins))


def toy(calls, ops, **kw) -> Trace:
    return Trace(model=ModelInfo("toy", "Toy", 1), setting=setting_record("fp32+amp-bf16"),
                 workload="forward", calls=calls, ops=ops, **kw)


def only_change(trace):
    [change] = dtype_changes(trace)
    return change


def texts(trace):
    return [f.text for f in derive_findings(trace)]


@pytest.mark.fast
def test_autocast_cast_to_the_autocast_dtype_is_the_lower_precision_list():
    t = toy([fn(0, "torch.nn.functional.linear", (F32, F32), (BF16,), autocast="bfloat16")],
            [op(0, CAST, (F32,), (BF16,), autocast_cast=True, names=("m.weight",))])
    c = only_change(t)
    assert (c.cause, c.detail, c.function, c.inputs, c.output) == (
        "autocast-policy", "lower-precision list", "linear", ("float32",), "bfloat16")


@pytest.mark.fast
def test_autocast_cast_to_float32_is_the_float32_list():
    t = toy([fn(0, "torch.nn.functional.layer_norm", (BF16,), (F32,), "toy.py:4", "bfloat16")],
            [op(0, CAST, (BF16,), (F32,), autocast_cast=True, source="toy.py:4")])
    assert (only_change(t).cause, only_change(t).detail) == ("autocast-policy", "float32 list")
    assert ("layer_norm runs in float32 under autocast: autocast policy (float32 list; 1 cast, "
            "at toy.py:4).") in texts(t)


@pytest.mark.fast
def test_explicit_cast_names_its_line():
    t = toy([fn(0, "Tensor.float", (BF16,), (F32,), "model.py:245", "bfloat16")],
            [op(0, CAST, (BF16,), (F32,), source="model.py:245")])
    c = only_change(t)
    assert (c.cause, c.detail, c.source) == ("explicit-cast", "Tensor.float", "model.py:245")


@pytest.mark.fast
def test_mixed_activations_are_type_promotion():
    t = toy([fn(0, "Tensor.add", (F32, BF16), (F32,), "model.py:80", module="h.0")],
            [op(0, "aten.add.Tensor", (F32, BF16), (F32,), module="h.0", source="model.py:80")])
    assert only_change(t).cause == "type-promotion"
    assert "add float32 + bfloat16 → float32: type promotion (1× in h.0, at model.py:80)." in texts(t)


@pytest.mark.fast
def test_a_parameter_that_decides_the_output_is_parameter_dtype():
    """An embedding whose weight is bf16 turns int ids into bf16."""
    t = toy([fn(0, "torch.nn.functional.embedding", (I64, BF16), (BF16,), "model.py:9")],
            [op(0, "aten.embedding.default", (BF16, I64), (BF16,), names=("wte.weight", None),
                source="model.py:9")],
            parameters=[ParameterRecord("wte.weight", "bfloat16", (4, 4), True, None)])
    c = only_change(t)
    assert (c.cause, c.detail) == ("parameter-dtype", "wte.weight")
    assert ("embedding turns int64 into bfloat16: parameter wte.weight is bfloat16 "
            "(at model.py:9).") in texts(t)


@pytest.mark.fast
def test_a_buffer_that_decides_the_output_is_buffer_dtype():
    t = toy([fn(0, "Tensor.mul", (BF16, F32), (F32,))],
            [op(0, "aten.mul.Tensor", (BF16, F32), (F32,), names=(None, "rope.cos"))],
            buffers=[BufferRecord("rope.cos", "float32", (2, 4), False)])
    assert (only_change(t).cause, only_change(t).detail) == ("buffer-dtype", "rope.cos")


@pytest.mark.fast
def test_a_parameter_promoted_to_the_activations_dtype_is_type_promotion():
    t = toy([fn(0, "Tensor.mul", (F32, BF16), (F32,))],
            [op(0, "aten.mul.Tensor", (F32, BF16), (F32,), names=(None, "scale"))],
            parameters=[ParameterRecord("scale", "bfloat16", (4,), True, None)])
    assert (only_change(t).cause, only_change(t).detail) == ("type-promotion",
                                                             "scale promoted to float32")


@pytest.mark.fast
def test_a_functions_own_round_trip_is_op_defined_not_autocast():
    """rms_norm upcasts a bf16 input, computes and casts back, with autocast on or off:
    autocast never casts a result, so neither cast is autocast's."""
    t = toy([fn(0, "torch.nn.functional.rms_norm", (BF16,), (BF16,), autocast="bfloat16")],
            [op(0, CAST, (BF16,), (F32,), autocast_cast=True),
             op(1, "aten.mul.Tensor", (F32, F32), (F32,)),
             op(2, CAST, (F32,), (BF16,), autocast_cast=True)])
    changes = dtype_changes(t)
    assert [(c.op_index, c.cause) for c in changes] == [(0, "op-defined"), (2, "op-defined")]
    assert changes[0].detail == "rms_norm computes in float32 and casts its result back"
    assert not any(f.startswith("Autocast inserted") for f in texts(t))


@pytest.mark.fast
def test_saved_statistics_and_same_dtype_ops_are_no_change():
    t = toy([fn(0, "torch.nn.functional.scaled_dot_product_attention", (BF16,) * 3, (BF16,))],
            [op(0, "aten._scaled_dot_product_flash_attention_for_cpu.default", (BF16,) * 3,
                (BF16, F32)),
             op(1, "aten.mm.default", (BF16, BF16), (BF16,))])
    assert dtype_changes(t) == []


@pytest.mark.fast
def test_autocast_weight_casts_say_every_linear():
    mods = [ModuleCall(0, "", "Net", "forward", 0, (F32,), (BF16,)),
            ModuleCall(1, "a", "Linear", "forward", 1, (F32,), (BF16,)),
            ModuleCall(2, "b", "Linear", "forward", 1, (BF16,), (BF16,))]
    calls = [fn(0, "torch.nn.functional.linear", (F32, F32), (BF16,), autocast="bfloat16",
                module="a"),
             fn(1, "torch.nn.functional.linear", (BF16, F32), (BF16,), autocast="bfloat16",
                module="b")]
    ops = [op(0, CAST, (F32,), (BF16,), 0, True, ("a.weight",), "a"),
           op(1, CAST, (F32,), (BF16,), 0, True, (None,), "a"),
           op(2, CAST, (F32,), (BF16,), 1, True, ("b.weight",), "b")]
    params = [ParameterRecord(f"{n}.weight", "float32", (2, 4), True, None) for n in "ab"]
    t = toy(calls, ops, modules=mods, parameters=params)
    assert ("Autocast inserted 3 casts in the forward pass (0.00 MB): 3 to bfloat16; among them "
            "the weights of every Linear to bfloat16 (2 casts, 0.00 MB) (the parameters "
            "themselves keep their dtype).") in texts(t)
    [flow] = [f for f in derive_findings(t) if f.text.startswith("Activations")]
    assert (flow.text, flow.cause) == ("Activations are bfloat16 out of every module "
                                       "(3 module calls).", "autocast-policy")


# --- real traces ----------------------------------------------------------------------------


def line_of(func, needle: str) -> str:
    """`file.py:line` of the first line of `func` that contains `needle`."""
    lines, start = inspect.getsourcelines(func)
    [offset] = [i for i, line in enumerate(lines) if needle in line][:1]
    return f"{os.path.basename(inspect.getsourcefile(func))}:{start + offset}"


def assert_one_cause_each(trace: Trace) -> None:
    """Every forward op that changes a floating dtype is in dtype_changes, once, with a known
    cause; `op-defined` only for a function's own compute-and-cast-back round trip."""
    changes = dtype_changes(trace)
    indices = [c.op_index for c in changes]
    assert len(indices) == len(set(indices))
    for o in trace.ops:
        if o.phase != "forward":
            continue
        out = next((m.dtype for m in o.outputs if m.dtype in FLOATS), None)
        if out and any(m.dtype in FLOATS and m.dtype != out for m in o.inputs):
            assert o.index in indices, o
    for c in changes:
        assert c.cause in CAUSES
        if c.cause == "op-defined":
            assert c.detail.endswith("casts its result back"), c


def finding(trace: Trace, cause: str, needle: str):
    matches = [f for f in trace.findings if f.cause == cause and needle in f.text]
    assert matches, [f.text for f in trace.findings]
    return matches[0]


@pytest.fixture(scope="module")
def nanochat_amp():
    torch.manual_seed(0)
    return ampscope.trace(nanochat.load("nanochat-tiny"), setting="fp32+amp-bf16",
                          workload="train", seq=8)


@pytest.fixture(scope="module")
def gpt2_amp():
    torch.manual_seed(0)
    return ampscope.trace(gpt2.load("gpt2-tiny"), setting="fp32+amp-bf16", workload="train",
                          seq=8)


def test_nanochat_amp_causes(nanochat_amp):
    t = nanochat_amp
    assert_one_cause_each(t)
    # the bf16 attention / MLP branch added to the float32 residual stream
    residual = line_of(nanochat.Block.forward, "x = x + self.attn(")
    f = finding(t, "type-promotion", "add float32 + bfloat16 → float32")
    assert f.source == residual
    # logits cast to float32 before the loss, by the model's own .float()
    cast = line_of(nanochat.GPT.forward, "logits.float()")
    f = finding(t, "explicit-cast", "bfloat16 → float32 by an explicit float()")
    assert f.source == cast and cast in f.text
    finding(t, "autocast-policy", "linear runs in bfloat16 under autocast: autocast policy "
                                  "(lower-precision list")
    finding(t, "autocast-policy", "among them the weights of every Linear to bfloat16")
    # rms_norm's own float32 round trip is not counted among autocast's casts
    assert {c.function for c in dtype_changes(t) if c.cause == "op-defined"} == {"rms_norm"}


@pytest.mark.fast
def test_gpt2_amp_causes(gpt2_amp):
    t = gpt2_amp
    assert_one_cause_each(t)
    residual = line_of(gpt2.Block.forward, "x = x + self.attn(")
    f = finding(t, "type-promotion", "add float32 + bfloat16 → float32")
    assert f.source == residual
    assert [c.cause for c in dtype_changes(t) if c.source == residual] == ["type-promotion"] * 2
    finding(t, "autocast-policy", "cross_entropy runs in float32 under autocast: autocast policy "
                                  "(float32 list")
    finding(t, "autocast-policy", "the weights of every Linear and the biases of every Linear "
                                  "that has one to bfloat16")
    assert not [c for c in dtype_changes(t) if c.cause == "op-defined"]


class HalfHead(nn.Module):
    """A model with a deliberate `.half()` in its forward, then a float32 scale parameter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h.half()
        return h * self.scale


@pytest.mark.fast
def test_a_deliberate_half_names_this_file_and_line():
    model = HalfHead()
    with ampscope.capture(model) as t:
        model(torch.randn(2, 4))
    assert_one_cause_each(t)
    half = line_of(HalfHead.forward, "h.half()")
    assert half.startswith("test_causes.py:")
    f = finding(t, "explicit-cast", "float32 → float16 by an explicit half()")
    assert f.source == half and half in f.text
    # float16 activations times a float32 parameter: the parameter decides the output
    scale = line_of(HalfHead.forward, "h * self.scale")
    [c] = [c for c in dtype_changes(t) if c.source == scale]
    assert (c.cause, c.detail, c.output) == ("parameter-dtype", "scale", "float32")


def test_nanochat_d4_findings_on_cpu():
    """The issue's list for nanochat-d4 (fp32 parameters, bf16 autocast), derived from traces."""
    import ampscope
    import ampscope.models.nanochat as nc

    train = ampscope.trace("nanochat-d4", setting="fp32+amp-bf16", seq=16)
    sample = ampscope.trace("nanochat-d4", setting="fp32+amp-bf16", workload="generate", seq=8)
    texts = {f.text: f for f in train.findings}
    assert "All 26 parameters are float32." in texts
    assert "Buffers cos, sin are bfloat16." in texts
    assert "Inputs: idx int32, targets int64." in texts
    assert "Inputs: idx int64." in {f.text for f in sample.findings}
    float_line = 1 + next(i for i, line in enumerate(
        Path(nc.__file__).read_text().splitlines()) if "logits = logits.float()" in line)
    cast = texts[f"bfloat16 → float32 by an explicit float() at nanochat.py:{float_line}."]
    assert cast.cause == "explicit-cast" and cast.source == f"nanochat.py:{float_line}"
    assert any(t.startswith("Activations are float32 out of transformer.wte, enter bfloat16 at "
                            "transformer.h.0.attn.c_q") for t in texts)
    assert any(t.startswith("add float32 + bfloat16 → float32: type promotion (4× in "
                            "transformer.h.0–3") for t in texts)
    assert any(t.startswith("Autocast inserted") and
               "among them the weights of every Linear to bfloat16" in t for t in texts)
    assert "Gradients have their parameters' dtypes (26 gradients)." in texts
    assert "The loss is float32." in texts
