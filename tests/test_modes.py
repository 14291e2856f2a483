"""UncompiledDispatchMode (ampscope/torchcompat/dynamo.py): TorchDynamo compiles nothing of a recorder's
handler while a `torch.compile`d model runs under it, without PyTorch's per-op wrapper."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampscope
from ampscope.runs.ops import OpRecorder


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


@pytest.mark.fast
def test_the_op_recorder_handler_is_not_wrapped_by_pytorch():
    handler = OpRecorder.__dict__["__torch_dispatch__"]
    assert handler.__code__.co_filename.endswith("runs/ops.py")  # not torch's wrapper
    assert not OpRecorder._should_skip_dynamo()


def test_a_compiled_model_runs_its_eager_ops_and_dynamo_compiles_none_of_the_recorders():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = _Small()
    x = torch.randn(2, 16)
    eager = ampscope.trace(model, x, setting="fp32", workload="forward", predict=False)
    frames_before = counters["frames"]["total"]
    compiled = ampscope.trace(torch.compile(model), x, setting="fp32", workload="forward",
                              predict=False)
    # PyTorch runs a compiled function eagerly while a dispatch mode is active: had TorchDynamo
    # been let into the recorder's handler, it would have compiled dozens of its frames.
    assert counters["frames"]["total"] == frames_before
    assert [o.op for o in compiled.ops] == [o.op for o in eager.ops]
    assert [o.outputs for o in compiled.ops] == [o.outputs for o in eager.ops]
