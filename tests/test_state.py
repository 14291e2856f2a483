"""Never lose the user's state: after any trace — also one where the model raised mid-run —
the model and torch's global state are exactly as before, and nothing of ampscope is left
installed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import ampscope
from ampscope.models import gpt2
from ampscope.precision import matmul


def snapshot(model: nn.Module) -> dict:
    return {
        "params": {n: (p.detach().clone(), p.dtype, p.device, p.requires_grad,
                       None if p.grad is None else p.grad.clone(), p.data_ptr())
                   for n, p in model.named_parameters()},
        "buffers": {n: (b.clone(), b.dtype) for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks),
                      dict(m._backward_hooks), dict(m._backward_pre_hooks))
                  for n, m in model.named_modules()},
        "global_hooks": (dict(nn_module._global_forward_hooks),
                         dict(nn_module._global_forward_hooks_with_kwargs),
                         dict(nn_module._global_forward_hooks_always_called),
                         dict(nn_module._global_forward_pre_hooks),
                         dict(optim_module._global_optimizer_pre_hooks),
                         dict(optim_module._global_optimizer_post_hooks)),
        "modes": (torch._C._len_torch_function_stack(),
                  torch._C._len_torch_dispatch_stack()),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "matmul": matmul.snapshot(),  # every backend's fp32_precision, never the legacy getter
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "rng": torch.get_rng_state(),
    }


def assert_same(before: dict, after: dict) -> None:
    assert before["params"].keys() == after["params"].keys()
    for name, (value, dtype, device, rg, grad, ptr) in before["params"].items():
        v2, d2, dev2, rg2, g2, ptr2 = after["params"][name]
        assert torch.equal(value, v2), name
        assert (dtype, device, rg, ptr) == (d2, dev2, rg2, ptr2), name
        assert (grad is None) == (g2 is None) and (grad is None or torch.equal(grad, g2)), name
    for name, (value, dtype) in before["buffers"].items():
        assert torch.equal(value, after["buffers"][name][0]) and dtype == after["buffers"][name][1]
    for key in ("training", "hooks", "global_hooks", "modes", "autocast", "matmul",
                "default_dtype", "grad_enabled"):
        assert before[key] == after[key], key
    assert torch.equal(before["rng"], after["rng"])


@pytest.fixture
def user_model():
    """A model as a user holds it: in eval mode, a hook of their own, a stale gradient,
    a frozen parameter, and unusual global settings."""
    torch.manual_seed(0)
    lm = gpt2.load("gpt2-tiny")
    model = lm.module
    model.eval()
    model.transformer.h[0].register_forward_hook(lambda m, i, o: None)
    model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, 0.5)
    model.transformer.wpe.weight.requires_grad_(False)
    torch.set_float32_matmul_precision("medium")
    yield lm
    torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("setting", ["fp32", "bf16", "fp32+amp-bf16", "fp32+tf32"])
@pytest.mark.parametrize("workload", ["train", "forward", "generate"])
def test_state_is_unchanged_after_a_trace(user_model, setting, workload):
    before = snapshot(user_model.module)
    ampscope.trace(user_model, setting=setting, workload=workload, seq=8, new_tokens=2)
    assert_same(before, snapshot(user_model.module))


class Explodes(Exception):
    pass


@pytest.mark.parametrize("where", ["forward", "backward", "optimizer"])
def test_state_is_unchanged_when_the_run_fails(user_model, where):
    model = user_model.module
    before = snapshot(model)
    block = model.transformer.h[1]
    if where == "forward":
        handle = block.mlp.register_forward_hook(lambda m, i, o: (_ for _ in ()).throw(Explodes()))
    elif where == "backward":
        def arm(m, i, o):
            o.register_hook(lambda g: (_ for _ in ()).throw(Explodes()))
        handle = block.mlp.register_forward_hook(arm)
    else:
        handle = optim_module.register_optimizer_step_pre_hook(
            lambda *a: (_ for _ in ()).throw(Explodes()))
    before = snapshot(model)  # including the injected hook
    try:
        with pytest.raises(Explodes):
            ampscope.trace(user_model, setting="bf16+amp-bf16", workload="train", seq=8)
        assert_same(before, snapshot(model))
    finally:
        handle.remove()


def test_capture_leaves_nothing_installed_when_user_code_raises():
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    before = snapshot(model)
    with pytest.raises(Explodes), ampscope.capture(model):
        model(x)
        raise Explodes()
    assert_same(before, snapshot(model))


def test_the_new_tf32_api_is_neither_mixed_nor_changed():
    """A run with or without TF32 leaves every backend's fp32_precision as it was, and works
    after the user chose the new per-backend API (the legacy getter would raise there)."""
    model = gpt2.load("gpt2-tiny")
    before = matmul.snapshot()
    ampscope.trace(model, setting="fp32+tf32", workload="forward", seq=8)
    assert matmul.snapshot() == before  # not "ieee" where it was "none"
    old = torch.backends.fp32_precision
    torch.backends.fp32_precision = "tf32"
    try:
        chosen = matmul.snapshot()
        t = ampscope.trace(model, setting="fp32", workload="forward", seq=8)
        assert matmul.snapshot() == chosen and t.setting.matmul_precision == "highest"
    finally:
        torch.backends.fp32_precision = old
        matmul.restore(before)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autocast_fp16"])
def test_the_callers_modes_do_not_leak_into_a_run(mode):
    contexts = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                "autocast_fp16": lambda: torch.autocast("cpu", dtype=torch.float16)}
    with contexts[mode]():
        state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                 torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        t = ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", seq=8)  # a train step
        report = ampscope.numerics("gpt2-tiny", settings=["fp32+amp-bf16"], seq=8,
                                   workload="train")
        assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == state
    assert any(p.grad_dtype == "float32" for p in t.parameters)  # it did train
    linear = next(m for m in t.modules if m.type == "Linear" and m.phase == "forward")
    assert linear.outputs[0].dtype == "bfloat16"  # its own autocast, not the caller's fp16
    assert report.settings[0].loss is not None
