"""`torch.set_default_device("cuda")`, a common first line of a training script, on the
virtual CUDA device: factories then make their tensors on the (virtual) cuda device, real and
predicted, and the caller's default device is as it was after the run.

torch keeps the default device's mode at the bottom of the function-mode stack, below the
virtual device's; `torch.get_default_device()` finds its index by making an empty tensor there,
which reached the real, missing CUDA ("PyTorch is not linked with support for cuda devices").
The script writes what it saw to a file beside it; the ops are the trace's."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from ampscope.script import run_script
from ampscope.torchcompat.devices import default_device_context

SCRIPT = textwrap.dedent("""
    import json
    from pathlib import Path

    import torch
    from torch import nn

    torch.set_default_device("cuda")
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    seen = {"weight": str(model.weight.device), "x": str(x.device),
            "default": str(torch.get_default_device()), "is_cuda": model.weight.is_cuda}
    Path(__file__).with_name("seen.json").write_text(json.dumps(seen))
    model(x).sum().backward()
    opt.step()
""")


@pytest.mark.parametrize("predict", [False, True], ids=["real", "predicted"])
@pytest.mark.parametrize("in_process", [True, False], ids=["here", "child"])
def test_set_default_device_cuda_on_the_virtual_device(tmp_path, predict, in_process):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert default_device_context() is None
    t = run_script(str(script), device="cuda", predict=predict, in_process=in_process)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"weight": "cuda:0", "x": "cuda:0", "default": "cuda:0", "is_cuda": True}
    assert t.setting.device == "cuda" and t.setting.emulated
    assert t.mode == ("predict" if predict else "run") and t.workload == "train"
    assert [(p.name, p.dtype, p.shape, p.grad_dtype) for p in t.parameters] == [
        ("weight", "float32", (4, 4), "float32"), ("bias", "float32", (4,), "float32")]
    forward = [o for o in t.ops if o.phase == "forward"]
    # Linear(4, 4) on a (2, 4) batch: addmm(bias, x, weight.T) -> (2, 4).
    addmm = next(o for o in forward if o.op == "aten.addmm.default")
    assert [i.shape for i in addmm.inputs] == [(4,), (2, 4), (4, 4)]
    assert addmm.outputs[0].shape == (2, 4) and addmm.outputs[0].dtype == "float32"
    assert any(o.phase == "backward" for o in t.ops)
    assert any(o.phase == "optimizer" for o in t.ops)
    # The caller's default device is as it was: none set.
    assert default_device_context() is None
    assert torch.empty(1).device.type == "cpu"


def test_the_callers_own_default_device_is_put_back(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    torch.set_default_device("meta")
    try:
        run_script(str(script), device="cuda", in_process=True)
        assert torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
    assert default_device_context() is None
