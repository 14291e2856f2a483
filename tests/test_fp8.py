"""fp8 training settings (`+fp8[-RECIPE]`, torchao float8): what the trace records against a
run written by hand, the findings, the costs, and the user's state afterwards.

Ground truth: the same model, converted by hand with torchao's `convert_to_float8_training`
and run outside ampscope under a plain TorchDispatchMode, which records every cast into a
float8 dtype and, for each matmul, the dtype of the fp8 data its operands hold (read from
torchao's own `Float8TrainingTensor._data`).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampscope
from ampscope.analysis.flow import op_flow
from ampscope.errors import AmpscopeError
from ampscope.precision import fp8, parse_setting
from tests.test_state import assert_same, snapshot

needs_torchao = pytest.mark.skipif(not fp8.available(), reason="torchao is not installed")
BATCH, IN, HIDDEN, CLASSES = 16, 32, 64, 10
FP8 = ("float8_e4m3fn", "float8_e5m2")


class MLP(nn.Module):
    """Two Linear layers with dims that are multiples of 16, and a head (32 → 10) whose are not."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)
        self.head = nn.Linear(IN, CLASSES)

    def forward(self, x, y=None):
        out = self.head(torch.relu(self.down(torch.relu(self.up(x)))))
        return out if y is None else nn.functional.cross_entropy(out, y)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


class Fp8Ops(TorchDispatchMode):
    """Casts into fp8 (phase, dtype, shape) and matmuls' fp8 operand dtypes, by phase."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.casts: list[tuple] = []
        self.matmuls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and str(out.dtype)[6:] in FP8:
            self.casts.append((self.phase, str(out.dtype)[6:], tuple(out.shape)))
        if func is torch.ops.aten.mm.default:
            from torchao.float8 import Float8TrainingTensor
            self.matmuls.append((self.phase, tuple(
                str(a._data.dtype)[6:] if isinstance(a, Float8TrainingTensor) else str(a.dtype)[6:]
                for a in args[:2])))
        return out


def by_hand(model: nn.Module, recipe: str) -> Fp8Ops:
    """torchao's conversion and one forward and backward, written as a training script would."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = copy.deepcopy(model)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda m, _: all(d % 16 == 0 for d in m.weight.shape))
    x, y = batch()
    seen = Fp8Ops()
    with seen:
        loss = model(x, y)
        seen.phase = "backward"
        loss.backward()
    return seen


def traced(t) -> tuple[list, list]:
    casts = [(o.phase, o.outputs[0].dtype, o.outputs[0].shape) for o in t.ops
             if o.op == "aten._to_copy.default" and o.outputs[0].dtype in FP8]
    matmuls = [(o.phase, tuple(d or m.dtype for d, m in
                               zip(o.input_data or (None,) * len(o.inputs), o.inputs, strict=True)))
               for o in t.ops if o.op == "aten.mm.default"]
    return casts, matmuls


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("predict", [True, False])
def test_fp8_casts_and_matmuls_agree_with_a_hand_run(recipe, predict):
    torch.manual_seed(0)
    model = MLP()
    expected = by_hand(model, recipe)
    t = ampscope.trace(model, batch(), setting=f"fp32+fp8-{recipe}", workload="train",
                       predict=predict)
    casts, matmuls = traced(t)
    assert casts == expected.casts
    assert matmuls == expected.matmuls
    forward = {d for p, d, _ in casts if p == "forward"}
    assert forward == {"float8_e4m3fn"}  # inputs and weights
    backward = {d for p, d, _ in casts if p == "backward"}
    # Output gradients: float8_e5m2 in the tensorwise recipe, float8_e4m3fn in rowwise.
    assert backward == ({"float8_e5m2", "float8_e4m3fn"} if recipe == "tensorwise"
                        else {"float8_e4m3fn"})
    # The head's backward mms (and only they) ran in float32; its forward is an addmm.
    assert [p for p, pair in matmuls if pair == ("float32", "float32")] == ["backward"] * 2


