"""Never lose the user's state: after any trace — also one where the model raised mid-run —
the model and torch's global state are exactly as before, and nothing of ampscope is left
installed."""

from __future__ import annotations

import contextlib
import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optim_module

import ampscope
from ampscope.errors import AmpscopeError
from ampscope.models import gpt2
from ampscope.precision import matmul
from ampscope.torchcompat import devices
from tests.helpers import state_differences, torch_state


def snapshot(model: nn.Module) -> dict:
    """The model's own state, and all of torch's global state (`tests.helpers.torch_state`)."""
    return {
        "params": {n: (p.detach().clone(), p.dtype, p.device, p.requires_grad,
                       None if p.grad is None else p.grad.clone(), p.data_ptr())
                   for n, p in model.named_parameters()},
        "buffers": {n: (b.clone(), b.dtype) for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks),
                      dict(m._backward_hooks), dict(m._backward_pre_hooks),
                      dict(m._forward_hooks_with_kwargs), dict(m._state_dict_hooks),
                      dict(m._load_state_dict_pre_hooks))
                  for n, m in model.named_modules()},
        "ties": [id(p) for _, p in model.named_parameters(remove_duplicate=False)],
        "torch": torch_state(),
        "device_api": device_api_state(),
    }


def _public(module) -> dict[str, object]:
    return {name: getattr(module, name) for name in dir(module) if not name.startswith("_")}


def device_api_state() -> dict[str, object]:
    """The device API torch's own code asks, which an emulated GPU run answers for its
    duration: the same objects, and the same answers, after it as before (torch.accelerator,
    torch.cuda, torch.get_device_module, the DataLoader's batch pinning, and the device type
    activation checkpointing caches)."""
    accelerator = torch.accelerator
    pinning = devices.dataloader_pinning()
    slot = devices.checkpoint_device_slot()
    return {
        "accelerator": _public(accelerator),
        "cuda": _public(torch.cuda),
        "get_device_module": torch.get_device_module,
        "answers": (accelerator.current_accelerator(), accelerator.is_available(),
                    accelerator.device_count(), torch.cuda.is_available(),
                    torch.cuda.device_count()),
        "pin_memory": getattr(pinning, "pin_memory", None),
        "checkpoint_device": vars(slot[0])[slot[1]] if slot is not None else None,
    }


def device_api_differences(before: dict, after: dict) -> list[str]:
    """What differs, by name (names torch imported lazily during the run are not compared)."""
    differences = []
    for key, value in before.items():
        if isinstance(value, dict):
            differences += [f"{key}.{name}" for name, v in value.items()
                            if after[key].get(name) is not v]
        elif after[key] != value:
            differences.append(key)
    return differences


def assert_same(before: dict, after: dict) -> None:
    assert before["params"].keys() == after["params"].keys()
    for name, (value, dtype, device, rg, grad, ptr) in before["params"].items():
        v2, d2, dev2, rg2, g2, ptr2 = after["params"][name]
        assert torch.equal(value, v2), name
        assert (dtype, device, rg, ptr) == (d2, dev2, rg2, ptr2), name
        assert (grad is None) == (g2 is None) and (grad is None or torch.equal(grad, g2)), name
    for name, (value, dtype) in before["buffers"].items():
        assert torch.equal(value, after["buffers"][name][0]) and dtype == after["buffers"][name][1]
    for key in ("training", "hooks", "ties"):
        assert before[key] == after[key], key
    assert state_differences(before["torch"], after["torch"]) == []
    assert device_api_differences(before["device_api"], after["device_api"]) == []


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


@pytest.mark.fast
@pytest.mark.parametrize("setting", ["fp32", "bf16", "fp32+amp-bf16", "fp32+tf32"])
@pytest.mark.parametrize("workload", ["train", "forward", "generate"])
def test_state_is_unchanged_after_a_trace(user_model, setting, workload):
    before = snapshot(user_model.module)
    ampscope.trace(user_model, setting=setting, workload=workload, seq=8, new_tokens=2)
    assert_same(before, snapshot(user_model.module))


