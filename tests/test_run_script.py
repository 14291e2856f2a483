"""`ampscope run`: the user's own script, unmodified, on this machine or on a virtual device.

The script is examples/gpt/train.py, a GPU training script in the usual shape: settings
overridden by --name=value, dtype picked from torch.cuda.is_available() and
is_bf16_supported(), torch.amp.autocast through a nullcontext on the CPU, a GradScaler enabled
only for float16, torch.cuda.synchronize() around its timer, torch.compile when asked, and a
memory-mapped token file. Each test asserts what a real run of it on that device shows.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import ampscope
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.records import Phase
from ampscope.script import run_script as run_script_anywhere
from tests.helpers import assert_same_trace


def run_script(*args, **kwargs):
    """In this process, as the CLI runs it: these tests watch the run from inside (spies on
    the recorders, the caller's state). tests/test_script_guest.py covers the child process."""
    return run_script_anywhere(*args, **kwargs, in_process=True)

EXAMPLE = Path(__file__).parent.parent / "examples" / "gpt" / "train.py"


@pytest.fixture
def data(tmp_path):
    """A small token file the script memory-maps."""
    np.random.default_rng(0).integers(0, 512, 5_000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    return f"--data_dir={tmp_path}"


def module_out(t, name):
    return next(m for m in t.modules if m.name == name and m.phase == "forward").outputs[0]


def test_virtual_cuda_takes_the_scripts_cuda_branch(data):
    t = run_script(str(EXAMPLE), [data, "--block_size=16", "--compile=True"], device="cuda")
    assert t.setting.device == "cuda" and t.setting.emulated
    assert t.setting.autocast_dtype == "bfloat16"  # is_bf16_supported() said yes
    assert module_out(t, "blocks.0.fc").dtype == "bfloat16"  # Linear under bf16 autocast
    assert module_out(t, "ln_f").dtype == "float32"
    loss = next(c for c in t.calls if "cross_entropy" in c.func)
    assert loss.outputs[0].dtype == "float32"
    # GradScaler(enabled=False) for bf16: no loss scaling, no unscale kernel.
    assert not any("_amp_foreach_non_finite_check_and_unscale_" in o.op for o in t.ops)
    # One optimizer step, then the script was stopped.
    assert sum(1 for c in t.calls if c.phase == "optimizer") > 0
    assert any("stopped after its first optimizer step" in n for n in t.notes)
    assert any("torch.compile was called" in n for n in t.notes)


def test_cpu_takes_the_scripts_cpu_branch(data):
    t = run_script(str(EXAMPLE), [data, "--block_size=16"])
    assert t.setting.device == "cpu" and not t.setting.emulated
    assert t.setting.autocast_dtype is None  # nullcontext on the CPU: no autocast
    assert module_out(t, "blocks.0.fc").dtype == "float32"


def test_float16_enables_the_grad_scaler(data):
    t = run_script(str(EXAMPLE), [data, "--block_size=16", "--dtype=float16"], device="cuda")
    assert module_out(t, "blocks.0.fc").dtype == "float16"
    assert any("_amp_foreach_non_finite_check_and_unscale_" in o.op for o in t.ops)


def test_steps_counts_optimizer_steps(data):
    t = run_script(str(EXAMPLE), [data, "--block_size=16"], device="cuda", steps=2)
    assert max(c.step for c in t.calls) == 2  # two calls of the model
    assert any("stopped after its second optimizer step" in n for n in t.notes)


def test_script_memory_logging_prints_the_tracked_peak(tmp_path, capsys, data):
    # The script prints torch.cuda.max_memory_allocated() after its step: a script that stops
    # after step 2 has printed step 1's figure, answered by the storage tracker in 512-byte
    # blocks.
    t = run_script(str(EXAMPLE), [data, "--block_size=16"], device="cuda", steps=2)
    out = capsys.readouterr().out
    printed = int(out.split("max memory allocated ")[1].split(" B")[0].replace(",", ""))
    assert printed > 0 and printed % 512 == 0
    # At least the weights, their gradients and AdamW's two moments (136,960 float32 each).
    assert printed >= 4 * 136_960 * 4
    assert any("max_memory_allocated() answered from ampscope's storage tracker" in n
               for n in t.notes)


def test_predict_runs_a_full_size_config_without_memory(data):
    import resource

    # A 6.6-billion-parameter configuration: 26 GB of float32 weights if materialised.
    args = [data, "--n_layer=32", "--n_embd=4096", "--n_head=32", "--vocab_size=32000",
            "--block_size=1024"]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = run_script(str(EXAMPLE), args, device="cuda", predict=True)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # kB on Linux
    assert t.mode == "predict"
    assert t.model.parameters == 6_579_429_376
    assert {s.key for s in t.optimizer_state} == {"step", "exp_avg", "exp_avg_sq"}
    assert grown < 1_500_000  # well under 2 GB (the largest single weight is 0.5 GB)


@pytest.mark.parametrize("device", ["cuda", "mps", None])
def test_a_predicted_script_records_what_its_real_run_records(data, device):
    """The ground truth is the same script run on real tensors (on the virtual device where it
    is one): the predicted run has the same user-level calls from the same lines, the same ops
    in the same modules and phases, and the same memory peak at the same op. What it took to
    get there: PyTorch picks AdamW's foreach path (and clip_grad_norm_'s) for real CUDA tensors
    only; a fake weight must be where its real one was (on the CPU until `model.to(device)`
    copies it); a fake weight made a parameter must not show the detach a real one never
    makes; and the `.item()` mode's frame is no caller. One difference stays: the step's log
    line reads `loss.item()` (it runs: the run stops at the next forward pass), which the real
    run dispatches and the predicted one answers with NaN, dispatching nothing (script/predicted.py
    `fake_values`): that call and its op are the real run's only."""
    import collections

    from ampscope.analysis.memory import memory_report

    args = [data, "--n_layer=4", "--block_size=16"]
    real = run_script(str(EXAMPLE), args, device=device)
    fake = run_script(str(EXAMPLE), args, device=device, predict=True)
    assert fake.mode == "predict"
    log_line = "train.py:92"  # print(f"iter {it}: loss {loss.item():.4f}, ...")

    def calls(t):
        return collections.Counter((c.func, c.source) for c in t.calls)

    def ops(t):
        return collections.Counter((o.op, o.phase, o.module, o.source) for o in t.ops)

    assert calls(real) - calls(fake) == collections.Counter({("Tensor.item", log_line): 1})
    assert ops(real) - ops(fake) == collections.Counter(
        {("aten._local_scalar_dense.default", Phase.OPTIMIZER, None, log_line): 1})
    assert calls(fake) - calls(real) == collections.Counter()
    assert ops(fake) - ops(real) == collections.Counter()
    assert any(o.op == "aten._foreach_sqrt.default" for o in real.ops) == (device == "cuda")
    assert memory_report(fake).peak == memory_report(real).peak


def test_predicted_script_thins_its_optimizers_foreach_ops_to_the_same_trace(data, monkeypatch):
    """On the virtual CUDA device the script's AdamW runs foreach; predicted, its ops run over
    one entry of each kind (runs/foreach.py). The ground truth is the same run with every
    entry dispatched: the trace and the memory peak are the same."""
    from ampscope.runs import foreach

    args = [data, "--n_layer=4", "--block_size=16"]
    original = foreach.thinned_call
    thinned = []

    def spy(func, args_, kwargs):
        out = original(func, args_, kwargs)
        thinned.append(out is not foreach.NOT_THINNED)
        return out

    monkeypatch.setattr(foreach, "thinned_call", spy)
    quick = run_script(str(EXAMPLE), args, device="cuda", predict=True)
    assert any(thinned)
    monkeypatch.setattr(foreach, "thinned_call", lambda *a: foreach.NOT_THINNED)
    whole = run_script(str(EXAMPLE), args, device="cuda", predict=True)
    assert_same_trace(quick, whole)


def test_cli_run_json_is_not_mixed_with_the_scripts_prints(capsys, data):
    code = main(["run", "--device", "cuda", "--steps", "2", "--json", "-", str(EXAMPLE), data,
                 "--block_size=16"])
    out, err = capsys.readouterr()
    assert code == 0
    document = json.loads(out)  # stdout is the JSON alone
    assert document["schema"] == "ampscope.trace/1" and document["setting"]["device"] == "cuda"
    assert "iter 0: loss" in err  # the script's own print, on stderr


def test_cli_run_shows_the_report_after_the_scripts_output(capsys, data):
    code = main(["run", "--device", "cuda", "--steps", "2", str(EXAMPLE), data,
                 "--block_size=16"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out.index("iter 0: loss") < out.index("Tensors by dtype")


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [
    (["run", "no/such/train.py"], "no script at no/such/train.py"),
    (["run", "-m", "no_such_package.train"], "no module named 'no_such_package.train'"),
    (["run", "--steps", "0", str(EXAMPLE)], "--steps must be at least 1"),
])
def test_cli_run_bad_input_is_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.fast
def test_a_script_that_raises_before_any_step(tmp_path, capsys):
    script = tmp_path / "broken.py"
    script.write_text("import torch\nx = torch.ones(2)\nraise ValueError('bad config')\n")
    assert main(["run", str(script)]) == 1  # the script's uncaught exception, as under python
    err = capsys.readouterr().err
    assert "broken.py raised ValueError at broken.py:3: bad config" in err


@pytest.mark.fast
def test_a_script_that_runs_no_model(tmp_path):
    script = tmp_path / "idle.py"
    script.write_text("import torch\nprint(torch.ones(2).sum())\n")
    with pytest.raises(AmpscopeError, match="nothing was captured: idle.py ran no nn.Module"):
        run_script(str(script))


def test_a_cuda_call_that_cannot_be_virtual_is_one_line(tmp_path):
    script = tmp_path / "ext.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 2).cuda()\n"
        "y = model(torch.ones(1, 2, device='cuda'))\n"
        "torch.cuda.ipc_collect()  # what a custom extension's setup might call\n"
    )
    with pytest.raises(AmpscopeError, match=r"ext.py:4 needs torch.cuda.ipc_collect\(\)"):
        run_script(str(script), device="cuda")


def test_the_callers_state_comes_back(tmp_path, data):
    argv, path = sys.argv[:], sys.path[:]
    assert "model" not in sys.modules
    autocast = torch.is_autocast_enabled("cpu")
    run_script(str(EXAMPLE), [data, "--block_size=16"], device="cuda")
    assert sys.argv == argv and sys.path == path
    assert "model" not in sys.modules  # the script's own module is forgotten: imported anew
    assert torch.is_autocast_enabled("cpu") == autocast
    assert not torch.cuda.is_available()  # the virtual device is gone


def test_module_mode_runs_a_package_module(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "step.py").write_text(
        "import sys, torch\n"
        "lr = float(sys.argv[1])\n"
        "model = torch.nn.Linear(4, 4)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=lr)\n"
        "for _ in range(3):\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "    opt.step()\n"
    )
    # `python -m` finds the package in the working folder, nothing else on the path
    # (tests/test_script_flow.py runs it through the command too).
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    t = ampscope.run_script("pkg.step", ["0.1"], module=True, steps=1)
    assert t.model.cls == "Linear" and t.workload == "train"


def test_a_sampler_that_only_calls_model_forward(tmp_path):
    """(e) as a script: inference_mode, a KV cache, model.forward(...) called directly. The
    model is found by the module its forward calls first; every call, the first included, is a
    model call with the root's inputs and output."""
    script = tmp_path / "sample.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class CachedLM(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.proj, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)\n"
        "    def forward(self, idx, cache):\n"
        "        cache.append(self.proj(self.emb(idx)))\n"
        "        return self.head(torch.stack(cache).sum(0))\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "model = CachedLM().to(device)\n"
        "idx, cache = torch.zeros(1, 1, dtype=torch.long, device=device), []\n"
        "with torch.inference_mode(), torch.autocast(device_type=device, dtype=torch.bfloat16):\n"
        "    for _ in range(3):\n"
        "        logits = model.forward(idx[:, -1:], cache)\n"
        "        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)\n")
    t = run_script(str(script), device="cuda")
    assert t.model.cls == "CachedLM" and t.workload == "forward"
    roots = [m for m in t.modules if m.name == ""]
    assert len(roots) == 3
    assert [r.outputs[0].dtype for r in roots] == ["bfloat16"] * 3
    assert roots[0].inputs[0].dtype == "int64" and roots[0].inputs[0].shape == (1, 1)
    assert all(m.depth == 1 for m in t.modules if m.name in ("emb", "proj", "head"))
    assert {o.module for o in t.ops if o.op == "aten.embedding.default"} == {"emb"}
    assert [o.module for o in t.ops if o.op == "aten.stack.default"] == ["", "", ""]
    ops = [o.op for o in t.ops]
    assert "aten.addmm.default" in ops and "aten.linear.default" not in ops
    assert sum(o.flops for o in t.ops) == 3 * (2 * 8 * 8 + 2 * 8 * 16)
    head = [m for m in t.modules if m.name == "head"]
    assert head and all(m.outputs[0].dtype == "bfloat16" for m in head)


def test_gradient_accumulation_keeps_each_micro_steps_phases(data):
    """Two micro-steps per optimizer step: forward, backward, forward, backward, then the
    optimizer, each its own phase; the FLOPs per token are those of one pass (the tokens of
    both passes are counted), and the note says what ran."""
    import itertools

    one = run_script(str(EXAMPLE), [data, "--block_size=16"], device="cuda")
    two = run_script(str(EXAMPLE), [data, "--block_size=16", "--gradient_accumulation_steps=2"],
                     device="cuda")
    phases = [k for k, _ in itertools.groupby(o.phase for o in two.ops)]
    assert phases == ["forward", "backward", "forward", "backward", "optimizer"]
    assert sum(1 for m in two.modules if m.name == "" and m.phase == "forward") == 2
    assert any("2 training passes for an optimizer step" in n for n in two.notes)
    f1, f2 = ampscope.flops(one), ampscope.flops(two)
    assert f2.tokens == 2 * f1.tokens == 2 * 4 * 16
    matmuls = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
    per_pass = sum(o.flops for o in one.ops if o.op in matmuls and o.phase != "optimizer")
    assert sum(o.flops for o in two.ops if o.op in matmuls) == 2 * per_pass
    casts = next(f.text for f in two.findings if f.text.startswith("Autocast inserted"))
    assert "in 2 forward passes" in casts


def test_run_adds_memory_flops_and_an_html_report(tmp_path, capsys, data):
    page = tmp_path / "run.html"
    code = main(["run", "-d", "cuda", "-q", "--memory", "--flops", "--report", str(page),
                 str(EXAMPLE), data, "--block_size=16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Largest storages live at the peak" in out and "By the dtype the matmuls ran in" in out
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and 'id="memory"' in html and 'id="flops"' in html
    assert "emulated" in html


def test_run_refuses_an_unwritable_report_before_the_script_runs(tmp_path, capsys, data):
    code = main(["run", "-d", "cuda", "--report", str(tmp_path / "no" / "such" / "r.html"),
                 str(EXAMPLE), data])
    captured = capsys.readouterr()
    assert code == 2 and "iter 0" not in captured.out
    assert "cannot write" in captured.err


def test_a_predicted_run_never_overwrites_a_checkpoint_with_fake_tensors(tmp_path):
    """Under --predict the model's weights are fake: a torch.save of them writes nothing (the
    user's last real checkpoint stays loadable) and the trace says so; saves of real tensors
    only are made, and a real run saves as the script asks."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        torch.save({"tokens": torch.arange(5)}, sys.argv[1] + "/tokens.pt")
        torch.save(model.state_dict(), sys.argv[1] + "/ckpt.pt")
    """))
    good = {"weight": torch.ones(2, 4), "bias": torch.zeros(2)}
    torch.save(good, tmp_path / "ckpt.pt")
    before = (tmp_path / "ckpt.pt").read_bytes()
    trace = ampscope.run_script(str(script), [str(tmp_path)], predict=True, steps=5)
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    assert torch.equal(torch.load(tmp_path / "ckpt.pt")["weight"], good["weight"])
    assert torch.equal(torch.load(tmp_path / "tokens.pt")["tokens"], torch.arange(5))
    notes = [n for n in trace.notes if "was not written" in n]
    assert len(notes) == 1 and "ckpt.pt" in notes[0] and "train.py:9" in notes[0]
    ampscope.run_script(str(script), [str(tmp_path)], steps=5)  # a real run saves
    assert torch.load(tmp_path / "ckpt.pt")["weight"].shape == (2, 4)
    assert (tmp_path / "ckpt.pt").read_bytes() != before


def test_ops_on_the_virtual_device_name_the_scripts_line(tmp_path):
    """The virtual device's function mode sits between the script and the recorders: an op the
    script's line made through it is still the script's line."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 2).to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4, device="cuda")
        model(x.to(torch.float64).to(torch.float32)).sum().backward()
        opt.step()
    """))
    trace = ampscope.run_script(str(script), device="cuda", virtual=True)
    casts = [o for o in trace.ops if o.op == "aten._to_copy.default" and o.phase == "forward"]
    # The model's move (line 3) and the two casts (line 6), each at its own line.
    assert casts and {o.source for o in casts} == {"train.py:3", "train.py:6"}