@needs_torchao
def test_the_findings_say_what_ran_in_fp8_and_what_was_left_out():
    t = ampscope.trace(MLP(), batch(), setting="fp32+fp8", workload="train")
    texts = [f.text for f in t.findings if f.cause == "fp8-training"]
    assert texts[0] == (
        "2 of 3 Linear layers run their matmuls in fp8, recipe tensorwise: forward 2 "
        "float8_e4m3fn × float8_e4m3fn; backward 4 float8_e5m2 × float8_e4m3fn (emulated: the "
        "operands hold real fp8 values, the matmul runs on them in higher precision).")
    assert texts[1].startswith("Casts to fp8 (0.01 MB): inputs and weights to float8_e4m3fn "
                               "in forward; output gradients to float8_e5m2, weights and inputs "
                               "again to float8_e4m3fn in backward (forward 4 float8_e4m3fn; "
                               "backward 4 float8_e5m2, 4 float8_e4m3fn); each with a float32 "
                               "scale from the tensor's amax (12 tensorwise);")
    assert texts[2] == ("head stays in higher precision: left out by the module filter (dims "
                        "not multiples of 16: head 10×32).")
    # the op table marks the casts and the fp8 operands (which show float32 outside)
    notes = {(r.kind, r.note) for r in op_flow(t.ops, "forward")}
    assert {("aten._to_copy.default", "fp8 cast"), ("aten.mm.default", "fp8 data e4m3 × e4m3")
            } <= notes
    assert ("aten.mm.default", "fp8 data e5m2 × e4m3") in {
        (r.kind, r.note) for r in op_flow(t.ops, "backward")}
    # torchao's own casts (to float64 for the scales, and back) are no explicit-cast findings
    assert not any("float64" in f.text for f in t.findings if f.cause == "explicit-cast")


@needs_torchao
def test_fp8_casts_and_scales_are_memory_categories_and_fp8_flops_count_as_fp8():
    t = ampscope.trace(MLP(), batch(), setting="fp32+fp8", workload="train")
    expected = by_hand(MLP(), "tensorwise")
    cast_bytes = sum(torch.Size(shape).numel() for _, _, shape in expected.casts)  # 1 B each
    storages = [s for s in t.storages if s.category == "fp8_cast"]
    assert sum(s.nbytes for s in storages) == cast_bytes
    assert {s.dtype for s in storages} == {"float8_e4m3fn", "float8_e5m2"}
    scales = [s for s in t.storages if s.category == "fp8_scale"]
    assert len(scales) == len(expected.casts) and {(s.dtype, s.nbytes) for s in scales} == {
        ("float32", 4)}  # one float32 number per cast (tensorwise)
    report = ampscope.flops(MLP(), batch(), setting="fp32+fp8")
    per_matmul = 2 * BATCH * IN * HIDDEN  # up and down: forward, grad input, grad weight
    fp8_flops = sum(f for d, f in report.by_dtype.items() if d.startswith("float8"))
    assert fp8_flops == 2 * 3 * per_matmul
    assert report.by_dtype["float32"] == 3 * 2 * BATCH * IN * CLASSES  # the head


@needs_torchao
@pytest.mark.parametrize("predict", [True, False])
def test_the_users_model_and_torch_come_back_exactly(predict, monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    model.up.register_forward_hook(lambda m, i, o: None)
    model.down.weight.grad = torch.full_like(model.down.weight, 0.5)
    children = [(n, m) for n, m in model.named_modules()]
    # convert_to_float8_training patches inductor's codegen once per process: start from an
    # unpatched process (an earlier test may have converted by hand) and see that it still is.
    from torch._inductor.codegen.triton import TritonOverrides
    from torchao.float8 import _inductor_patch

    monkeypatch.setattr(_inductor_patch, "_PATCHED", False)
    codegen = (staticmethod(lambda a, b: "min"), staticmethod(lambda a, b: "max"))
    monkeypatch.setattr(TritonOverrides, "minimum", codegen[0])
    monkeypatch.setattr(TritonOverrides, "maximum", codegen[1])
    before = snapshot(model)
    t = ampscope.trace(model, batch(), setting="fp32+amp-bf16+fp8-rowwise", predict=predict)
    assert any(m.type == "Float8Linear" for m in t.modules)  # it did run converted
    assert_same(before, snapshot(model))
    assert [(n, m) for n, m in model.named_modules()] == children  # the same module objects
    assert all(type(m) is nn.Linear for m in (model.up, model.down, model.head))
    assert (TritonOverrides.__dict__["minimum"], TritonOverrides.__dict__["maximum"]) == codegen
    assert _inductor_patch._PATCHED is False


@needs_torchao
def test_fp8_settings_name_torchaos_recipes():
    from torchao.float8 import Float8LinearRecipeName

    assert parse_setting("fp32+amp-bf16+fp8").name == "fp32+amp-bf16+fp8-tensorwise"
    assert parse_setting("CUDA:bf16+fp8-rowwise").name == "cuda:bf16+fp8-rowwise"
    for recipe in Float8LinearRecipeName:
        s = parse_setting("fp32+fp8-" + recipe.value.replace("_", "-"))
        assert s.fp8 == recipe.value and s.record().to_dict()["fp8"] == recipe.value
    assert parse_setting("fp32").record().to_dict()["fp8"] is None
    with pytest.raises(AmpscopeError, match="unknown fp8 recipe 'blockwise'.*torchao offers "
                                            "tensorwise, rowwise"):
        parse_setting("fp32+fp8-blockwise")
    with pytest.raises(AmpscopeError, match="repeated part"):
        parse_setting("fp32+fp8+fp8-rowwise")


@needs_torchao
def test_a_model_without_a_convertible_linear_is_refused():
    model = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 1))
    with pytest.raises(AmpscopeError, match="nothing would run in fp8"):
        ampscope.trace(model, torch.randn(4, 10), setting="fp32+fp8", workload="forward")


