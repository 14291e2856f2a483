"""AMP301 constant-overflows and AMP302 constant-vanishes (analysis/checks/constants.py), and the
Python numbers the op records keep for them (OpCall.scalars): each rule on a small script that
makes the mistake, run for real on the CPU, on the virtual CUDA device and predicted, asserting
its id, severity and evidence; the corrected script, silent; the numbers recorded for a few ops,
written as JSON and read back."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator

import ampscope
from ampscope import schemas
from ampscope.errors import AmpscopeError
from ampscope.records import Trace
from ampscope.script import run_script

# (device, predict): a real run on this CPU, the virtual CUDA device, a predicted CUDA run.
MODES = [pytest.param(None, False, id="cpu"), pytest.param("cuda", False, id="virtual-cuda"),
         pytest.param("cuda", True, id="predicted")]

# Attention scores in float16, masked by {mask}.
_ATTENTION = """\
import torch
import torch.nn as nn
dev = "cuda" if torch.cuda.is_available() else "cpu"


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x, mask):
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-2, -1)
{mask}
        return scores.float().softmax(-1)


model = Attention().to(dev){cast}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(2, 4, 8, device=dev){cast}
mask = torch.ones(4, 4, dtype=torch.bool, device=dev).triu(1)
model(x, mask).sum().backward()
opt.step()
"""

# An RMS norm of float16 activations: {norm} computes `ms`, the mean square plus eps.
_NORM = """\
import torch
import torch.nn as nn
dev = "cuda" if torch.cuda.is_available() else "cpu"


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        x = self.proj(x)
{norm}
        return x * torch.rsqrt(ms).to(x.dtype)


model = Norm().to(dev){cast}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8, device=dev){cast}
{forward}
out.float().square().mean().backward()
opt.step()
"""


def _script(tmp_path: Path, template: str, name: str = "script.py", **parts: str) -> Path:
    defaults = {"cast": ".half()", "forward": "out = model(x)"}
    path = tmp_path / name
    path.write_text(template.format(**{**defaults, **parts}))
    return path


def _line(path: Path, needle: str) -> str:
    """"script.py:N" of the line holding `needle`, read from the file itself."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return f"{path.name}:{n}"
    raise AssertionError(needle)


def _run(path: Path, device: str | None, predict: bool) -> Trace:
    return run_script(str(path), [], device=device, predict=predict, in_process=True)


def _amp3(trace: Trace) -> list[str]:
    return [f"{d.id} {d.message}" for d in trace.diagnostics if d.id.startswith("AMP3")]


# -- AMP301

@pytest.mark.parametrize(("device", "predict"), MODES)
def test_float32_min_on_float16_scores_overflows(tmp_path, device, predict):
    # torch.where makes its constant a float16 scalar without a range check: -inf everywhere.
    bad = _script(tmp_path, _ATTENTION, mask="        scores = torch.where("
                  "mask, torch.finfo(torch.float32).min, scores)")
    trace = _run(bad, device, predict)
    [d] = [d for d in trace.diagnostics if d.id == "AMP301"]
    assert (d.name, d.severity) == ("constant-overflows", "error")
    assert d.source == _line(bad, "torch.where(")
    assert d.message == ("-3.40282e+38 does not fit float16 (largest finite value 65504): "
                         f"aten.scalar_tensor in the model at {d.source}.")
    assert d.evidence == ("aten.scalar_tensor on float16 stores the constant -3.40282e+38; "
                          "torch.finfo(torch.float16).max is 65504", "1 call, in the model")
    assert "-inf in float16" in d.consequence and "softmax is NaN" in d.consequence
    assert "torch.finfo(scores.dtype).min" in d.fix
    [op] = [o for o in trace.ops if o.op == "aten.scalar_tensor.default" and o.source == d.source]
    assert op.scalars == (torch.finfo(torch.float32).min,)


@pytest.mark.parametrize(("device", "predict"), MODES)
def test_masked_fill_beyond_float16_raises_and_predicted_says_so(tmp_path, device, predict):
    bad = _script(tmp_path, _ATTENTION, mask="        scores = scores.masked_fill(mask, -1e9)")
    if not predict:  # the kernel checks the value: the error AMP301 tells of beforehand
        with pytest.raises(AmpscopeError, match="value cannot be converted to type c10::Half "
                           "without overflow") as failed:
            _run(bad, device, predict)
        assert _line(bad, "masked_fill") in str(failed.value)
        return
    trace = _run(bad, device, predict)
    [d] = [d for d in trace.diagnostics if d.id == "AMP301"]
    assert d.severity == "error"
    assert d.source == _line(bad, "masked_fill")
    assert d.message.startswith("-1e+09 does not fit float16 (largest finite value 65504): "
                                "aten.masked_fill in the model at script.py:")
    assert d.evidence[0] == ("aten.masked_fill on float16 stores the constant -1e+09; "
                             "torch.finfo(torch.float16).max is 65504")
    assert ("raises RuntimeError: value cannot be converted to type c10::Half without overflow"
            in d.consequence)
    [op] = [o for o in trace.ops if o.op == "aten.masked_fill.Scalar" and o.source == d.source]
    assert op.scalars == (-1e9,)


_MASKS_THAT_FIT = """\
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        scores = scores.masked_fill(mask, float("-inf"))  # no row is masked in full
        scores = scores.float().masked_fill(mask, -1e9)"""


