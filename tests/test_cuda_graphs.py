"""CUDA graphs on the virtual device, run eagerly (runtime/cuda_graphs.py): a captured block
runs once and is traced, `replay()` runs nothing, `make_graphed_callables` hands the callables
back; the notes say so, and torch.cuda is as it was after the run."""

from __future__ import annotations

import pytest
import torch

from ampscope.script import run_script

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="emulation needs no CUDA")

_CAPTURED = """\
import torch
import torch.nn as nn
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
static_x = torch.randn(4, 8, device="cuda")
g = torch.cuda.CUDAGraph()
opt.zero_grad(set_to_none=True)
with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
    static_loss = model(static_x).square().mean()
    static_loss.backward()
    opt.step()
for _ in range(3):
    static_x.copy_(torch.randn(4, 8, device="cuda"))
    g.replay()
print("loss", static_loss.item())
"""


def test_a_captured_step_runs_once_and_replays_run_nothing(tmp_path, capsys):
    script = tmp_path / "graphed.py"
    script.write_text(_CAPTURED)
    trace = run_script(str(script), [], device="cuda", in_process=True, steps=5)
    assert "loss" in capsys.readouterr().out  # the script ran to its end
    # The capture's step, traced once: its two Linear forwards and the SGD step.
    assert [m.name for m in trace.modules if m.type == "Linear" and m.phase == "forward"] == \
        ["0", "2"]
    assert any(o.phase == "optimizer" for o in trace.ops)
    assert any("torch.cuda.graph captured 1 time" in n and "its 3 replays ran nothing" in n
               for n in trace.notes)
    assert torch.cuda.CUDAGraph.__module__.startswith("torch")  # put back


_GRAPHED_CALLABLES = """\
import torch
import torch.nn as nn
model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).cuda()
graphed = torch.cuda.make_graphed_callables(model, (torch.randn(2, 8, device="cuda"),))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
graphed(torch.randn(2, 8, device="cuda")).sum().backward()
opt.step()
"""


def test_make_graphed_callables_hands_the_callables_back(tmp_path):
    script = tmp_path / "callables.py"
    script.write_text(_GRAPHED_CALLABLES)
    trace = run_script(str(script), [], device="cuda", in_process=True)
    assert trace.model.parameters == 8 * 8 + 8
    assert any("make_graphed_callables returned its 1 callable as they were" in n
               for n in trace.notes)
