"""The value checks of a real run (`values=True`): inf/NaN made from finite values (AMP303),
activations near their format's limit (AMP304), 16-bit updates that round away (AMP401).

Each rule has a reproduction and a silent twin, run as a user's script on the CPU and on the
virtual CUDA device; the expected op, module, line, max |x| and stuck fraction are worked out
here from the same model and data, with plain forward hooks and tensor arithmetic."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator
from torch import nn

import ampscope
from ampscope import schemas
from ampscope.records import Trace
from ampscope.script import run_script

DEVICES = [None, "cuda"]  # this machine's device, and the virtual CUDA device

# The model and data of a script, also built here (same seed) for the expected values.
_LINEAR = """
import torch
from torch import nn

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to({dtype})
with torch.no_grad():
    model[0].weight.fill_({weight})
    model[0].bias.zero_()
    model[2].weight.fill_({second})
x = torch.full((8, 16), {input}, dtype={dtype})
"""
_TRAIN = """
model, x = model.to(DEVICE), x.to(DEVICE)
optimizer = torch.optim.SGD(model.parameters(), lr={lr})
for step in range(3):
    out = model(x)
    loss = {loss}
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def _script(tmp_path: Path, prelude: str, **fields) -> tuple[Path, str]:
    fields.setdefault("loss", "out.float().mean()")
    text = textwrap.dedent(prelude).format(**fields) + textwrap.dedent(_TRAIN).format(**fields)
    path = tmp_path / "train.py"
    path.write_text(text)
    return path, text


def _line(text: str, code: str) -> str:
    """"train.py:N" of the script's line that reads `code`."""
    return f"train.py:{[line.strip() for line in text.splitlines()].index(code) + 1}"


def _built(prelude: str, **fields) -> dict:
    """The script's model and data, built here as the script builds them."""
    scope: dict = {}
    with torch.device("cpu"):
        exec(textwrap.dedent(prelude).format(**fields), scope)
    return scope


def _run(path: Path, device: str | None, **options) -> Trace:
    return run_script(str(path), [], device=device, values=True, in_process=True, **options)


def _ids(trace: Trace) -> set[str]:
    return {d.id for d in trace.diagnostics}


def _one(trace: Trace, id: str):
    found = [d for d in trace.diagnostics if d.id == id]
    assert len(found) == 1, trace.diagnostics
    return found[0]


