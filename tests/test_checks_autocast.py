"""Autocast that does not do what it looks like (analysis/checks/autocast.py): AMP801
autocast-wrong-device, AMP802 autocast-nothing-cast, AMP803 autocast-disabled-inside, AMP804
autocast-default-dtype, each on a small script that makes the mistake (its id, severity and the
line that entered the region) and on its corrected twin, silent; the regions a run records
(runs/autocast_regions.py) against what a plain spy on `torch.autocast.__enter__` sees; torch
left as it was after a run that raised inside a region; the records in JSON, read back; no
record and no patch where regions cannot be read; and no AMP8xx on ampscope's own settings nor
on the examples."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator

import ampscope
from ampscope import schemas
from ampscope.records import Trace
from ampscope.runs import autocast_regions as recorder
from ampscope.script import run_script
from tests.helpers import state_differences, torch_state

EXAMPLES = Path(__file__).parent.parent / "examples"

# A small model on `dev` ("cuda" on the virtual device), one step; {body} makes `loss`.
_STEP = """\
import torch
from torch import nn

dev = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(4, 8, device=dev)
{body}
loss.backward()
opt.step()
"""

_FORWARD_IN = """\
with torch.autocast({region}):
    out = model(x)
loss = out.float().square().mean()"""


def _run(tmp_path: Path, body: str, *, name: str = "s.py", device: str | None = "cuda",
         predict: bool = False) -> tuple[Trace, str]:
    """The trace of `body` in `_STEP`, and the script's text."""
    text = _STEP.format(body=body)
    path = tmp_path / name
    path.write_text(text)
    return run_script(str(path), [], device=device, predict=predict, in_process=True), text


def _line(text: str, marker: str, name: str = "s.py") -> str:
    """"s.py:N" of the first line of `text` that holds `marker`."""
    number = next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)
    return f"{name}:{number}"


def _found(trace: Trace, id: str) -> list:
    return [d for d in trace.diagnostics if d.id == id]


def _ours(trace: Trace) -> list[str]:
    return [d.id for d in trace.diagnostics if d.id.startswith("AMP8")]


# -- AMP801 autocast-wrong-device

@pytest.mark.parametrize(("device", "predict", "region", "tensors"), [
    pytest.param("cuda", False, '"cpu", dtype=torch.bfloat16', "cuda", id="cpu-region-on-cuda"),
    pytest.param("cuda", True, '"cpu", dtype=torch.bfloat16', "cuda", id="predicted"),
    pytest.param(None, False, '"cuda", dtype=torch.bfloat16', "cpu", id="cuda-region-on-cpu"),
])
def test_a_region_for_another_device_is_a_warning(tmp_path, device, predict, region, tensors):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU-only torch turns a CUDA region off, and says so
        trace, text = _run(tmp_path, _FORWARD_IN.format(region=region), device=device,
                           predict=predict)
    line = _line(text, "with torch.autocast(")
    [d] = _found(trace, "AMP801")
    assert (d.name, d.severity, d.source) == ("autocast-wrong-device", "warning", line)
    region_device = "cpu" if tensors == "cuda" else "cuda"
    assert d.evidence[0].startswith(f'torch.autocast("{region_device}", dtype=torch.bfloat16) '
                                    f"entered at {line}")
    assert d.evidence[0].endswith(f"device {region_device}")
    [r] = trace.autocast_regions
    assert d.evidence[1] == f"{r.ops} ops ran inside it, on tensors on {tensors}" and r.ops >= 5
    assert d.evidence[2].startswith("none cast by autocast")
    assert "x.device.type" in d.fix


@pytest.mark.parametrize(("device", "region"), [
    pytest.param("cuda", '"cuda", dtype=torch.bfloat16', id="cuda"),
    pytest.param(None, '"cpu", dtype=torch.bfloat16', id="cpu"),
    pytest.param("cuda", 'device_type=x.device.type, dtype=torch.bfloat16', id="from-tensor"),
])
def test_a_region_for_its_tensors_device_is_silent(tmp_path, device, region):
    trace, _ = _run(tmp_path, _FORWARD_IN.format(region=region), device=device)
    assert _ours(trace) == []
    [r] = trace.autocast_regions
    assert r.casts > 0 and r.devices == (r.device_type,)


def test_turning_off_another_devices_autocast_is_a_warning(tmp_path):
    body = """\
with torch.autocast("cuda", dtype=torch.bfloat16):
    h = model[0](x)
    with torch.autocast("cpu", enabled=False):
        h = model[1](h.float())
    loss = model[2](h).float().square().mean()"""
    trace, text = _run(tmp_path, body)
    [d] = _found(trace, "AMP801")
    assert d.source == _line(text, 'autocast("cpu"')
    assert "turns off cpu autocast" in d.message and "stays on" in d.message
    assert _line(text, 'autocast("cuda"') in d.message


