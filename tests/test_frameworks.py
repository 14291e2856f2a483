"""Scripts built on the training frameworks run unmodified under `ampscope run`, on the virtual
CUDA device and on this machine's CPU, and the trace shows what the framework does there.

Each script is the framework's usual shape on tiny shapes (a one-layer GPT-2 built from a config
with random weights, or a small MLP; an in-memory dataset; two steps asked for), run through the
CLI in a subprocess, as a user runs it. The truth each test asserts is the framework's own
source, named in the test; on --device cuda a framework only takes its GPU path if the virtual
device answers its device questions (`torch.cuda.is_available`, `is_bf16_supported`,
`device_count`, `get_device_capability`/`get_device_properties`, `mem_get_info`), so the path
it took is itself checked (what the framework prints, its device, its GradScaler).

Importing transformers or lightning takes seconds: each test runs one subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCALER_UNSCALE = "non_finite_check_and_unscale_"  # GradScaler.unscale_'s kernel, per step


def _needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{package} is not installed")


def run(tmp_path: Path, source: str, device: str, *args: str, predict: bool = False) -> dict:
    """`ampscope run --device DEVICE [--predict] --json out.json script.py ARGS`: the trace, with
    the script's stdout under "stdout" and stderr under "stderr"."""
    script, out = tmp_path / "train.py", tmp_path / "out.json"
    script.write_text(textwrap.dedent(source))
    command = [sys.executable, "-m", "ampscope", "run", "--device", device,
               *(["--predict"] if predict else []), "--json", str(out), str(script), *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    trace = json.loads(out.read_text())
    trace.update(stdout=done.stdout, stderr=done.stderr)
    return trace


def stopped_after_one_step(trace: dict) -> bool:
    return trace["workload"] == "train" and \
        any("stopped after its first optimizer step" in n for n in trace["notes"])


def matmul_dtypes(trace: dict) -> set[str]:
    """The output dtypes of the forward pass's weight matmuls (addmm and mm: Linear, GPT-2's
    Conv1D and its head; attention's own matmuls follow the attention kernel)."""
    return {o["out"][0] for o in trace["ops"]
            if o["phase"] == "forward" and o["op"].split(".")[1] in ("addmm", "mm")}


def param_dtypes(trace: dict) -> set[str]:
    return {p["dtype"] for p in trace["tensors"]["parameters"]}


def unscaled(trace: dict) -> bool:
    return any(SCALER_UNSCALE in o["op"] for o in trace["ops"] if o["phase"] == "optimizer")


# --- transformers.Trainer ------------------------------------------------------------------

HF = """
    import sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.arange(i, i + 8) % 64
            return {"input_ids": ids, "labels": ids}

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                        bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, max_steps=2,
                             report_to="none", save_strategy="no", logging_strategy="no",
                             use_cpu=not torch.cuda.is_available(), **{sys.argv[1]: True})
    print("device:", args.device)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens()).train()
"""


@_needs("transformers")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hf_trainer_on_cuda(tmp_path, precision):
    """transformers' Trainer hands mixed precision to accelerate (`Accelerator(mixed_precision=
    "bf16"|"fp16")`), whose `get_mixed_precision_context_manager` wraps the model's forward in
    `torch.autocast(device_type="cuda", dtype=torch.bfloat16|float16)`; for fp16 on a GPU it
    makes a `torch.amp.GradScaler("cuda")` (accelerate's `get_grad_scaler`), whose unscale_
    runs before the step. bf16=True passes TrainingArguments' check only where
    `torch.cuda.is_bf16_supported()` says yes. The weights stay float32."""
    trace = run(tmp_path, HF, "cuda", precision)
    assert "device: cuda:0" in trace["stdout"]  # TrainingArguments.device: the GPU path
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    setting = trace["setting"]
    assert (setting["device"], setting["emulated"], setting["autocast_dtype"]) == \
        ("cuda", True, dtype)
    assert matmul_dtypes(trace) == {dtype}
    assert param_dtypes(trace) == {"float32"}
    assert unscaled(trace) == (precision == "fp16")
    assert stopped_after_one_step(trace)


@_needs("transformers")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hf_trainer_on_cpu(tmp_path, precision):
    """On the CPU (`use_cpu=True`, as TrainingArguments' own error asks for bf16 without a
    GPU), accelerate turns autocast on for bf16 (`device.type in ["cpu", ...]: native_amp =
    True`: CPU autocast in bfloat16) and leaves fp16 off altogether: its fp16 branch requires
    `device.type != "cpu"`, so no autocast and no GradScaler, every matmul in float32."""
    trace = run(tmp_path, HF, "cpu", precision)
    assert "device: cpu" in trace["stdout"]
    setting = trace["setting"]
    expected = "bfloat16" if precision == "bf16" else None
    assert (setting["device"], setting["emulated"], setting["autocast_dtype"]) == \
        ("cpu", False, expected)
    assert matmul_dtypes(trace) == {expected or "float32"}
    assert param_dtypes(trace) == {"float32"}
    assert not unscaled(trace)
    assert stopped_after_one_step(trace)


# --- Lightning --------------------------------------------------------------------------------

LIGHTNING = """
    import torch
    from torch import nn
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    trainer = L.Trainer(precision="bf16-mixed", accelerator="auto", devices=1, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
"""


@_needs("lightning")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_lightning_bf16_mixed(tmp_path, device):
    """Lightning's accelerator connector picks CUDAAccelerator for accelerator="auto" when
    `CUDAAccelerator.is_available()` (its `num_cuda_devices()`, from torch.cuda) says a GPU is
    there, and prints "GPU available: True (cuda), used: True" (rank_zero_info in its
    accelerator connector); "bf16-mixed" is its MixedPrecision plugin, which runs
    training_step under `torch.autocast(device_type, dtype=torch.bfloat16)` on that device, the
    CPU's included. No GradScaler for bf16 (the plugin makes one only for "16-mixed")."""
    trace = run(tmp_path, LIGHTNING, device)
    gpu = device == "cuda"
    said = trace["stdout"] + trace["stderr"]  # Lightning's log goes to either, by its setup
    assert f"GPU available: {gpu}{' (cuda)' if gpu else ''}, used: {gpu}" in said
    setting = trace["setting"]
    assert (setting["device"], setting["emulated"], setting["autocast_dtype"]) == \
        (device, gpu, "bfloat16")
    assert matmul_dtypes(trace) == {"bfloat16"}
    assert param_dtypes(trace) == {"float32"}
    assert not unscaled(trace)
    assert stopped_after_one_step(trace)


# --- accelerate -----------------------------------------------------------------------------

ACCELERATE = """
    import sys
    import torch
    from torch import nn
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=sys.argv[1])
    print("device:", accelerator.device, "scaler:", type(accelerator.scaler).__name__)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    model, opt, dl = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, 4))
    for x, y in dl:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
"""


@_needs("accelerate")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accelerate_on_cuda(tmp_path, precision):
    """accelerate's Accelerator on a GPU: its device is `cuda` (PartialState, from
    torch.cuda.is_available()); `prepare(model)` wraps forward in `torch.autocast("cuda",
    dtype)` (get_mixed_precision_context_manager); fp16 makes a `torch.amp.GradScaler("cuda")`
    (get_grad_scaler) that `accelerator.backward` scales the loss with and the prepared
    optimizer's step unscales; bf16 makes none."""
    trace = run(tmp_path, ACCELERATE, "cuda", precision)
    scaler = "GradScaler" if precision == "fp16" else "NoneType"
    assert f"device: cuda scaler: {scaler}" in trace["stdout"]
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert (trace["setting"]["device"], trace["setting"]["autocast_dtype"]) == ("cuda", dtype)
    assert matmul_dtypes(trace) == {dtype}
    assert param_dtypes(trace) == {"float32"}
    assert unscaled(trace) == (precision == "fp16")
    assert stopped_after_one_step(trace)


@_needs("accelerate")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accelerate_on_cpu(tmp_path, precision):
    """On the CPU accelerate turns bf16 autocast on (`device.type in ["cpu", "xpu", "hpu"]`)
    and fp16 off: its fp16 branch requires `device.type != "cpu"`, so neither autocast nor a
    scaler, and the run is float32 throughout."""
    trace = run(tmp_path, ACCELERATE, "cpu", precision)
    assert "device: cpu scaler: NoneType" in trace["stdout"]
    expected = "bfloat16" if precision == "bf16" else None
    assert (trace["setting"]["device"], trace["setting"]["autocast_dtype"]) == ("cpu", expected)
    assert matmul_dtypes(trace) == {expected or "float32"}
    assert param_dtypes(trace) == {"float32"}
    assert not unscaled(trace)
    assert stopped_after_one_step(trace)


# --- a plain loop with DataLoader workers ----------------------------------------------------

PLAIN = """
    import json
    import os
    import torch
    from torch import nn
    from ampscope.torchcompat.dispatch import dispatch_stack_depth, function_stack_depth

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            # What the worker is: its process, the modes on its stacks, and a module it builds
            # (a dataset's transform), whose weight has values.
            weight = nn.Linear(2, 2).weight
            facts = [os.getpid(), function_stack_depth(), dispatch_stack_depth(),
                     float(weight.sum()) == float(weight.sum())]
            return torch.randn(8), i % 4, torch.tensor(facts)

    if __name__ == "__main__":
        use_cuda = torch.cuda.is_available()
        device = "cuda" if use_cuda else "cpu"
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.cuda.amp.GradScaler(enabled=use_cuda)
        loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2,
                                             pin_memory=True)
        for x, y, facts in loader:
            print(json.dumps({"main": os.getpid(), "x": str(x.device), "y": str(y.device),
                              "workers": facts.tolist()}))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device, dtype=torch.float16 if use_cuda else torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
"""


def _check_workers(trace: dict) -> None:
    """The workers were forked processes of their own, with no mode on their stacks (as under
    `python`: the script pushes none), whose modules have real weights (under --predict too),
    and the batch they made is on the CPU as the script sees it (a pinned batch is in host
    memory: torch's pin_memory keeps tensors on the CPU)."""
    line = next(s for s in trace["stdout"].splitlines() if s.startswith("{"))
    seen = json.loads(line)
    assert (seen["x"], seen["y"]) == ("cpu", "cpu")
    for pid, function_modes, dispatch_modes, has_values in seen["workers"]:
        assert pid != seen["main"]
        assert (function_modes, dispatch_modes, has_values) == (0, 0, 1)
    assert "Exception" not in trace["stderr"] and "DataLoader worker" not in trace["stderr"]


@pytest.mark.parametrize("predict", [False, True])
def test_dataloader_workers_on_cuda(tmp_path, predict):
    """torch.cuda.amp.GradScaler() on a GPU scales the loss and unscales the gradients before
    the step (its `_unscale_grads_`); autocast("cuda", float16) runs Linear in float16; and
    DataLoader(pin_memory=True) warns "no accelerator is found" only where
    `torch.accelerator` finds none (torch/utils/data/dataloader.py): on the GPU it is quiet."""
    trace = run(tmp_path, PLAIN, "cuda", predict=predict)
    _check_workers(trace)
    assert "pin_memory" not in trace["stderr"] and "accelerator" not in trace["stderr"]
    assert trace["setting"]["autocast_dtype"] == "float16"
    assert matmul_dtypes(trace) == {"float16"}
    assert unscaled(trace)
    assert stopped_after_one_step(trace)


def test_dataloader_workers_on_cpu_predicted(tmp_path):
    """On the CPU the script's branch is bfloat16 autocast with its GradScaler disabled
    (enabled=False: `scale` returns the loss as it is, `step` just steps)."""
    trace = run(tmp_path, PLAIN, "cpu", predict=True)
    _check_workers(trace)
    assert trace["setting"]["autocast_dtype"] == "bfloat16"
    assert matmul_dtypes(trace) == {"bfloat16"}
    assert not unscaled(trace)
    assert stopped_after_one_step(trace)