def _module_outputs(model: nn.Module, x: torch.Tensor) -> list[tuple[str, torch.Tensor,
                                                                      torch.Tensor]]:
    """(module name, its input, its output) for each module call of one forward, in the order
    the calls returned: the ground truth the recorder must agree with."""
    names = {m: n for n, m in model.named_modules()}
    seen: list = []
    handles = [m.register_forward_hook(lambda m, a, o: seen.append((names[m], a[0], o)))
               for m in model.modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


# -- AMP303: non-finite values -----------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_fp16_overflow_is_named_with_its_module_and_line(tmp_path, device):
    fields = {"dtype": "torch.float16", "weight": 300.0, "input": 20.0, "second": 0.01,
              "lr": 1e-3}
    path, text = _script(tmp_path, _LINEAR, **fields)
    trace = _run(path, device)
    # ground truth: the first module whose output holds inf while its input did not
    built = _built(_LINEAR, **fields)
    made = next((name, out) for name, inp, out in _module_outputs(built["model"], built["x"])
                if torch.isfinite(inp).all() and not torch.isfinite(out).all())
    assert made[0] == "0" and torch.isinf(made[1]).any()

    d = _one(trace, "AMP303")
    assert d.severity == "error" and d.name == "non-finite-values"
    first = trace.values.first_nonfinite[0]
    assert first.module == made[0] and first.phase == "forward" and first.dtype == "float16"
    assert first.kind == "+inf"  # 16·20·300 = 96,000 > 65,504, all positive
    assert first.op in ("aten.addmm.default", "aten.mm.default", "aten.linear.default")
    assert first.source == d.source == _line(text, "out = model(x)")
    assert "module 0" in d.message and d.source in d.message
    assert any("65,504" in e for e in d.evidence)
    assert trace.values.nonfinite_ops >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_in_range_is_silent(tmp_path, device):
    fields = {"dtype": "torch.float16", "weight": 0.5, "input": 1.0, "second": 0.01,
              "lr": 1e-3}
    path, _ = _script(tmp_path, _LINEAR, **fields)
    trace = _run(path, device)
    assert trace.values is not None and trace.values.checked_ops > 0
    assert trace.values.first_nonfinite == () and trace.values.nonfinite_ops == 0
    assert not _ids(trace) & {"AMP303", "AMP304"}


_MASKED = """
import torch
from torch import nn

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
    def forward(self, x):
        scores = self.proj(x)
        mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1).to(x.device)
        return torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
model = Masked().to({dtype})
x = torch.randn(8, 8, dtype={dtype})
"""


@pytest.mark.parametrize("device", DEVICES)
def test_an_inf_the_program_writes_is_no_finding(tmp_path, device):
    """masked_fill(mask, -inf) makes -inf on purpose: counted, never the one made."""
    path, _ = _script(tmp_path, _MASKED, dtype="torch.float32", lr=1e-2)
    trace = _run(path, device)
    assert trace.values.nonfinite_ops >= 1  # the masked scores
    assert trace.values.first_nonfinite == ()
    assert "AMP303" not in _ids(trace)


# -- AMP304: activations near the format's limit -----------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_fp16_activations_near_65504_are_flagged(tmp_path, device):
    # 16 inputs of 10 times weights of 250: 40,000 in the first Linear's output, and 128 out
    # of the second (32 · 40,000 · 1e-4); the largest gradient, the second weight's, is
    # 8 · 40,000 / 32 = 10,000: nothing overflows, forward or backward
    fields = {"dtype": "torch.float16", "weight": 250.0, "input": 10.0, "second": 1e-4,
              "lr": 1e-3}
    path, _ = _script(tmp_path, _LINEAR, **fields)
    trace = _run(path, device)
    built = _built(_LINEAR, **fields)
    expected = {name: out.abs().max().item()
                for name, _, out in _module_outputs(built["model"], built["x"])}
    assert expected["0"] == 40000.0

    recorded = {m.module: m for m in trace.values.module_max if m.dtype == "float16"}
    for name, value in expected.items():
        assert recorded[name].max_abs == pytest.approx(value, rel=1e-3), name
    assert recorded["0"].type == "Linear" and recorded["0"].calls == 1
    d = _one(trace, "AMP304")
    assert d.severity == "warning" and d.name == "activations-near-format-limit"
    assert d.message.startswith("0 (Linear) returned values up to 40,000 in float16")
    assert any("65,504" in e for e in d.evidence)
    assert d.source is not None and d.source.startswith("train.py:")
    assert "AMP303" not in _ids(trace)


@pytest.mark.parametrize("device", DEVICES)
def test_activations_well_below_the_limit_are_silent(tmp_path, device):
    fields = {"dtype": "torch.float16", "weight": 50.0, "input": 10.0, "second": 1e-4,
              "lr": 1e-3}  # 8,000
    path, _ = _script(tmp_path, _LINEAR, **fields)
    trace = _run(path, device)
    assert max(m.max_abs for m in trace.values.module_max) == pytest.approx(8000, rel=1e-3)
    assert not _ids(trace) & {"AMP303", "AMP304"}


# -- AMP401: updates that round away -----------------------------------------------------------

_WEIGHTS_NEAR_ONE = """
import torch
from torch import nn

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Linear(64, 64, bias=False).to({dtype})
with torch.no_grad():
    model.weight.copy_(1.0 + 0.01 * torch.randn(64, 64))
    model.weight[:, 0] = 1e-6  # one column small enough to move (its gradient is not small)
x = torch.randn(16, 64, dtype={dtype})
"""


def _expected_stuck(fields: dict) -> float:
    """The fraction of elements with a nonzero gradient that SGD leaves unchanged, worked out
    here: the gradient of the script's loss, and w - lr·g rounded to the weights' dtype."""
    built = _built(_WEIGHTS_NEAR_ONE, **fields)
    model, x = built["model"], built["x"]
    model(x).float().pow(2).mean().backward()
    w, g = model.weight.detach(), model.weight.grad
    stepped = (w.float() - fields["lr"] * g.float()).to(w.dtype)
    moving = g != 0
    return ((stepped == w) & moving).sum().item() / moving.sum().item()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weights_that_sgd_cannot_move_are_flagged(tmp_path, device):
    fields = {"dtype": "torch.bfloat16", "lr": 1e-5, "loss": "out.float().pow(2).mean()"}
    path, _ = _script(tmp_path, _WEIGHTS_NEAR_ONE, **fields)
    trace = _run(path, device)
    expected = _expected_stuck(fields)
    assert 0.9 < expected < 1.0  # all but the small column

    [stuck] = trace.values.stuck_updates
    assert (stuck.parameter, stuck.dtype, stuck.steps) == ("weight", "bfloat16", 1)
    assert stuck.updated == 64 * 64
    assert stuck.fraction == pytest.approx(expected, abs=1 / 64 if device else 1e-9)
    d = _one(trace, "AMP401")
    assert d.severity == "warning" and d.name == "updates-round-away"
    assert f"{stuck.fraction:.0%} of the elements of weight" in d.message
    assert any(e.startswith(f"weight (bfloat16): {stuck.stuck:,} of 4,096") for e in d.evidence)
    assert any("2^-9" in e for e in d.evidence)
    assert "float32 master weights" in d.fix and "larger learning rate is not the fix" in d.fix
    assert d.source is not None and d.source.startswith("train.py:")


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weights_with_a_step_they_can_take_are_silent(tmp_path, device):
    fields = {"dtype": "torch.bfloat16", "lr": 1.0, "loss": "out.float().pow(2).mean()"}
    path, _ = _script(tmp_path, _WEIGHTS_NEAR_ONE, **fields)
    trace = _run(path, device)
    [stuck] = trace.values.stuck_updates
    assert stuck.fraction < 0.10 and stuck.fraction == pytest.approx(
        _expected_stuck(fields), abs=0.02)
    assert "AMP401" not in _ids(trace)


_AUTOCAST = """
import torch
from torch import nn

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Linear(64, 64, bias=False).to({dtype})
with torch.no_grad():
    model.weight.copy_(1.0 + 0.01 * torch.randn(64, 64))
x = torch.randn(16, 64, dtype={dtype})
model.forward = torch.autocast(DEVICE, dtype=torch.bfloat16)(model.forward)
"""


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_weights_under_bf16_autocast_are_silent(tmp_path, device):
    """The fix: float32 parameters, bfloat16 compute. Nothing 16-bit is stepped on."""
    path, _ = _script(tmp_path, _AUTOCAST, dtype="torch.float32", lr=1e-5)
    trace = _run(path, device)
    assert any(o.outputs and o.outputs[0].dtype == "bfloat16" for o in trace.ops
               if o.phase == "forward")
    assert trace.values.stuck_updates == () and trace.values.optimizer_steps == 0
    assert trace.values.first_nonfinite == ()
    assert not _ids(trace) & {"AMP303", "AMP304", "AMP401"}


_SCALED = """
import torch
from torch import nn

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(DEVICE)
with torch.no_grad():
    model[0].weight.fill_(10.0)
x = torch.full((8, 16), 10.0, device=DEVICE)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(DEVICE)
for step in range(3):
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = model(x)
    loss = out.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
"""


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_a_grad_scaler_skips_are_no_finding(tmp_path, device):
    """At the GradScaler's first scale (65536) the fp16 gradients overflow: it skips that step
    and lowers the scale, as it is meant to."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(_SCALED))
    trace = _run(path, device)
    [first] = trace.values.first_nonfinite
    assert first.phase == "backward" and first.dtype == "float16" and "inf" in first.kind
    assert trace.values.optimizer_steps == 0  # skipped: no 16-bit parameter anyway
    # A step the scaler skipped read its pass's gradients all the same: no pass is discarded.
    assert {p.kind for p in trace.passes} == {"train"}
    assert not _ids(trace) & {"AMP303", "AMP304", "AMP401"}


_MASTER = """
import torch
from torch import nn

class MasterSGD(torch.optim.Optimizer):
    \"\"\"SGD on a float32 copy of each parameter, written back rounded.\"\"\"
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "master" not in state:
                    state["master"] = p.float()
                state["master"].add_(p.grad.float(), alpha=-group["lr"])
                p.copy_(state["master"])

torch.manual_seed(0)
model = nn.Linear(64, 64, bias=False).bfloat16()
with torch.no_grad():
    model.weight.copy_(1.0 + 0.01 * torch.randn(64, 64))
x = torch.randn(16, 64, dtype=torch.bfloat16)
optimizer = MasterSGD(model.parameters(), lr=1e-5)
for step in range(3):
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_bf16_weights_with_float32_master_copies_are_silent(tmp_path):
    """The other fix: the small updates add up in the float32 copy, and the bf16 weight moves
    when they do. Unchanged after one step, but not lost."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(_MASTER))
    trace = _run(path, None)
    assert trace.values.optimizer_steps == 1 and trace.values.stuck_updates == ()
    assert "AMP401" not in _ids(trace)


# -- what is recorded when ---------------------------------------------------------------------

def test_no_values_unless_asked_and_none_when_predicted(tmp_path):
    fields = {"dtype": "torch.float16", "weight": 300.0, "input": 20.0, "second": 0.01,
              "lr": 1e-3}
    path, _ = _script(tmp_path, _LINEAR, **fields)
    plain = run_script(str(path), [], in_process=True)
    assert plain.values is None and "AMP303" not in _ids(plain)
    assert plain.to_dict()["values"] is None
    predicted = _run(path, "cuda", predict=True)
    assert predicted.mode == "predict" and predicted.values is None
    assert not _ids(predicted) & {"AMP303", "AMP304", "AMP401"}


def test_values_round_trip_through_json_and_the_schema(tmp_path):
    fields = {"dtype": "torch.float16", "weight": 300.0, "input": 20.0, "second": 0.01,
              "lr": 1e-3}
    path, _ = _script(tmp_path, _LINEAR, **fields)
    trace = _run(path, None)
    document = json.loads(trace.to_json())
    assert any(m["max_abs"] == "inf" for m in document["values"]["module_max"])
    errors = [e.message for e in Draft202012Validator(schemas.load("trace")).iter_errors(document)]
    assert not errors
    back = Trace.from_dict(document).values
    assert back is not None and back.first_nonfinite == trace.values.first_nonfinite
    assert back.stuck_updates == trace.values.stuck_updates
    for a, b in zip(back.module_max, trace.values.module_max, strict=True):
        assert (a.module, a.dtype, a.calls) == (b.module, b.dtype, b.calls)
        assert a.max_abs == b.max_abs or (math.isnan(a.max_abs) and math.isnan(b.max_abs))


# -- the reference models ----------------------------------------------------------------------

@pytest.mark.parametrize("setting", ["fp32", "fp32+amp-bf16"])
def test_reference_model_is_silent(setting):
    trace = ampscope.trace("gpt2-tiny", setting=setting, workload="train", seq=16, values=True)
    assert trace.mode == "run" and trace.values is not None
    assert trace.values.nonfinite_ops == 0 and trace.values.stuck_updates == ()
    assert not _ids(trace) & {"AMP303", "AMP304", "AMP401"}


def test_reference_model_in_bf16_loses_its_layernorm_updates():
    """bf16 weights stepped by AdamW at lr 6e-4: the LayerNorm gains, at 1.0, move by about
    6.6e-4 (the step and the decay), under the 2^-9 ≈ 2e-3 half-ulp of bfloat16 just below 1.0:
    every one rounds back to 1.0. The matrices (std 0.02) move. A true finding, and the only
    one."""
    assert torch.tensor(1.0 - 6.6e-4, dtype=torch.bfloat16).item() == 1.0
    trace = ampscope.trace("gpt2-tiny", setting="bf16+amp-bf16", workload="train", seq=16,
                           values=True)
    assert trace.values.nonfinite_ops == 0
    flagged = {s.parameter for s in trace.values.stuck_updates if s.fraction >= 0.10}
    layernorm_gains = {p.name for p in trace.parameters
                       if ".ln_" in p.name and p.name.endswith(".weight")}
    assert flagged == layernorm_gains and flagged
    assert all(s.fraction == 1.0 for s in trace.values.stuck_updates if s.parameter in flagged)
    assert all(s.fraction < 0.01 for s in trace.values.stuck_updates
               if s.parameter not in flagged)
    assert _ids(trace) & {"AMP303", "AMP304", "AMP401"} == {"AMP401"}
