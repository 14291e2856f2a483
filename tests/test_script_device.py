"""Device questions a training script asks, answered by the virtual device as by the real one.

Each test writes a few-line script into tmp_path and runs it with `ampscope.script.run_script`
in this process, as `ampscope run --device cuda` does. The script writes what it saw to
facts.json; the test holds those facts to what the real device answers, each with its source.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ampscope.cli import main
from ampscope.script import run_script

# Writes the facts, then runs one step of a model (a run must call one) and is stopped there.
_END = """
with open("facts.json", "w") as f:
    json.dump(facts, f)
model = torch.nn.Linear(4, 2).to(device)
torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(2, 4, device=device)).sum().backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
"""


def run(tmp_path, monkeypatch, body: str, *, device: str = "cuda", predict: bool = False):
    """The script `body` (then `_END`) run on `device`: (its trace, its facts)."""
    script = tmp_path / "script.py"
    script.write_text("import json, torch\nfacts = {}\n" + textwrap.dedent(body) + _END)
    monkeypatch.chdir(tmp_path)
    trace = run_script(str(script), device=device, predict=predict, in_process=True)
    return trace, json.loads((tmp_path / "facts.json").read_text())


def _cuda_autocast_truth(dtype: torch.dtype) -> dict[str, str]:
    """The build's own AutocastCUDA kernels on fake cuda tensors: the dtype `mm`, `linear` and
    `softmax` of a bfloat16 input return under CUDA autocast to `dtype`."""
    enabled, fast = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        x = torch.empty(4, 4, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(4, 4, device="cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            return {"mm": str(torch.mm(x, x).dtype), "linear": str(torch.nn.functional.linear(x, w).dtype),
                    "softmax": str(torch.softmax(x, -1).dtype)}
        finally:
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", fast)


@pytest.mark.parametrize("predict", [False, True])
def test_autocast_float32_is_an_enabled_region(tmp_path, monkeypatch, predict):
    # torch/amp/autocast_mode.py checks the dtype against [bfloat16, float16] on every device
    # but CUDA, whose branch has no such check: float32 gives an enabled region, no warning.
    trace, facts = run(tmp_path, monkeypatch, """
        import warnings
        warnings.simplefilter("error")  # the CPU's "Disabling autocast" warning would raise
        device = "cuda"
        x = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
        w = torch.ones(4, 4, device=device)
        with torch.autocast("cuda", dtype=torch.float32):
            facts["enabled"] = torch.is_autocast_enabled("cuda")
            facts["dtype"] = str(torch.get_autocast_dtype("cuda"))
            facts["mm"] = str(torch.mm(x, x).dtype)
            facts["linear"] = str(torch.nn.functional.linear(x, w).dtype)
            facts["softmax"] = str(torch.softmax(x, -1).dtype)
            model = torch.nn.Linear(4, 2).to(device)
            model(x).float().sum().backward()
    """, predict=predict)
    assert facts.pop("enabled") is True and facts.pop("dtype") == "torch.float32"
    assert facts == _cuda_autocast_truth(torch.float32)
    assert trace.setting.autocast_dtype == "float32"


def test_load_with_map_location_naming_cuda(tmp_path, monkeypatch):
    # torch.serialization: a storage goes to the location map_location names (a device name,
    # a torch.device, a dict from saved location to location, a function of the storage and
    # its location); on a CUDA machine "cuda" is cuda:0. Values are what was saved.
    saved = {"w": torch.arange(6.0).view(2, 3), "n": torch.arange(4)}
    torch.save(saved, tmp_path / "ckpt.pt")
    _, facts = run(tmp_path, monkeypatch, """
        device = "cuda"
        for name, where in [("str", "cuda"), ("index", "cuda:0"), ("device", torch.device("cuda")),
                            ("dict", {"cpu": "cuda:0"}), ("moves", lambda s, loc: s.cuda()),
                            ("to", lambda s, loc: s.to(device="cuda")), ("cpu", "cpu"),
                            ("none", None)]:
            ckpt = torch.load("ckpt.pt", map_location=where)
            facts[name] = [str(ckpt["w"].device), str(ckpt["n"].device),
                           ckpt["w"].tolist(), ckpt["n"].tolist()]
        linear = torch.nn.Linear(3, 2).to(device)
        linear.load_state_dict({"weight": torch.load("ckpt.pt", map_location="cuda")["w"],
                                "bias": torch.zeros(2, device="cuda")})
        facts["loaded_into"] = [str(linear.weight.device), linear.weight.tolist()]
    """)
    values = [saved["w"].tolist(), saved["n"].tolist()]
    for name in ("str", "index", "device", "dict", "moves", "to"):
        assert facts[name] == ["cuda:0", "cuda:0", *values], name
    # A checkpoint saved from the CPU, loaded with no map_location or "cpu": on the CPU.
    assert facts["cpu"] == facts["none"] == ["cpu", "cpu", *values]
    assert facts["loaded_into"] == ["cuda:0", values[0]]


def test_load_under_predict_reports_cuda(tmp_path, monkeypatch):
    # As for a tensor made on the virtual device in a predicted run: the data stays real.
    torch.save(torch.arange(4), tmp_path / "tok.pt")
    _, facts = run(tmp_path, monkeypatch, """
        device = "cuda"
        t = torch.load("tok.pt", map_location="cuda")
        facts["t"] = [str(t.device), str((t + 1).device), t.tolist()]
    """, predict=True)
    assert facts["t"] == ["cuda:0", "cuda:0", [0, 1, 2, 3]]


def test_cuda_generator_and_seeds(tmp_path, monkeypatch):
    # torch.Generator: `device` is where it was made; manual_seed returns the generator and
    # sets initial_seed; a state read by get_state and put back by set_state replays the same
    # numbers, as reseeding does; `generator=` drives multinomial, randn and randperm.
    _, facts = run(tmp_path, monkeypatch, """
        device = "cuda"
        g = torch.Generator(device="cuda")
        facts["device"] = str(g.device)
        facts["returns_itself"] = g.manual_seed(42) is g
        facts["initial_seed"] = g.initial_seed()
        facts["is_generator"] = [isinstance(g, torch.Generator),
                                 isinstance(torch.default_generator, torch.Generator),
                                 type(torch.Generator()).__name__, str(torch.Generator().device)]
        state = g.get_state()
        first = torch.randn(3, generator=g, device=device)
        g.set_state(state)
        facts["state_replays"] = torch.equal(first, torch.randn(3, generator=g, device=device))
        p = torch.softmax(torch.ones(2, 5, device=device), -1)
        sample = torch.multinomial(p, 1, generator=g)
        perm = torch.randperm(6, generator=g, device=device)
        facts["sampled"] = [list(sample.shape), str(sample.device), sorted(perm.tolist())]
        torch.cuda.manual_seed(7)
        facts["cuda_seed"] = torch.cuda.initial_seed()
        a = torch.randn(3, device=device)
        torch.cuda.manual_seed_all(7)
        facts["cuda_reseed_replays"] = torch.equal(a, torch.randn(3, device=device))
        cuda_state = torch.cuda.get_rng_state()
        b = torch.randn(3, device=device)
        torch.cuda.set_rng_state(cuda_state)
        facts["cuda_state_replays"] = torch.equal(b, torch.randn(3, device=device))
        torch.cuda.set_rng_state_all(torch.cuda.get_rng_state_all())
    """)
    assert facts == {
        "device": "cuda:0", "returns_itself": True, "initial_seed": 42,
        "is_generator": [True, True, "Generator", "cpu"], "state_replays": True,
        "sampled": [[2, 1], "cuda:0", [0, 1, 2, 3, 4, 5]], "cuda_seed": 7,
        "cuda_reseed_replays": True, "cuda_state_replays": True,
    }


def test_trace_error_on_a_generator_line_names_it(tmp_path, monkeypatch, capsys):
    # A state of the wrong size is refused by a CUDA generator too (CUDAGeneratorImpl checks
    # its 16 bytes): the error must name the model's line, here the forward's set_state.
    (tmp_path / "gen_model.py").write_text(textwrap.dedent("""\
        import types, torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.config = types.SimpleNamespace(vocab_size=16, block_size=8)
                self.emb = torch.nn.Embedding(16, 4)
                self.g = torch.Generator(device="cuda")
            def forward(self, idx, targets=None):
                self.g.set_state(torch.zeros(3, dtype=torch.uint8, device="cpu"))
                return self.emb(idx)
        def build():
            return M()
    """))
    monkeypatch.chdir(tmp_path)
    code = main(["trace", "gen_model:build", "--device", "cuda", "--seq", "4", "--real",
                 "--workload", "forward"])
    err = capsys.readouterr().err
    assert code == 2
    assert "RuntimeError at gen_model.py:9:" in err, err


_SWAP = """
torch.manual_seed(0)
torch.__future__.set_swap_module_params_on_conversion(True)
model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
before = [id(p) for p in model.parameters()]
model = model.to(device).to(torch.bfloat16)
facts["same_objects"] = before == [id(p) for p in model.parameters()]
facts["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
facts["devices"] = sorted({p.device.type for p in model.parameters()})
"""


@pytest.mark.parametrize("device,predict", [("cuda", False), ("cpu", False), ("cuda", True),
                                            ("cpu", True)])
def test_swapped_parameters_convert_as_without_ampscope(tmp_path, monkeypatch, device, predict):
    # The truth is the same lines run by plain Python (no ampscope) on this machine's CPU:
    # swap_tensors keeps each parameter object and swaps in its converted contents.
    plain = tmp_path / "plain.py"
    plain.write_text("import json, torch\nfacts = {}\ndevice = 'cpu'\n" + _SWAP
                     + "facts['sum'] = sum(p.double().sum().item() for p in model.parameters())\n"
                     "print(json.dumps(facts))\n")
    truth = json.loads(subprocess.run([sys.executable, str(plain)], capture_output=True,
                                      text=True, check=True).stdout)
    real_only = "" if predict else \
        "facts['sum'] = sum(p.double().sum().item() for p in model.parameters())\n"
    try:
        _, facts = run(tmp_path, monkeypatch, f"device = {device!r}\n" + _SWAP + real_only,
                       device=device, predict=predict)
    finally:
        assert not torch.__future__.get_swap_module_params_on_conversion()  # given back
    truth["devices"] = [device]
    if predict:
        truth.pop("sum")
    assert facts == truth


def test_accelerator_on_a_script(tmp_path, monkeypatch, capsys):
    # torch.accelerator on a machine with one CUDA GPU: available, cuda, one device; the
    # DataLoader pins batches without its "no accelerator" warning (torch/utils/data/
    # dataloader.py warns only when torch.accelerator.is_available() is false).
    (tmp_path / "script.py").write_text("import json, torch\nfacts = {}\n" + textwrap.dedent("""
        import warnings
        warnings.simplefilter("error")
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \\
            else torch.device("cpu")
        facts["accelerator"] = [torch.accelerator.is_available(), str(device),
                                torch.accelerator.device_count()]
        data = torch.utils.data.TensorDataset(torch.arange(8.0).view(4, 2))
        for (batch,) in torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True):
            facts["batch"] = str(batch.to(device).device)
        facts["parameter"] = str(torch.nn.Linear(2, 2).to(device).weight.device)
    """) + _END)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--device", "cuda", "script.py"]) == 0
    header = " ".join(capsys.readouterr().out.split()[:40])
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts == {"accelerator": [True, "cuda", 1], "batch": "cuda:0", "parameter": "cuda:0"}
    assert "on cuda (emulated)" in header, header


@pytest.mark.parametrize("predict", [False, True])
def test_tensors_made_on_the_device_inside_backward_hooks(tmp_path, monkeypatch, predict):
    """Autograd runs tensor hooks and custom backward functions without torch-function modes:
    a buffer a hook makes with `torch.empty(..., device="cuda")` (as FSDP2's gradient reduction
    does) must land on the backing device and report cuda, as on a GPU. Truth: what a GPU run
    of these lines gives (the buffer on cuda:0, the gradient passed on unchanged)."""
    trace, facts = run(tmp_path, monkeypatch, """
    device = "cuda"
    x = torch.ones(3, device=device, requires_grad=True)

    def hook(grad):
        buffer = torch.empty(3, device=device)
        facts["buffer"] = str(buffer.device)
        return None

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            facts["made in backward"] = str(torch.zeros(1, device=device).device)
            return grad * 2

    y = Twice.apply(x)
    y.register_hook(hook)
    y.sum().backward()
    facts["grad"] = str(x.grad.device)
    """, predict=predict)
    assert facts == {"buffer": "cuda:0", "made in backward": "cuda:0", "grad": "cuda:0"}
