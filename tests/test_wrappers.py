"""Module wrappers that forward attributes to the module they wrap (Lightning Fabric's
`_FabricModule`, accelerate's, any hand-written one): a run replaces the model's `forward` on
the wrapper alone, never on the wrapped module through the wrapper's `__setattr__` (which made
the wrapped module call the wrapper back: RecursionError), and puts everything back after."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampscope import patches
from ampscope.script import run_script

_FORWARDING = """\
import torch
from torch import nn

class Wrapper(nn.Module):
    # Sets (and deletes) every attribute on the wrapped module too, as Fabric's does.
    def __init__(self, module):
        super().__init__()
        self.module = module
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name not in ("module", "training") and "module" in self._modules:
            setattr(self._modules["module"], name, value)

inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
model = Wrapper(inner)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(2):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
assert "forward" not in vars(inner), "the wrapped module kept a forward of the run's"
"""


@pytest.mark.parametrize("predict", [False, True])
def test_a_wrapper_that_forwards_setattr_runs(tmp_path, predict):
    script = tmp_path / "wrapped.py"
    script.write_text(_FORWARDING)
    trace = run_script(str(script), [], in_process=True, predict=predict)
    # Linear(8, 16) and Linear(16, 4): 8·16 + 16 + 16·4 + 4 = 212 parameters, each trained.
    assert trace.model.parameters == 212
    assert [p.name for p in trace.parameters] == [
        "module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
    assert patches.active() == []  # every replacement undone


def test_the_patch_of_an_instance_goes_past_its_setattr():
    seen = []

    class Loud(nn.Module):
        def __setattr__(self, name, value):
            seen.append(name)
            super().__setattr__(name, value)

    module = Loud()
    seen.clear()
    undo = patches.patch(module, "forward", lambda x: x)
    assert "forward" in vars(module) and seen == []
    undo()
    assert "forward" not in vars(module) and seen == []
    assert type(module).forward is nn.Module.forward  # the class's shows through again


_FABRIC = """\
import torch
import torch.nn as nn
from lightning.fabric import Fabric

fabric = Fabric(accelerator="auto", devices=1, precision="bf16-mixed")
fabric.launch()
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = fabric.setup(model, opt)
for _ in range(2):
    loss = model(torch.randn(4, 8, device=fabric.device)).float().square().mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_a_lightning_fabric_loop_runs_on_the_virtual_device(tmp_path):
    pytest.importorskip("lightning.fabric")
    script = tmp_path / "fabric_loop.py"
    script.write_text(_FABRIC)
    trace = run_script(str(script), [], device="cuda", in_process=True)
    assert trace.setting.autocast_dtype == "bfloat16"  # Fabric's bf16-mixed on a GPU
    linears = [m for m in trace.modules if m.type == "Linear" and m.phase == "forward"]
    assert linears and {m.outputs[0].dtype for m in linears} == {"bfloat16"}
    assert trace.model.parameters == 212
    assert {p.dtype for p in trace.parameters} == {"float32"}
    assert torch.cuda.is_available() is False  # the virtual device is gone again