@pytest.mark.parametrize(("device", "predict"), MODES)
def test_constants_that_fit_are_silent(tmp_path, device, predict):
    good = _script(tmp_path, _ATTENTION, mask=_MASKS_THAT_FIT)
    assert _amp3(_run(good, device, predict)) == []
    fp32 = _script(tmp_path, _ATTENTION, "fp32.py", cast="",
                   mask="        scores = scores.masked_fill(mask, -1e9)")
    assert _amp3(_run(fp32, device, predict)) == []


# -- AMP302

_EPS_IN_FP16 = "        ms = x.pow(2).mean(-1, keepdim=True) + 1e-12"
_EPS_IN_FP32 = "        ms = x.float().pow(2).mean(-1, keepdim=True) + 1e-12"


@pytest.mark.parametrize(("device", "predict"), MODES)
def test_eps_below_float16_vanishes(tmp_path, device, predict):
    bad = _script(tmp_path, _NORM, norm=_EPS_IN_FP16)
    trace = _run(bad, device, predict)
    [d] = [d for d in trace.diagnostics if d.id == "AMP302"]
    assert (d.name, d.severity) == ("constant-vanishes", "warning")
    assert d.source == _line(bad, "+ 1e-12")
    assert d.message == ("1e-12 is 0 in float16 (smallest positive value 5.96e-08): "
                         f"aten.add in the model at {d.source}.")
    assert d.evidence[0].startswith("aten.add on float16 adds the constant 1e-12; the smallest "
                                    "positive float16 is 5.96e-08")
    assert "rsqrt(0) is inf" in d.consequence
    assert "torch.finfo(x.dtype).eps" in d.fix and "float32" in d.fix
    [op] = [o for o in trace.ops if o.op == "aten.add.Tensor" and o.source == d.source]
    assert op.scalars == (1e-12,)


@pytest.mark.parametrize(("device", "predict"), MODES)
def test_eps_in_float32_or_bfloat16_is_silent(tmp_path, device, predict):
    good = _script(tmp_path, _NORM, norm=_EPS_IN_FP32)
    assert _amp3(_run(good, device, predict)) == []
    bf16 = _script(tmp_path, _NORM, "bf16.py", norm=_EPS_IN_FP16, cast=".bfloat16()")
    assert _amp3(_run(bf16, device, predict)) == []  # 1e-12 is a normal bfloat16


@pytest.mark.parametrize("predict", [False, True])
def test_eps_under_cuda_autocast_is_added_in_float32(tmp_path, predict):
    # CUDA's autocast computes pow in float32: the mean square and its eps are float32 there.
    good = _script(tmp_path, _NORM, norm=_EPS_IN_FP16, cast="",
                   forward="with torch.autocast(dev, dtype=torch.float16):\n    out = model(x)")
    trace = _run(good, "cuda", predict)
    assert _amp3(trace) == []
    [op] = [o for o in trace.ops if o.op == "aten.add.Tensor" and o.scalars == (1e-12,)]
    assert op.outputs[0].dtype == "float32"


# -- the numbers recorded, and their JSON

class _Numbers(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x * 2 + 0.5  # an int and a float, each where the op takes a value
        x = x.masked_fill(x > 100, -10**9)  # an int value
        x = x.add(y, alpha=3)
        x = x.transpose(0, 1).softmax(-1)  # dims and a bool: no values
        return x.clamp(min=1e-12, max=float("inf"))


@pytest.mark.fast
def test_scalars_are_the_values_an_op_was_called_with():
    model, x, y = _Numbers(), torch.randn(3, 3), torch.randn(3, 3)
    with ampscope.capture(model) as trace:
        model(x, y)
    got = [(o.op, o.scalars) for o in trace.ops]
    assert got == [
        ("aten.mul.Tensor", (2.0,)),
        ("aten.add.Tensor", (0.5,)),
        ("aten.gt.Scalar", (100.0,)),
        ("aten.masked_fill.Scalar", (-1e9,)),
        ("aten.add.Tensor", (3.0,)),
        ("aten.transpose.int", ()),
        ("aten._softmax.default", ()),
        ("aten.clamp.default", (1e-12, math.inf)),
    ]


@pytest.mark.fast
def test_scalars_round_trip_through_json_and_validate():
    model, x, y = _Numbers(), torch.randn(3, 3), torch.randn(3, 3)
    with ampscope.capture(model) as trace:
        model(x, y)
    last = trace.ops[-1]
    trace.ops[-1] = dataclasses.replace(last, scalars=(*last.scalars, -math.inf, math.nan))

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is no JSON")

    document = json.loads(trace.to_json(), parse_constant=refuse)
    assert document["ops"][-1]["scalars"] == [1e-12, "inf", "-inf", "nan"]
    assert document["ops"][0]["scalars"] == [2.0]
    assert document["ops"][5]["scalars"] == []
    schema = schemas.load("trace")
    assert list(Draft202012Validator(schema).iter_errors(document)) == []
    broken = json.loads(json.dumps(document))
    broken["ops"][0]["scalars"] = ["Infinity"]
    assert list(Draft202012Validator(schema).iter_errors(broken))
    back = Trace.from_dict(document)
    assert [o.scalars for o in back.ops[:-1]] == [o.scalars for o in trace.ops[:-1]]
    *same, nan = back.ops[-1].scalars
    assert same == [1e-12, math.inf, -math.inf] and math.isnan(nan)
    assert back.ops[-1] == dataclasses.replace(trace.ops[-1], scalars=back.ops[-1].scalars)
    del document["ops"][0]["scalars"]  # a document written before the field reads as none
    assert Trace.from_dict(document).ops[0].scalars == ()