@needs_torchao
def test_a_high_precision_grad_weight_recipe_under_cpu_autocast_is_refused_with_what_runs():
    # torchao casts a Float8Linear's input to the autocast dtype only under CUDA's autocast:
    # under the CPU's its high-precision weight-gradient matmul would mix fp32 and bf16.
    with pytest.raises(AmpscopeError) as e:
        ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16+fp8-rowwise-with-gw-hp", seq=16)
    assert str(e.value) == (
        "fp8 recipe rowwise-with-gw-hp fails under CPU autocast (torchao casts inputs only "
        "under CUDA's); use cuda:fp32+amp-bf16+fp8-rowwise-with-gw-hp (emulated) or "
        "fp32+fp8-rowwise-with-gw-hp")
    for setting in ("cuda:fp32+amp-bf16+fp8-rowwise-with-gw-hp", "fp32+fp8-rowwise-with-gw-hp"):
        trace = ampscope.trace("gpt2-tiny", setting=setting, seq=16)  # what it offers runs
        assert any(o.op == "aten._to_copy.default" and o.outputs[0].dtype == "float8_e4m3fn"
                   for o in trace.ops)


def test_fp8_without_torchao_says_how_to_install_it(monkeypatch):
    import importlib.util

    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(fp8, "_quiet_import", missing)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AmpscopeError) as e:
        parse_setting("fp32+fp8")
    assert str(e.value) == ("fp8 settings need torchao: pip install 'ampscope[fp8]' "
                            "(torchao==0.18.0, installed with --no-deps)")


def test_fp8_with_a_torchao_that_cannot_import_on_this_torch_says_which_torch_it_needs(
        monkeypatch):
    """torchao 0.18.0 installed next to torch 2.9 fails to import (it asks torch for names
    2.10 added): the one line names the torch it needs, not an install that is there."""
    import importlib.util

    def too_new(name):
        raise ImportError("cannot import name 'ScalingType' from 'torch.nn.functional'")

    monkeypatch.setattr(fp8, "_quiet_import", too_new)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    with pytest.raises(AmpscopeError) as e:
        parse_setting("fp32+fp8")
    message = str(e.value)
    assert message.startswith("fp8 settings need torchao, which is installed but does not "
                              f"import on torch {torch.__version__}")
    assert "ScalingType" in message and message.endswith("needs torch 2.10 or newer")


@needs_torchao
def test_numerics_sees_the_fp8_rounding_of_the_converted_layers():
    """float8_e4m3fn keeps 3 mantissa bits (unit roundoff 2**-4): a converted layer's output
    drifts from the fp64 run by percents, where fp32's drifts by ~1e-7."""
    report = ampscope.numerics("gpt2-tiny", settings=["fp32", "fp32+fp8"], seq=16)
    up = {s.setting: next(m.divergence.rel_l2 for m in s.modules
                          if m.name == "transformer.h.0.mlp.c_fc")
          for s in report.settings}
    assert up["fp32"] < 1e-5
    assert 2**-9 < up["fp32+fp8-tensorwise"] < 2**-2


@needs_torchao
def test_a_model_the_user_converted_is_traced_as_it_is():
    """A script that calls convert_to_float8_training itself: capture only watches, and the
    findings read the fp8 facts off the ops."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = MLP()
    convert_to_float8_training(
        model, config=dataclasses.replace(Float8LinearConfig(), emulate=True),
        module_filter_fn=lambda m, _: all(d % 16 == 0 for d in m.weight.shape))
    x, y = batch()
    with ampscope.capture(model) as t:
        model(x, y).backward()
    texts = [f.text for f in t.findings if f.cause == "fp8-training"]
    assert texts[0] == ("2 of 3 Linear layers run their matmuls in fp8: forward 2 float8_e4m3fn "
                        "× float8_e4m3fn; backward 4 float8_e5m2 × float8_e4m3fn.")
    assert type(model.up).__name__ == "Float8Linear"  # left as the user made it


@needs_torchao
def test_the_fp8_trace_json_is_what_its_schema_declares(capsys):
    from ampscope import schemas
    from ampscope.cli import main
    from tests.test_json_schema import _errors, _exact

    assert main(["trace", "gpt2-tiny", "-s", "fp32+amp-bf16+fp8", "--seq", "8", "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert _errors(document, _exact(schemas.load("trace"))) == []
    assert document["setting"]["fp8"] == "tensorwise"
    matmuls = [o["in_data"] for o in document["ops"] if o["op"] == "aten.mm.default"]
    assert ["float8_e4m3fn", "float8_e4m3fn"] in matmuls
    assert {f["cause"] for f in document["findings"]} >= {"fp8-training"}