class Explodes(Exception):
    pass


def fail(fault: str):
    raise KeyboardInterrupt() if fault == "interrupt" else Explodes(fault)


FAULTS = ["forward", "loss", "backward", "optimizer", "interrupt"]
# Each API on a train step (numerics too: its train workload reaches backward and the optimizer).
APIS = {
    "trace": lambda lm: ampscope.trace(lm, setting="bf16+amp-bf16", seq=8),
    "trace-predicted": lambda lm: ampscope.trace(lm, setting="fp32+amp-bf16", seq=8,
                                                 predict=True),
    "numerics": lambda lm: ampscope.numerics(lm, settings=["fp32+amp-bf16"], seq=8,
                                             workload="train"),
    "memory": lambda lm: ampscope.memory(lm, setting="fp32+tf32", seq=8),
    "flops": lambda lm: ampscope.flops(lm, setting="fp32+amp-bf16", seq=8, step_time=0.5),
    "matrix": lambda lm: ampscope.matrix(lm, settings=["fp32", "fp32+amp-bf16"], seq=8),
}


@contextlib.contextmanager
def injected(lm, fault: str):
    """`fault` injected into the user's model (a hook of theirs) or its loss, removed after."""
    block = lm.module.transformer.h[1]
    if fault in ("forward", "interrupt"):
        handle = block.mlp.register_forward_hook(lambda m, i, o: fail(fault))
    elif fault == "backward":
        def arm(module, args, output):
            output.register_hook(lambda grad: fail(fault))

        handle = block.mlp.register_forward_hook(arm)
    elif fault == "optimizer":
        handle = optim_module.register_optimizer_step_pre_hook(lambda *a: fail(fault))
    else:
        def loss(module, batch):
            gpt2_loss = module(batch["idx"], batch["targets"])[1]
            fail(fault)
            return gpt2_loss

        original, lm.loss_fn = lm.loss_fn, loss
        handle = SimpleNamespace(remove=lambda: setattr(lm, "loss_fn", original))
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("api", APIS)
def test_state_is_unchanged_when_the_run_fails(user_model, api, fault):
    with injected(user_model, fault):
        before = snapshot(user_model.module)  # the injected hook included
        with pytest.raises(KeyboardInterrupt if fault == "interrupt" else Explodes):
            APIS[api](user_model)
        assert_same(before, snapshot(user_model.module))


SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    fault = sys.argv[1]

    def fail():
        raise KeyboardInterrupt() if fault == "interrupt" else RuntimeError(fault)

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    if fault in ("forward", "interrupt"):
        model[1].register_forward_hook(lambda m, i, o: fail())
    if fault == "optimizer":
        optimizer.register_step_pre_hook(lambda *a: fail())
    torch.set_default_dtype(torch.float64)  # global state the script changes: put back
    torch.backends.fp32_precision = "tf32"
    sys.path.insert(0, "/somewhere/else")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 4, dtype=torch.float32))
        if fault == "backward":
            out.register_hook(lambda g: fail())
        loss = out.float().pow(2).mean()
    if fault == "loss":
        fail()
    loss.backward()
    optimizer.step()
