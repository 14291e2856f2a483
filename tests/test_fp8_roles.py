"""Which operand of each fp8 matmul is an input, a weight or an output gradient, and the
findings that say so in words.

Ground truth: torchao's own label on each fp8 operand (`Float8TrainingTensor._gemm_input_role`,
set by the Linear layer that cast it), read in a run of the same model converted by hand.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampscope
from ampscope.analysis.fp8 import fp8_step, roles_in_words
from ampscope.precision import fp8
from ampscope.records.fp8 import GemmRoles

needs_torchao = pytest.mark.skipif(not fp8.available(), reason="torchao is not installed")
TOKENS = 16
NAMES = {"input": "input", "weight": "weight", "grad_output": "output gradient"}


class TwoLayers(nn.Module):
    """The first layer's out_features equal the tokens (16): its backward matmuls' operands
    look alike by shape, the case the matmuls' order decides."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, TOKENS)
        self.b = nn.Linear(TOKENS, 32)

    def forward(self, x, y=None):
        out = self.b(torch.relu(self.a(x)))
        return out if y is None else nn.functional.mse_loss(out, y)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(TOKENS, 32, generator=g), torch.randn(TOKENS, 32, generator=g)


class Roles(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torchao.float8 import Float8TrainingTensor

        if func is torch.ops.aten.mm.default:
            self.seen.append((self.phase, tuple(
                (NAMES[a._gemm_input_role.value], str(a._data.dtype)[6:])
                if isinstance(a, Float8TrainingTensor) else None for a in args[:2])))
        return func(*args, **(kwargs or {}))


def by_hand(model: nn.Module, recipe: str) -> list[tuple]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = copy.deepcopy(model)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config)
    seen = Roles()
    with seen:
        loss = model(*batch())
        seen.phase = "backward"
        loss.backward()
    return seen.seen


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_matmul_operand_roles_agree_with_torchaos_labels(recipe):
    torch.manual_seed(0)
    model = TwoLayers()
    expected = by_hand(model, recipe)
    t = ampscope.trace(model, batch(), setting=f"fp32+fp8-{recipe.replace('_', '-')}",
                       workload="train")
    weights = {p.name.removesuffix(".weight"): p.shape for p in t.parameters}
    roles, got = GemmRoles(), []
    for o in t.ops:
        if o.op == "aten.mm.default":
            named = roles.of(o.phase, o.module, o.inputs[0].shape, o.outputs[0].shape,
                             weights.get(o.module or ""))
            data = o.input_data or (None, None)
            got.append((o.phase, tuple((r, d) if d is not None else None
                                       for r, d in zip(named, data, strict=True))))
    assert got == expected
    assert any(o.inputs[0].shape == (TOKENS, TOKENS) for o in t.ops  # the look-alike case ran
               if o.op == "aten.mm.default" and o.phase == "backward" and o.module == "a")


@needs_torchao
@pytest.mark.parametrize(("recipe", "words"), [
    ("tensorwise", "inputs and weights to float8_e4m3fn in forward; output gradients to "
                   "float8_e5m2, weights and inputs again to float8_e4m3fn in backward"),
    ("rowwise", "inputs and weights to float8_e4m3fn in forward; output gradients, weights and "
                "inputs to float8_e4m3fn in backward"),
    # the weight's gradient is computed in high precision: only its input gradient's operands
    ("rowwise-with-gw-hp", "inputs and weights to float8_e4m3fn in forward; output gradients "
                           "and weights to float8_e4m3fn in backward"),
])
def test_the_findings_say_which_operands_were_cast_to_which_format(recipe, words):
    t = ampscope.trace(TwoLayers(), batch(), setting=f"fp32+fp8-{recipe}",
                       workload="train")
    assert roles_in_words(fp8_step(t).roles) == words
    cast = next(f.text for f in t.findings if f.text.startswith("Casts to fp8"))
    assert cast.split(": ", 1)[1].startswith(words + " (forward 4 float8_e4m3fn; backward ")


@needs_torchao
def test_the_modules_table_and_the_diagram_say_the_matmul_ran_in_fp8():
    """A Float8Linear shows float32 in and out (fp32 setting): the modules table and the diagram
    add the fp8 formats its operands held (e4m3 × e4m3 in forward, in every recipe), and the
    diagram draws it as one linear step, without the recipe's casts for its scales."""
    from ampscope.analysis.diagram import build_diagram
    from ampscope.analysis.summary import trace_summary

    t = ampscope.trace(TwoLayers(), batch(), setting="fp32+fp8-rowwise", workload="train")
    rows = {r.name: r for r in trace_summary(t).modules}
    assert {n: (r.inputs, r.outputs, r.note) for n, r in rows.items() if r.kind == "Float8Linear"
            } == {"a": (("float32",), ("float32",), "matmul in fp8 e4m3 × e4m3"),
                  "b": (("float32",), ("float32",), "matmul in fp8 e4m3 × e4m3")}
    steps = [s for section in build_diagram(t).sections for s in section.steps]
    assert [(s.func, s.module, s.note) for s in steps if s.module in ("a", "b")] == [
        ("linear", "a", "matmul in fp8 e4m3 × e4m3"), ("linear", "b", "matmul in fp8 e4m3 × e4m3")]
    # without +fp8 the same layers are plain linears with no note
    plain = ampscope.trace(TwoLayers(), batch(), setting="fp32", workload="train")
    assert {r.note for r in trace_summary(plain).modules if r.name in ("a", "b")} == {""}
