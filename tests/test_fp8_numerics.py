"""`numerics` with fp8 settings: each cast into fp8 counted at the scale the recipe used.

Ground truth: a tensor built so that the counts follow by hand. float8_e4m3fn's max is 448 and
its smallest subnormal 2**-9, so a value underflows (rounds to 0) when |x · scale| < 2**-10.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampscope
from ampscope.precision import fp8

needs_torchao = pytest.mark.skipif(not fp8.available(), reason="torchao is not installed")
N = 16


def outliers() -> torch.Tensor:
    """16 rows of 16: row 0 holds one outlier, 4096, among ones; row 1 only small values, 0.004;
    the other rows ones. Tensorwise, the one scale is 448 / 4096 = 0.109375, and row 1 becomes
    0.004 · 0.109375 = 0.0004375 < 2**-10 ≈ 0.000977: its 16 values underflow. Rowwise, row 1
    gets its own scale (448 / 0.004, rounded down to a power of 2: 65536), 0.004 · 65536 ≈ 262
    is kept; row 0's scale (0.109375 rounded down: 0.0625) keeps its ones at 0.0625, a normal
    e4m3 number (≥ 2**-6). Nothing saturates: a dynamic scale maps the amax to at most 448."""
    x = torch.ones(N, N)
    x[0, 0] = 4096.0
    x[1] = 0.004
    return x


@needs_torchao
@pytest.mark.parametrize(("recipe", "underflow"), [("tensorwise", N), ("rowwise", 0)])
def test_fp8_casts_count_what_saturates_and_underflows_at_the_recipes_scale(recipe, underflow):
    # the hand computation's premises, checked against torch
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    assert e4m3.max == 448 and e4m3.tiny * e4m3.eps == 2**-9
    assert 0.004 * 448 / 4096 < 2**-10 < 1.0 * 0.0625
    model = nn.Sequential(nn.Linear(N, N, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(N))  # 16 non-zero values, all 1: none is lost
    report = ampscope.numerics(model, outliers(), settings=[f"fp32+fp8-{recipe}"],
                                 reference="fp32")
    casts = {(c.phase, c.role): c for c in report.settings[0].fp8_casts}
    assert set(casts) == {("forward", "input"), ("forward", "weight")}
    x, w = casts[("forward", "input")], casts[("forward", "weight")]
    assert (x.module, x.dtype, x.granularity, x.casts) == ("0", "float8_e4m3fn", recipe, 1)
    assert (x.numel, x.nonzero, x.saturated, x.underflow) == (N * N, N * N, 0, underflow)
    assert x.underflow_share == underflow / (N * N)
    assert (w.numel, w.nonzero, w.saturated, w.underflow) == (N * N, N, 0, 0)
    # the report says the same in its JSON
    row = next(r for r in report.to_dict()["settings"][0]["fp8_casts"] if r["role"] == "input")
    assert (row["underflow"], row["underflow_share"]) == (underflow, underflow / (N * N))


@needs_torchao
def test_fp8_casts_of_a_train_step_by_operand_side_by_side(capsys):
    """Tensorwise casts output gradients to float8_e5m2, rowwise to float8_e4m3fn; inputs and
    weights are float8_e4m3fn in both, in forward and again in backward. Every cast feeds a
    matmul (no operand left unknown), and the JSON is what the schema declares."""
    from ampscope import schemas
    from ampscope.cli import main
    from tests.test_json_schema import _errors, _exact

    settings = "fp32+amp-bf16+fp8-tensorwise,fp32+amp-bf16+fp8-rowwise"
    assert main(["numerics", "gpt2-tiny", "--seq", "8", "--workload", "train", "--settings",
                 settings, "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert _errors(document, _exact(schemas.load("numerics"))) == []
    formats = [{(c["phase"], c["role"], c["dtype"], c["granularity"]) for c in s["fp8_casts"]}
               for s in document["settings"]]
    for found, recipe, grad in zip(formats, ("tensorwise", "rowwise"),
                                   ("float8_e5m2", "float8_e4m3fn"), strict=True):
        assert found == {("forward", "input", "float8_e4m3fn", recipe),
                         ("forward", "weight", "float8_e4m3fn", recipe),
                         ("backward", "output gradient", grad, recipe),
                         ("backward", "weight", "float8_e4m3fn", recipe),
                         ("backward", "input", "float8_e4m3fn", recipe)}
    # gpt2-tiny's 9 converted layers (2 blocks of 4, and lm_head: 256 × 64): forward 2 casts
    # each, backward 4 (the output gradient twice: for the input's and the weight's gradient)
    for s in document["settings"]:
        assert sum(c["casts"] for c in s["fp8_casts"]) == 9 * 6
    # no fp8 part, no fp8 casts
    assert main(["numerics", "gpt2-tiny", "--seq", "8", "--settings", "fp32", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"][0]["fp8_casts"] == []
