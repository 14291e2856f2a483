"""The virtual cuda device is the GPU a run asks for (`--gpu`, `gpu=`), not always an H100.

What a script sees (name, memory, SM count, compute capability, bf16 support) is the asked
entry of the hardware table, and every choice that reads the capability follows it: SDPA's
kernel is the one `runtime/attention_choice.py`'s rules (the build's own) pick on that
capability. Without a GPU named, the device is the H100 it always was; an accelerator with no
CUDA compute capability (MI300X) cannot be the virtual cuda device, and a note says so.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import ampscope
from ampscope import hardware
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.runtime.attention_choice import CudaTarget, TensorSpec, choose_backend
from ampscope.script import run_script
from ampscope.torchcompat.ops import AMP_UPDATE_SCALE_NAME

# CUDA's compute-capability table (NVIDIA's list of CUDA GPUs), read by hand, by product.
CUDA_TABLE = {"v100": (7, 0), "v100-16gb": (7, 0), "v100-pcie": (7, 0), "v100-pcie-16gb": (7, 0),
              "t4": (7, 5), "a100": (8, 0), "a100-40gb": (8, 0), "a100-pcie": (8, 0),
              "a10": (8, 6), "rtx3090": (8, 6), "l4": (8, 9), "l40s": (8, 9), "rtx4090": (8, 9),
              "h100": (9, 0), "h100-pcie": (9, 0), "h100-nvl": (9, 0), "h200": (9, 0),
              "b200": (10, 0)}

# A script that reports what its device says, then runs one bf16-autocast attention step.
# B=1, H=2, T=16, D=16: shapes every fused kernel takes (head dim a multiple of 8).
_SCRIPT = """
import json, torch
import torch.nn.functional as F
props = torch.cuda.get_device_properties(0)
facts = {"name": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
         "memory": props.total_memory, "sms": props.multi_processor_count,
         "bf16": torch.cuda.is_bf16_supported(),
         "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False)}
with open("facts.json", "w") as f:
    json.dump(facts, f)
qkv = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3)).to("cuda")
x = torch.randn(1, 2, 16, 16, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    q, k, v = (linear(x) for linear in qkv)
    loss = F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()
loss.backward()
torch.optim.SGD(qkv.parameters(), lr=0.1).step()
"""


def _run(tmp_path, monkeypatch, gpu, script: str = _SCRIPT):
    """The script run on the virtual cuda device asked to be `gpu`: (its trace, its facts)."""
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    monkeypatch.chdir(tmp_path)
    trace = run_script("script.py", device="cuda", predict=True, in_process=True, gpu=gpu)
    return trace, json.loads((tmp_path / "facts.json").read_text())


def _expected_attention(target: CudaTarget) -> str:
    """The forward op the build's rules pick for the script's SDPA call on `target`."""
    q = TensorSpec((1, 2, 16, 16), torch.bfloat16, requires_grad=True)
    choice = choose_backend(q, q, q, is_causal=True, target=target)
    return choice.forward_op


def _attention_ops(trace) -> set[str]:
    return {o.op for o in trace.ops if o.phase == "forward" and "scaled_dot_product" in o.op}


@pytest.mark.fast
def test_every_nvidia_entry_has_its_cuda_compute_capability_with_its_source():
    for acc in hardware.KNOWN:
        if acc.title.startswith("NVIDIA"):
            assert acc.capability == CUDA_TABLE[acc.name], acc.name
            assert "CUDA GPUs" in acc.sources["capability"], acc.name
        else:  # the MI300X: ROCm, no CUDA compute capability
            assert acc.capability is None and "capability" not in acc.sources, acc.name
    assert set(CUDA_TABLE) == {a.name for a in hardware.KNOWN if a.capability is not None}


@pytest.mark.fast
@pytest.mark.parametrize("written,expected", [('"8.6"', (8, 6)), ("[8, 9]", (8, 9)),
                                              ('" 10.0 "', (10, 0))])
def test_a_users_entry_may_give_a_capability(tmp_path, monkeypatch, written, expected):
    path = tmp_path / "hardware.toml"
    path.write_text(f'[mygpu]\nmemory = "24GiB"\npeak_flops = {{ bf16 = 1e14 }}\n'
                    f"capability = {written}\n[plain]\nmemory = \"8GiB\"\n"
                    "peak_flops = { fp32 = 1e13 }\n[a100]\nmemory = \"40GiB\"\n")
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(path))
    mine = hardware.by_name("mygpu")
    assert mine.capability == expected and mine.sources["capability"] == str(path)
    assert hardware.by_name("plain").capability is None  # optional: none given, none known
    assert hardware.by_name("a100").capability == (8, 0)  # a built-in's, kept under an override


@pytest.mark.fast
@pytest.mark.parametrize("written", ["8.0", '"eight"', "[8]", "[8, true]", '"8"'])
def test_a_capability_written_otherwise_is_refused_in_one_line(tmp_path, monkeypatch, written):
    path = tmp_path / "hardware.toml"
    path.write_text(f'[a100]\ncapability = {written}\n')
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(path))
    with pytest.raises(AmpscopeError) as info:
        hardware.by_name("a100")
    assert str(info.value).startswith(f"{path}: [a100]: capability must be \"MAJOR.MINOR\" or "
                                      "[MAJOR, MINOR]")


def test_a_script_on_an_a100_sees_an_a100_and_runs_its_attention_kernel(tmp_path, monkeypatch):
    trace, facts = _run(tmp_path, monkeypatch, "a100")
    a100 = hardware.A100
    assert facts == {"name": "NVIDIA A100 SXM4 80GB", "capability": [8, 0],
                     "memory": a100.memory_bytes, "sms": 108, "bf16": True, "bf16_native": True}
    flash = _expected_attention(CudaTarget("A100", (8, 0)))
    # cuDNN goes first only on sm9x/10x: on sm80 flash does
    assert flash == "aten._scaled_dot_product_flash_attention.default"
    assert flash != _expected_attention(CudaTarget("H100", (9, 0)))  # so the capability decided
    assert _attention_ops(trace) == {flash}
    assert any("saw cuda (one NVIDIA A100 SXM4 80GB, compute capability 8.0)" in n
               for n in trace.notes)
    assert any("picks on an A100 (sm80" in n and "flash" in n for n in trace.notes)


def test_without_a_gpu_the_script_sees_the_h100_as_before(tmp_path, monkeypatch):
    trace, facts = _run(tmp_path, monkeypatch, None)
    assert facts["name"] == "NVIDIA H100 SXM5 80GB" and facts["capability"] == [9, 0]
    assert facts["sms"] == 132 and facts["bf16_native"]
    cudnn = _expected_attention(CudaTarget("H100", (9, 0)))
    assert cudnn == "aten._scaled_dot_product_cudnn_attention.default"
    assert _attention_ops(trace) == {cudnn}


def test_a_v100_answers_bf16_as_torch_does_there(tmp_path, monkeypatch):
    """torch.cuda.is_bf16_supported() is True on a V100 (compute capability 7.0): torch makes a
    bfloat16 tensor there, which CUDA emulates; only including_emulation=False says False. bf16
    attention on sm70 has no fused kernel (flash and cuDNN need sm80, mem-efficient takes bf16
    from sm80): the math path, whose composite op is never recorded, only its matmuls."""
    trace, facts = _run(tmp_path, monkeypatch, "v100")
    assert facts["name"] == "NVIDIA V100 SXM2 32GB" and facts["capability"] == [7, 0]
    assert facts["bf16"] is True and facts["bf16_native"] is False
    math = _expected_attention(CudaTarget("V100", (7, 0)))
    assert math == "aten._scaled_dot_product_attention_math.default"
    assert _attention_ops(trace) == set()
    assert any("picks on a V100 (sm70" in n and "math" in n and "× 1" in n for n in trace.notes)


_PICKS_BY_HARDWARE = """
import torch
native = torch.cuda.is_bf16_supported(including_emulation=False)
dtype = torch.bfloat16 if native else torch.float16
model = torch.nn.Linear(8, 8).to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
with open("facts.json", "w") as f:
    f.write("{}")
with torch.autocast("cuda", dtype=dtype):
    loss = model(torch.randn(4, 8, device="cuda")).float().sum()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
"""


@pytest.mark.parametrize("gpu,dtype,scaled", [("t4", "float16", True),
                                               ("a100", "bfloat16", False)])
def test_a_script_that_asks_for_native_bf16_picks_by_the_asked_gpu(tmp_path, monkeypatch, gpu,
                                                                    dtype, scaled):
    trace, _ = _run(tmp_path, monkeypatch, gpu, _PICKS_BY_HARDWARE)
    assert trace.setting.autocast_dtype == dtype
    assert any(o.op == AMP_UPDATE_SCALE_NAME for o in trace.ops) == scaled


def test_an_accelerator_without_a_capability_keeps_the_h100_and_says_so(tmp_path, monkeypatch):
    trace, facts = _run(tmp_path, monkeypatch, "mi300x")
    assert facts["name"] == "NVIDIA H100 SXM5 80GB" and facts["capability"] == [9, 0]
    assert any(n.startswith("The virtual cuda device is not the asked AMD Instinct MI300X "
                            "192GB (mi300x): the hardware table gives it no CUDA compute "
                            "capability") for n in trace.notes)


def test_trace_and_its_command_line_run_on_the_asked_gpu(tmp_path, capsys):
    t = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16", seq=8, gpu="t4")
    assert _attention_ops(t) == set()  # bf16 on sm75: math
    assert any("NVIDIA T4 16GB, compute capability 7.5" in n for n in t.notes)
    out = tmp_path / "t.json"
    assert main(["trace", "gpt2-tiny", "--setting", "cuda:fp32+amp-bf16", "--seq", "8",
                 "--gpu", "a100", "--json", str(out)]) == 0
    ops = {o["op"] for o in json.loads(out.read_text())["ops"] if o["phase"] == "forward"}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert not any("cudnn" in op for op in ops)


def test_flops_and_matrix_run_on_the_gpu_they_price_the_step_on(monkeypatch):
    """`flops --gpu` and `matrix --gpu` (and `diff`, through `matrix`) build every run's
    environment with the GPU they predict the step on."""
    from ampscope.api import tracing

    seen: list[str | None] = []

    class Recorded(tracing.RunEnvironment):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self.virtual.accelerator.name if self.virtual is not None else None)

    monkeypatch.setattr(tracing, "RunEnvironment", Recorded)
    report = ampscope.flops("gpt2-tiny", setting="cuda:fp32+amp-bf16", seq=8, gpu="l4")
    assert report.predicted is not None and report.predicted.accelerator == "l4"
    assert seen and set(seen) == {"l4"}
    seen.clear()
    ampscope.matrix("gpt2-tiny", settings=["cuda:fp32", "cuda:fp32+amp-bf16"], seq=8,
                    gpu="a10")
    assert seen and set(seen) == {"a10"}
