"""The virtual device: model code that asks which device it is on sees the emulated one.

Each model here is written the way GPU training code is written (device branches at init,
dtypes fixed at import from torch.cuda, autocast regions switched off in model code), and each
test asserts what a real CUDA run of it shows, on this CPU-only machine.
"""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest
import torch
from torch import nn

import ampscope
from ampscope.runtime.emulation import Emulation
from ampscope.runtime.virtual_device import VirtualDevice

MODELS = '''
import torch
from torch import nn
from ampscope.models.base import LoadedModel

# Fixed when the module is imported, as some training code does.
COMPUTE_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32


class Tiny(nn.Module):
    """nanochat-style: the token embedding goes bf16 on CUDA in init_weights; bf16 rotary-like
    buffer; the logits go to float32 before the loss."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("cos", torch.ones(8, dim, dtype=torch.bfloat16))

    def init_weights(self):
        if self.wte.weight.device.type == "cuda":
            self.wte.to(dtype=torch.bfloat16)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        x = self.fc(x.float())
        # A region kept in float32 on purpose, as rotary or loss code does on CUDA.
        with torch.autocast("cuda", enabled=False):
            y = torch.nn.functional.linear(x.float(), self.fc.weight.float())
        logits = self.head(y).float()
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)),
                                                 targets.view(-1))


def build():
    with torch.device("meta"):
        model = Tiny()
    model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu")
    torch.nn.init.normal_(model.wte.weight)
    torch.nn.init.normal_(model.fc.weight)
    torch.nn.init.normal_(model.head.weight)
    torch.nn.init.zeros_(model.fc.bias)
    model.cos.fill_(1.0)
    model.init_weights()
    return LoadedModel("tiny", model, vocab_size=32, max_seq_len=8)
'''


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A fresh module name each time: import-time code runs again, as in a new process."""
    name = f"gpu_style_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def param(t, name):
    return next(p for p in t.parameters if p.name == name)


def module_out(t, name, phase="forward"):
    return next(m for m in t.modules if m.name == name and m.phase == phase).outputs[0].dtype


def test_init_time_device_branch_is_taken_on_virtual_cuda(models):
    cuda = ampscope.trace(f"{models}:build", setting="cuda:fp32+amp-bf16", seq=8)
    wte = param(cuda, "wte.weight")
    assert (wte.dtype, wte.grad_dtype) == ("bfloat16", "bfloat16")  # as on a GPU
    assert module_out(cuda, "wte") == "bfloat16"


@pytest.mark.parametrize("setting", ["fp32+amp-bf16", "mps:fp32+amp-bf16"])
def test_init_time_device_branch_is_not_taken_elsewhere(models, setting):
    t = ampscope.trace(f"{models}:build", setting=setting, seq=8)
    wte = param(t, "wte.weight")
    assert (wte.dtype, wte.grad_dtype) == ("float32", "float32")


def test_import_time_dtype_sees_the_virtual_device(models):
    import importlib

    ampscope.trace(f"{models}:build", setting="cuda:fp32", seq=8)
    # The module was first imported under the virtual device: its constant is CUDA's.
    assert torch.bfloat16 == importlib.import_module(models).COMPUTE_DTYPE


@pytest.mark.fast
def test_import_time_dtype_on_the_cpu(models):
    import importlib

    t = ampscope.trace(f"{models}:build", setting="fp32", seq=8)
    assert torch.float32 == importlib.import_module(models).COMPUTE_DTYPE
    assert module_out(t, "fc") == "float32"


@pytest.mark.fast
def test_autocast_disabled_region_in_model_code_runs_uncast(models):
    t = ampscope.trace(f"{models}:build", setting="cuda:fp32+amp-bf16", seq=8,
                       workload="forward")
    assert module_out(t, "fc") == "bfloat16"  # under CUDA's autocast
    # F.linear inside autocast("cuda", enabled=False) runs in float32; the head, outside the
    # region, is cast again.
    inside = [c for c in t.calls if c.func == "torch.nn.functional.linear" and c.module == ""]
    assert inside and all(c.outputs[0].dtype == "float32" for c in inside)
    assert module_out(t, "head") == "bfloat16"


@pytest.mark.fast
def test_virtual_device_answers_and_restores():
    before = (torch.cuda.is_available(), torch.compile, torch.is_autocast_enabled,
              nn.Parameter.__new__, torch.amp.autocast_mode.autocast.__init__)
    vd = VirtualDevice("cuda")
    with Emulation("cuda", torch.bfloat16), vd.active():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.is_bf16_supported()
        assert torch.cuda.get_device_capability() == (9, 0)
        props = torch.cuda.get_device_properties(0)
        assert props.total_memory == 80 * 2**30 and props.multi_processor_count == 132
        model = nn.Linear(4, 4)
        assert model.weight.device.type == "cpu"  # built without a device: on the CPU
        model.to("cuda")
        assert model.weight.is_cuda and model.weight.device == torch.device("cuda", 0)
        x = torch.randn(2, 4)
        assert x.device.type == "cpu" and not x.is_cuda
        x = x.pin_memory().to("cuda", non_blocking=True)
        assert x.is_cuda and x.get_device() == 0
        assert torch.arange(3, device=x.device).is_cuda  # a factory on the input's device
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cuda")
            assert model(x).dtype == torch.bfloat16
            with torch.autocast("cuda", enabled=False):
                assert model(x).dtype == torch.float32
        y = model(x).cpu()
        assert y.device.type == "cpu" and not y.is_cuda
        assert torch.compile(model) is model
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda.synchronize()
        end.record()
        assert start.elapsed_time(end) >= 0
    after = (torch.cuda.is_available(), torch.compile, torch.is_autocast_enabled,
             nn.Parameter.__new__, torch.amp.autocast_mode.autocast.__init__)
    assert after == before  # everything patched is back
    assert model.weight.device.type == "cpu"  # the tensors really were on the CPU


@pytest.mark.fast
def test_cuda_memory_calls_read_the_storage_tracker():
    model = nn.Linear(256, 256)  # 256 KiB of float32 weight, 1 KiB of bias

    seen = {}

    def step(m, batch):
        torch.cuda.reset_peak_memory_stats()
        out = m(batch["x"])
        seen["live"] = torch.cuda.memory_allocated()
        seen["peak"] = torch.cuda.max_memory_allocated()
        return out

    ampscope.trace(model, {"x": torch.randn(64, 256)}, setting="cuda:fp32", workload=step)
    # weight 262,144 + bias 1,024 + input 65,536 + output 65,536: each a multiple of 512
    assert seen["live"] == 262_144 + 1_024 + 65_536 + 65_536
    assert seen["peak"] >= seen["live"]


@pytest.mark.fast
def test_capture_on_a_virtual_device_around_your_own_loop():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with ampscope.capture(model, device="cuda") as t:
        model.to("cuda")
        x = torch.randn(4, 8, device="cuda")
        assert x.is_cuda and next(model.parameters()).is_cuda
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()
    assert t.setting.device == "cuda" and t.setting.emulated
    assert t.setting.autocast_dtype == "bfloat16"
    first = next(m for m in t.modules if m.name == "0" and m.phase == "forward")
    assert first.outputs[0].dtype == "bfloat16"
    assert any("saw cuda" in n for n in t.notes)
    assert not torch.cuda.is_available()
    assert next(model.parameters()).device.type == "cpu"


@pytest.mark.fast
@pytest.mark.parametrize("predict", [False, True])
def test_tensors_are_on_the_virtual_device_also_when_predicted(predict):
    """A fake tensor answers `.device` in Python (FakeTensor.device), not through a torch
    function: in predict mode it must still say cuda, or `x.to(hidden.device)` copies to the
    CPU and `torch.arange(..., device=hidden.device)` makes CPU tensors (HF's rotary embedding
    and position ids)."""

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            assert h.device.type == "cuda", h.device
            positions = torch.arange(h.shape[-1], device=h.device)
            return h * positions.to(h.device, torch.float32)

    t = ampscope.trace(Rotary(), torch.randn(2, 4), setting="cuda:fp32", predict=predict,
                       workload=lambda m, b: m(next(iter(b.values()))))
    copies = [o for o in t.ops if o.op == "aten._to_copy.default"]
    assert [(c.inputs[0].dtype, c.outputs[0].dtype) for c in copies] == [("int64", "float32")]


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.norm(self.proj(x), p=2, dim=-1)


@pytest.mark.fast
@pytest.mark.parametrize("predict", [False, None])
def test_device_branches_in_pytorchs_own_python_code_take_the_targets_path(predict):
    """torch.norm, written in Python, skips its linalg path on MPS (it reads input.device inside
    the call the mode handed on): on the virtual MPS device it runs aten.norm as an MPS device
    does, on the CPU and virtual CUDA linalg_vector_norm."""
    import ampscope

    def norms(setting):
        t = ampscope.trace(_Norm(), torch.randn(2, 4), setting=setting, workload="forward",
                           predict=predict)
        return [o.op for o in t.ops if "norm" in o.op]

    assert norms("mps:fp32") == ["aten.norm.ScalarOpt_dim"]
    assert norms("cuda:fp32") == norms("fp32") == ["aten.linalg_vector_norm.default"]


# --- what torch itself asks: torch.accelerator, optimizers, DataLoader, checkpointing ---------

ACCELERATOR = torch.accelerator


def _has(*names: str) -> bool:
    return all(hasattr(ACCELERATOR, name) for name in names)


@pytest.fixture
def virtual_cuda():
    with Emulation("cuda", torch.bfloat16), VirtualDevice("cuda").active() as vd:
        yield vd


@pytest.mark.fast
def test_torch_accelerator_answers_as_one_cuda_device(virtual_cuda):
    """What a single-GPU CUDA machine answers, on a CPU build (which says "no accelerator")
    and on a CUDA build without a GPU (which fails in the driver) alike."""
    assert ACCELERATOR.current_accelerator().type == "cuda"
    assert ACCELERATOR.current_accelerator(check_available=True) == torch.device("cuda")
    assert ACCELERATOR.is_available() and ACCELERATOR.device_count() == 1
    assert ACCELERATOR.current_device_index() == 0
    stream = ACCELERATOR.current_stream()
    assert not stream.is_capturing()  # what optimizers ask before every step
    stream.synchronize()
    assert ACCELERATOR.synchronize() is None
    assert not torch.cuda.is_current_stream_capturing()
    assert not torch.cuda.current_stream().is_capturing()
    assert torch.get_device_module() is torch.cuda
    assert "synchronize" in virtual_cuda.used


@pytest.mark.fast
@pytest.mark.skipif(not _has("set_device_index", "device_index"),
                    reason="torch.accelerator.set_device_index and device_index arrived in 2.8")
def test_torch_accelerator_device_switches_are_to_the_one_device(virtual_cuda):
    ACCELERATOR.set_device_index(0)
    with ACCELERATOR.device_index(0):
        assert ACCELERATOR.current_device_index() == 0


def _train_step(optimizer_class, **options) -> torch.Tensor:
    model = nn.Linear(4, 4).to("cuda")
    before = model.weight.detach().clone()
    optimizer = optimizer_class(model.parameters(), lr=0.1, **options)
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert model.weight.is_cuda
    return model.weight.detach() - before


@pytest.mark.fast
@pytest.mark.parametrize("options", [{}, {"foreach": True}, {"fused": True}],
                         ids=["default", "foreach", "fused"])
@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.AdamW])
def test_optimizer_steps_on_emulated_cuda(virtual_cuda, optimizer_class, options):
    """torch's optimizers ask the accelerator's stream (2.13+) or
    torch.cuda.is_current_stream_capturing() (before) in every step."""
    assert _train_step(optimizer_class, **options).abs().min() > 0  # every weight moved


@pytest.mark.fast
def test_grad_scaler_step_on_emulated_cuda(virtual_cuda):
    model = nn.Linear(4, 4).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    before = model.weight.detach().clone()
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)  # no overflow: the step is taken
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(2, 4, device="cuda")).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 1024.0
    assert not torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize("workers", [0, 1])
def test_pinned_dataloader_on_emulated_cuda(virtual_cuda, workers, recwarn):
    """pin_memory=True is what a CUDA machine honours: no "no accelerator is found" warning,
    and the pin-memory thread (which the device mode does not reach) pins nothing."""
    data = torch.utils.data.TensorDataset(torch.arange(8.0).view(4, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True,
                                         num_workers=workers)
    batches = [batch.to("cuda", non_blocking=True) for (batch,) in loader]
    assert [b.is_cuda for b in batches] == [True, True]
    assert torch.cat(batches).sum().item() == 28.0
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]


@pytest.mark.fast
def test_checkpointing_on_emulated_cuda_leaves_no_cached_device():
    from ampscope.torchcompat import devices

    slot = devices.checkpoint_device_slot()
    before = vars(slot[0])[slot[1]] if slot else None
    layer = nn.Linear(4, 4)
    with Emulation("cuda", torch.bfloat16), VirtualDevice("cuda").active():
        layer.to("cuda")
        x = torch.randn(2, 4, device="cuda", requires_grad=True)
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
        assert x.grad is not None
    assert (vars(slot[0])[slot[1]] if slot else None) == before


@pytest.mark.fast
def test_ipc_collect_is_refused_by_name():
    """A call that cannot be emulated fails with the one-line refusal naming it (a CUDA build
    without a GPU would otherwise run it as a silent no-op)."""

    def step(model, batch):
        torch.cuda.ipc_collect()
        return model(batch["x"])

    with pytest.raises(ampscope.AmpscopeError, match=r"needs torch\.cuda\.ipc_collect\(\)"):
        ampscope.trace(nn.Linear(2, 2), {"x": torch.randn(1, 2)}, setting="cuda:fp32",
                       workload=step)


@pytest.mark.fast
def test_torch_accelerator_is_restored():
    names = [n for n in dir(ACCELERATOR) if not n.startswith("_")]
    before = {n: getattr(ACCELERATOR, n) for n in names}
    answers = (ACCELERATOR.current_accelerator(), ACCELERATOR.is_available(),
               ACCELERATOR.device_count(), torch.cuda.is_available())
    capturing = torch.cuda.is_current_stream_capturing
    with Emulation("cuda", torch.bfloat16), VirtualDevice("cuda").active():
        assert ACCELERATOR.current_accelerator().type == "cuda"
    assert {n: getattr(ACCELERATOR, n) for n in names} == before
    assert torch.cuda.is_current_stream_capturing is capturing
    assert (ACCELERATOR.current_accelerator(), ACCELERATOR.is_available(),
            ACCELERATOR.device_count(), torch.cuda.is_available()) == answers


@pytest.mark.fast
def test_the_private_details_it_uses_are_found_on_this_torch():
    from ampscope.torchcompat import devices

    found = {f.name: f.available for f in devices.features()}
    essential = ["torch._C.TensorBase", "torch._C._nn._parse_to",
                 "torch.utils._device._device_constructors", "torch.utils.data._utils.pin_memory"]
    assert [name for name in essential if not found[name]] == []
