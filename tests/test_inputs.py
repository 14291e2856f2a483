"""Models that do not take token ids: inputs as a tuple of positional arguments (the
torch.export convention), and float inputs under a pure low-precision setting. Checked against
plain forward hooks on a run written by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampscope
from ampscope.errors import AmpscopeError

pytestmark = pytest.mark.fast


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x, y=None):
        out = self.fc(self.bn(self.conv(x)).mean((2, 3)))
        return out if y is None else nn.functional.cross_entropy(out, y)


def hooked_dtypes(model: nn.Module, *args) -> dict[str, str]:
    """Each submodule's output dtype, from forward hooks on a run written by hand."""
    seen: dict[str, str] = {}

    def hook(name):
        def record(module, args, out) -> None:  # returns None: the output is left as it is
            seen.setdefault(name, str(out.dtype).removeprefix("torch."))
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            model.eval()(*args)
    finally:
        for h in handles:
            h.remove()
    return seen


def traced_dtypes(t) -> dict[str, str]:
    return {m.name: m.outputs[0].dtype for m in t.modules if m.name and m.phase == "forward"}


def test_a_tuple_of_positional_inputs_is_named_by_the_forward():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    t = ampscope.trace(ConvNet(), (x, y), setting="fp32", workload="train")
    assert [(i.name, i.dtype) for i in t.inputs] == [("x", "float32"), ("y", "int64")]
    assert t.outputs[0].shape == ()  # the forward's scalar loss
    assert any(p.grad_dtype == "float32" for p in t.parameters)


def test_float_inputs_follow_a_pure_bf16_setting_as_a_script_casts_them():
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(2, 3, 8, 8)
    t = ampscope.trace(model, (x,), setting="bf16", workload="forward")
    by_hand = copy.deepcopy(model).to(torch.bfloat16)
    assert traced_dtypes(t) == hooked_dtypes(by_hand, x.to(torch.bfloat16))
    assert t.inputs[0].dtype == "bfloat16"
    assert any("Float inputs x were cast to bfloat16" in n for n in t.notes)


def test_a_tuple_that_does_not_fit_the_forward_is_one_line():
    with pytest.raises(AmpscopeError, match="3 positional arguments do not fit ConvNet.forward"):
        ampscope.trace(ConvNet(), (torch.ones(1), torch.ones(1), torch.ones(1)))


def test_a_train_step_needs_a_scalar_loss():
    with pytest.raises(AmpscopeError, match="a train step needs a loss"):
        ampscope.trace(ConvNet(), (torch.randn(2, 3, 8, 8),), workload="train")