""")


@pytest.mark.fast
@pytest.mark.parametrize("predict", [False, True])
@pytest.mark.parametrize("fault", FAULTS)
def test_state_is_unchanged_when_a_script_fails(tmp_path, fault, predict):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    before, devices_before = torch_state(), device_api_state()
    with pytest.raises(KeyboardInterrupt if fault == "interrupt" else AmpscopeError,
                       match=None if fault == "interrupt" else fault):
        ampscope.run_script(str(script), [fault], device="cuda" if predict else None,
                            predict=predict, in_process=True)
    assert state_differences(before, torch_state()) == []
    assert device_api_differences(devices_before, device_api_state()) == []


@pytest.mark.parametrize("fault", [None, "optimizer", "interrupt"])
def test_the_device_api_is_back_after_an_emulated_cuda_run(user_model, fault):
    """An emulated CUDA train step answers torch.accelerator, torch.cuda and the DataLoader as
    one GPU would (optimizers ask before every step): all of it is put back, also when the run
    raised."""
    with contextlib.nullcontext() if fault is None else injected(user_model, fault):
        before = snapshot(user_model.module)
        with contextlib.nullcontext() if fault is None else \
                pytest.raises(KeyboardInterrupt if fault == "interrupt" else Explodes):
            ampscope.trace(user_model, setting="cuda:fp32+amp-bf16", seq=8)
        assert_same(before, snapshot(user_model.module))


@pytest.mark.parametrize("fault", FAULTS)
def test_state_is_unchanged_when_user_code_in_capture_fails(user_model, fault):
    """capture() watches the user's own code: their modes win inside, and after a failure
    nothing of ampscope is left installed."""
    lm = user_model
    model = lm.module
    with injected(lm, fault):
        before = snapshot(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        batch = lm.make_batch(1, 8, "train", torch.Generator().manual_seed(0))
        with pytest.raises(KeyboardInterrupt if fault == "interrupt" else Explodes), \
                ampscope.capture(model):
            lm.loss(batch).backward()
            optimizer.step()
        # What the user's own code did is theirs: gradients it accumulated go back by hand.
        for name, p in model.named_parameters():
            p.grad = before["params"][name][4]
        assert_same(before, snapshot(model))


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


@pytest.mark.parametrize("how", ["predicted", "real", "capture"])
def test_a_dropped_trace_is_freed_without_the_garbage_collector(how):
    """Nothing of a run is left in a reference cycle: dropping the trace frees it, and every
    record in it, at once (Python's reference counts, with the collector off), instead of
    leaving tens of thousands of objects for a later collection to walk (0.25 s after a 70B
    step, paid by whatever ran next)."""
    import gc
    import weakref

    # The first fake tensor mode of a process imports torch._dynamo, where torch.fx's `wrap`
    # keeps its own frame in a cycle (`inspect.currentframe()` in a local), and with it every
    # frame that called it: PyTorch's garbage, one time only, and not the run's.
    import torch._dynamo

    model = gpt2.GPT(gpt2.PRESETS["gpt2-tiny"])
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        if how == "capture":
            with ampscope.capture(model) as trace:
                model(torch.zeros(1, 8, dtype=torch.long))
        else:
            trace = ampscope.trace(model, setting="cuda:bf16" if how == "predicted" else "fp32",
                                   workload="train", seq=8, predict=how == "predicted")
        gone = weakref.ref(trace)
        first_op = weakref.ref(trace.ops[0]) if hasattr(trace.ops[0], "__weakref__") else None
        del trace
        assert gone() is None
        assert first_op is None or first_op() is None
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize(("enabled", "predict"), [(True, True), (True, False), (False, False)])
def test_the_collector_runs_only_in_a_real_step_and_comes_back_as_it_was(enabled, predict):
    """Python's garbage collector, read with `gc.isenabled()` from the model's forward: paused
    in a predicted step (as while ampscope builds, records and derives: tens of thousands of
    objects, no garbage), running in a real step if it was running before (its tensors may be
    in cycles a collection frees), and afterwards exactly as the caller had it."""
    import gc

    seen: list[bool] = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            seen.append(gc.isenabled())
            return self.proj(x)

    was_enabled = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        ampscope.trace(Probe(), {"x": torch.randn(2, 4)}, workload="forward", predict=predict)
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()
    assert seen == [enabled and not predict]


def test_the_state_check_sees_a_replacement_left_in_place():
    """The check the tests above rely on: an attribute replaced through ampscope.patches and
    not put back shows, and is gone once undone."""
    from ampscope import patches

    before = torch_state()
    undo = patches.patch(torch.cuda, "is_available", lambda: True)
    try:
        changed = state_differences(before, torch_state())
        assert any(line.startswith("patches_active") for line in changed)
        assert any(line.startswith("cuda_api") for line in changed)
    finally:
        undo()
    assert state_differences(before, torch_state()) == []