# -- AMP802 autocast-nothing-cast

def test_a_region_that_casts_nothing_is_a_note(tmp_path):
    body = """\
out = model(x)
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = (out * 2).relu().square().mean()"""
    trace, text = _run(tmp_path, body)
    line = _line(text, "with torch.autocast(")
    [d] = _found(trace, "AMP802")
    assert (d.name, d.severity, d.source) == ("autocast-nothing-cast", "note", line)
    assert d.evidence == (f'torch.autocast("cuda", dtype=torch.bfloat16) entered at {line}',
                          "4 ops ran inside it, all on float32 inputs",
                          "none cast by autocast")
    assert _ours(trace) == ["AMP802"]


@pytest.mark.parametrize("body", [
    pytest.param(_FORWARD_IN.format(region='"cuda", dtype=torch.bfloat16'), id="around-model"),
    # Inputs already in the region's dtype need no cast: not a region that does nothing.
    pytest.param("""\
out = model(x).bfloat16()
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = (out * 2).relu().float().square().mean()""", id="already-bfloat16"),
])
def test_a_region_that_casts_or_needs_no_cast_is_silent(tmp_path, body):
    trace, _ = _run(tmp_path, body)
    assert _ours(trace) == []


# -- AMP803 autocast-disabled-inside

_NESTED = """\
with torch.autocast("cuda", dtype=torch.bfloat16):
    h = model[0](x)
    with torch.autocast({inner}):
        h = model[1](h.float())
    loss = model[2](h).float().square().mean()"""


@pytest.mark.parametrize(("inner", "says"), [
    pytest.param('"cuda", enabled=False', "turns cuda autocast off", id="disabled"),
    pytest.param('"cuda", dtype=torch.float16', "switches cuda autocast to float16", id="switched"),
])
def test_autocast_turned_off_inside_a_region_is_a_note(tmp_path, inner, says):
    trace, text = _run(tmp_path, _NESTED.format(inner=inner))
    outer, line = _line(text, "bfloat16):"), _line(text, f"autocast({inner})")
    [d] = _found(trace, "AMP803")
    assert (d.name, d.severity, d.source) == ("autocast-disabled-inside", "note", line)
    assert says in d.message and f"entered at {outer}" in d.message
    assert d.evidence[0] == (f"torch.autocast({inner}) entered at {line}, inside "
                             f'torch.autocast("cuda", dtype=torch.bfloat16) at {outer}')
    assert d.evidence[1].startswith("2 ops ran inside it")
    assert _ours(trace) == ["AMP803"]


def test_a_nested_region_that_changes_nothing_is_silent(tmp_path):
    trace, _ = _run(tmp_path, _NESTED.format(inner='"cuda", dtype=torch.bfloat16'))
    assert _ours(trace) == []
    outer, inner = trace.autocast_regions
    assert (inner.parent, inner.depth, outer.depth) == (outer.index, 1, 0)


# -- AMP804 autocast-default-dtype

_SCALED = """\
scaler = torch.amp.GradScaler("cuda")
with torch.autocast("cuda"):
    out = model(x)
loss = out.float().square().mean()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
loss = loss.detach().requires_grad_()"""


def test_a_float16_region_without_a_dtype_is_a_note(tmp_path):
    trace, text = _run(tmp_path, _FORWARD_IN.format(region='"cuda"'))
    line = _line(text, "with torch.autocast(")
    [d] = _found(trace, "AMP804")
    assert (d.name, d.severity, d.source) == ("autocast-default-dtype", "note", line)
    assert "it ran float16" in d.message
    assert d.evidence[0] == (f'torch.autocast("cuda") entered at {line}: dtype float16 (the '
                             "default of cuda autocast)")
    assert "dtype=torch.bfloat16" in d.fix
    assert _ours(trace) == ["AMP804"]
    assert [r.dtype_given for r in trace.autocast_regions] == [False]


@pytest.mark.parametrize("body", [
    pytest.param(_FORWARD_IN.format(region='"cuda", dtype=torch.bfloat16'), id="named"),
    pytest.param(_FORWARD_IN.format(region='"cuda", dtype=torch.float16'), id="named-fp16"),
    pytest.param(_SCALED, id="with-grad-scaler"),
])
def test_a_named_dtype_or_a_grad_scaler_is_silent(tmp_path, body):
    trace, _ = _run(tmp_path, body)
    assert "AMP804" not in _ours(trace)


# -- the records

_MANY = """\
import torch
from torch import nn

dev = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
x = torch.randn(4, 8, device=dev)
ctx = torch.amp.autocast(device_type=dev, dtype=torch.bfloat16)


@torch.autocast(dev, dtype=torch.bfloat16)
def head(h):
    return model[2](h)


for step in range(2):
    with ctx:
        h = model[0](x)
        with torch.autocast(dev, enabled=False):
            h = model[1](h.float())
        out = head(h)
with torch.cuda.amp.autocast():
    out = model(x)
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = model(x)
"""


