"""A PyTorch optimizer's step is recorded as one user-level call (FunctionRecorder.step_begin):
its ops are that call's, the calls of its implementation are not recorded one by one, and the
function mode stack is left as it was, also when the step raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import ampscope
from ampscope.records import Trace

pytestmark = pytest.mark.fast


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _step_line() -> int:
    return _line_of("opt.step()")


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(n for n, line in enumerate(f, 1) if line.strip() == text)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> Trace:
    x = torch.randn(4, 8)
    with ampscope.capture(model) as t:
        model(x).sum().backward()
        opt.step()
    return t


def _plain_ops(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The optimizer step's aten ops, as PyTorch's DebugMode sees them (no ampscope)."""
    from torch.utils._debug_mode import DebugMode

    model(torch.randn(4, 8)).sum().backward()
    with DebugMode() as mode:
        opt.step()
    ops = [str(call.op) for call in mode.operators if hasattr(call, "op")]  # not annotations
    return [op for op in ops if op != "aten.detach.default"]


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_steps_as_one_call_and_its_ops_are_that_calls(foreach):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    t = _train(model, opt)
    optimizer_calls = [c for c in t.calls if c.phase == "optimizer"]
    assert [c.func for c in optimizer_calls] == ["torch.optim.AdamW.step"]
    step = optimizer_calls[0]
    assert step.source == f"test_optimizer_step_call.py:{_step_line()}"
    assert step.inputs == () and step.outputs == () and step.autocast is None
    ops = [o for o in t.ops if o.phase == "optimizer"]
    assert ops and all(o.caller == step.index and o.source == step.source for o in ops)

    # The ops are every op the step runs: those of a second, unrecorded model's first step.
    twin = _model()
    expected = _plain_ops(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3, foreach=foreach))
    assert [o.op for o in ops] == expected


def test_a_users_own_step_has_its_calls_recorded():
    class Scaled(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(0.5)
            return super().step(closure)

    model = _model()
    t = _train(model, Scaled(model.parameters(), lr=0.1))
    funcs = [c.func for c in t.calls if c.phase == "optimizer"]
    assert funcs.count("Tensor.mul_") == 4  # two weights and two biases, from the user's step
    assert "torch.optim.SGD.step" not in funcs and len(funcs) > 4  # SGD's own calls too


def test_a_step_with_a_closure_records_the_users_forward_inside_it():
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = torch.randn(4, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with ampscope.capture(model) as t:
        opt.step(closure)
    assert "torch.optim.LBFGS.step" not in {c.func for c in t.calls}
    assert sum(c.func == "torch.nn.functional.linear" for c in t.calls) >= 4  # 2 layers × ≥2


class _Marker(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_mode_stack_is_as_it_was_after_a_step_and_after_one_that_raised():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _get_current_function_mode_stack()
    seen = []
    with ampscope.capture(model) as t, _Marker():  # a mode of the user's, above the recorder
        inside = _get_current_function_mode_stack()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        seen.append(_get_current_function_mode_stack())
        opt.param_groups[0]["lr"] = "fast"  # not a number: the step raises
        with pytest.raises(TypeError):
            opt.step()
        model(torch.randn(4, 8))  # the next forward: the recorder is back in place
        seen.append(_get_current_function_mode_stack())
    assert _get_current_function_mode_stack() == before
    assert seen == [inside, inside]
    # Both steps are calls, the one that raised too: every op points at its own call.
    steps = [c for c in t.calls if c.func == "torch.optim.AdamW.step"]
    assert len(steps) == 2 and len({c.index for c in t.calls}) == len(t.calls)
    assert {o.caller for o in t.ops if o.phase == "optimizer"} == {c.index for c in steps}
    assert len(inside) == len(before) + 2  # the recorder, then the user's mode
    assert sum(c.func == "torch.nn.functional.linear" for c in t.calls) == 4


def test_a_failing_step_leaves_no_mode_behind():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _get_current_function_mode_stack()
    opt.param_groups[0]["lr"] = "fast"
    with pytest.raises(TypeError), ampscope.capture(model):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert _get_current_function_mode_stack() == before


def test_a_step_inside_an_autocast_region_records_autocast_but_no_autocast_casts():
    """Casts inside a step are the optimizer's own (here its step pre-hook's, which runs inside
    the step), not autocast's, although the user steps inside an autocast region."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def round_grads_to_bf16(optimizer, args, kwargs):
        for p in model.parameters():
            p.grad = p.grad.to(torch.bfloat16).to(torch.float32)

    opt.register_step_pre_hook(round_grads_to_bf16)
    with ampscope.capture(model) as t, torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 8)).float().sum().backward()
        opt.step()
    step = next(c for c in t.calls if c.func == "torch.optim.AdamW.step")
    assert step.autocast == "bfloat16"
    casts = [o for o in t.ops if o.caller == step.index and o.op == "aten._to_copy.default"]
    assert len(casts) == 8  # two per parameter
    assert not any(o.autocast_cast for o in casts)


def test_steps_inside_backward_leave_the_recording_as_it_was():
    """The optimizer-in-backward pattern: each parameter steps from its gradient hook, inside
    `loss.backward()`, a call the recorder is handling (so it is off the mode stack already)."""
    model = _model()
    optimizers = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    before = _get_current_function_mode_stack()
    with ampscope.capture(model) as t:
        model(torch.randn(4, 8)).sum().backward()
        model(torch.randn(4, 8))
    assert _get_current_function_mode_stack() == before
    assert sum(c.func == "torch.nn.functional.linear" for c in t.calls) == 4
    updates = [o for o in t.ops if o.op == "aten.addcdiv_.default"]
    assert len(updates) == 4 and all(o.phase == "backward" for o in updates)