def _spied(monkeypatch, script: Path) -> list[tuple]:
    """(device type, dtype, enabled, line) of each region the script itself entered, as a
    wrapper of torch's own `__enter__` sees them."""
    seen: list[tuple] = []
    enter = torch.autocast.__enter__

    def spy(region):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != str(script):
            frame = frame.f_back
        if frame is not None:
            seen.append((region.device, str(region.fast_dtype).removeprefix("torch."),
                         region._enabled, f"{script.name}:{frame.f_lineno}"))
        return enter(region)

    monkeypatch.setattr(torch.autocast, "__enter__", spy)
    return seen


@pytest.mark.parametrize("device", ["cuda", None])
def test_the_regions_recorded_are_the_regions_entered(tmp_path, monkeypatch, device):
    script = tmp_path / "many.py"
    script.write_text(_MANY)
    seen = _spied(monkeypatch, script)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cuda.amp.autocast is deprecated
        trace = run_script(str(script), [], device=device, in_process=True)
    recorded = [(r.device_type, r.dtype, r.enabled, r.source) for r in trace.autocast_regions]
    if device is None:  # CUDA's regions are off where CUDA is missing, as torch says
        assert [s[0] for s in seen] == ["cpu"] * 6 + ["cuda", "cpu"]
    assert recorded == seen and len(seen) == 8
    assert [r.depth for r in trace.autocast_regions] == [0, 1, 1, 0, 1, 1, 0, 0]
    assert [r.parent for r in trace.autocast_regions] == [None, 0, 0, None, 3, 3, None, None]
    assert [r.index for r in trace.autocast_regions] == list(range(8))
    # Each op once: the regions' own ops add up to all ops from the first region's first.
    first = _line(_MANY, "h = model[0](x)", "many.py")
    inside = trace.ops[next(o.index for o in trace.ops if o.source == first):]
    assert sum(r.ops for r in trace.autocast_regions) == len(inside) > 0
    assert sum(r.casts for r in trace.autocast_regions) == sum(o.autocast_cast for o in inside)


@pytest.mark.parametrize("device", ["cuda", None])
def test_torch_is_as_it_was_after_a_run_that_raised_inside_a_region(tmp_path, device):
    body = """\
with torch.autocast(dev, dtype=torch.bfloat16):
    out = model(x)
    with torch.autocast(dev, enabled=False):
        raise RuntimeError("inside the region")
loss = out"""
    path = tmp_path / "raises.py"
    path.write_text(_STEP.format(body=body))
    autocast_class = dict(vars(torch.autocast))
    filters = list(warnings.filters)
    before = torch_state()
    with pytest.raises(Exception, match="inside the region"):
        run_script(str(path), [], device=device, in_process=True)
    assert state_differences(before, torch_state()) == []
    assert dict(vars(torch.autocast)) == autocast_class
    assert list(warnings.filters) == filters


def test_the_records_in_json(tmp_path):
    trace, _ = _run(tmp_path, _NESTED.format(inner='"cuda", enabled=False'))
    data = json.loads(trace.to_json())
    Draft202012Validator(schemas.load("trace")).validate(data)
    assert Trace.from_dict(data).autocast_regions == trace.autocast_regions
    del data["autocast_regions"]  # optional on reading: an older document has none
    assert Trace.from_dict(data).autocast_regions == []


def test_no_region_is_recorded_where_regions_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "regions_readable", lambda: (False, "not in this build"))
    # The script checks that torch's own methods run it: nothing was patched.
    body = """\
assert torch.autocast.__enter__.__module__ == "torch.amp.autocast_mode"
assert torch.autocast.__exit__.__module__ == "torch.amp.autocast_mode"
with torch.autocast(dev, dtype=torch.bfloat16):
    loss = model(x).float().sum()"""
    trace, _ = _run(tmp_path, body, device=None)
    assert trace.autocast_regions == []
    assert trace.ops and trace.diagnostics == []


# -- no false alarms on correct code

@pytest.mark.parametrize("setting", ["fp32+amp-bf16", "cuda:fp32+amp-bf16"])
def test_ampscope_settings_raise_nothing(setting):
    trace = ampscope.trace("gpt2-tiny", setting=setting, workload="train", seq=8, batch=1,
                           predict=True)
    assert _ours(trace) == []


@pytest.mark.parametrize("script", ["train.py", "pretrain.py"])
def test_examples_raise_nothing(script):
    trace = run_script(str(EXAMPLES / "gpt" / script), ["--batch_size=2", "--block_size=16",
                                                       "--n_layer=1"],
                       device="cuda", in_process=True)
    assert trace.autocast_regions and _ours(trace) == []
