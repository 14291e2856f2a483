"""How `ampscope run` starts a script and where it stops (script/target.py, script/child.py,
script/__init__.py, runtime/compiled.py):

- `-m pkg.train` finds a package in the working folder, as `python -m` does (the truth: the
  same command under `python -m`, in a fresh process with nothing on PYTHONPATH);
- `torch.compile`, in every form and with any option, `fullgraph=True` included, runs eagerly:
  the trace is the one of the same script without the compile calls, and the objects it
  returns behave as torch's (`_orig_mod`, its state_dict keys);
- `--steps N` lets the rest of step N run (GradScaler's update, the scheduler, zero_grad, the
  log) and stops the script as its model's next forward pass begins: the trace is the one of
  the same script cut after step N, op for op (nothing of the extra pass is recorded).
"""

from __future__ import annotations

import collections
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ampscope
from ampscope.errors import AmpscopeError
from ampscope.runs.session import Capture
from ampscope.script import run_script


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def no_pythonpath() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


# -- -m from the working folder ----------------------------------------------------------------


def package(tmp_path: Path) -> None:
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "model.py", """
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 2)
            def forward(self, x):
                return self.fc(x)
    """)
    write(tmp_path / "pkg" / "train.py", """
        import torch
        from pkg.model import Net
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    """)


def test_dash_m_through_the_command_finds_a_package_in_the_working_folder(tmp_path):
    package(tmp_path)
    env = no_pythonpath()
    # The truth: `python -m pkg.train` runs from that folder with nothing on PYTHONPATH.
    python = subprocess.run([sys.executable, "-m", "pkg.train"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert python.returncode == 0, python.stderr
    # The installed command (its own folder first on its path, not the working folder), as a
    # user runs it.
    command = Path(sys.executable).with_name("ampscope")
    done = subprocess.run([str(command), "run", "--json", "-", "-m", "pkg.train"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    trace = json.loads(done.stdout)
    assert trace["model"]["class"] == "Net" and trace["workload"] == "train"


@pytest.mark.parametrize("in_process", [False, True])
def test_dash_m_through_run_script_finds_a_package_in_the_working_folder(tmp_path, monkeypatch,
                                                                         in_process):
    package(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    path = sys.path[:]
    trace = run_script("pkg.train", module=True, steps=2, in_process=in_process)
    assert trace.model.cls == "Net"
    assert trace.notes[0] == ("python -m pkg.train was stopped after its second optimizer step, "
                              "as its model's next forward pass began.")
    # The caller's process as it was: its path, and no module of the package left imported
    # (finding the module imports `pkg`; the run imports it afresh).
    assert sys.path == path
    assert not any(name == "pkg" or name.startswith("pkg.") for name in sys.modules)


def test_a_script_in_a_child_process_does_not_see_the_callers_working_folder(tmp_path,
                                                                              monkeypatch):
    """`python sub/train.py` puts `sub` first on the path, not the working folder: a module
    that lives only in the working folder is not found (the truth: python's own error)."""
    write(tmp_path / "helper.py", "VALUE = 1\n")
    script = write(tmp_path / "sub" / "train.py", """
        import helper
        import torch
        torch.nn.Linear(2, 2)(torch.randn(1, 2))
    """)
    python = subprocess.run([sys.executable, str(script.relative_to(tmp_path))], cwd=tmp_path,
                            env=no_pythonpath(), capture_output=True, text=True)
    assert "ModuleNotFoundError: No module named 'helper'" in python.stderr
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(AmpscopeError, match="raised ModuleNotFoundError at train.py:2"):
        run_script(str(script.relative_to(tmp_path)))


@pytest.mark.fast
def test_a_module_that_is_nowhere_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AmpscopeError, match="no module named 'pkg.nothing'"):
        run_script("pkg.nothing", module=True)


# -- torch.compile: eager ------------------------------------------------------------------------

COMPILED = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 8), nn.Linear(8, 2)
    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
    def forward(self, y):
        return y * self.scale

net, head = Net(), Head()
opt = torch.optim.SGD([*net.parameters(), *head.parameters()], lr=0.1)
x = torch.randn(3, 4)
"""

# Each form a script writes it: decorator, function, module, Module.compile(); every option.
COMPILE_CALLS = """
@torch.compile(fullgraph=True, mode="max-autotune", dynamic=True)
def act(y):
    return torch.sin(y) * 2

square = torch.compile(lambda y: y * y, fullgraph=True, backend="inductor")
model = torch.compile(net, fullgraph=True, mode="max-autotune")
head.compile(fullgraph=True, dynamic=True)
# torch's OptimizedModule, as under python: the module it wraps, its keys under `_orig_mod.`
assert model._orig_mod is net and isinstance(model, torch.nn.Module)
assert sorted(model.state_dict()) == sorted("_orig_mod." + k for k in net.state_dict())
"""

EAGER_CALLS = """
def act(y):
    return torch.sin(y) * 2

square = lambda y: y * y
model = net
"""

LOOP = """
for _ in range(2):
    loss = square(act(head(model(x)))).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("device, predict", [(None, False), ("cuda", False), ("cuda", True)])
def test_compiled_code_runs_eagerly_in_every_form(tmp_path, device, predict):
    """The truth is the same script without `torch.compile` (torch's "force_eager": every
    compile directive ignored): the same model, ops, modules and phases; only a note more."""
    compiled = write(tmp_path / "compiled.py", COMPILED + COMPILE_CALLS + LOOP)
    eager = write(tmp_path / "eager.py", COMPILED + EAGER_CALLS + LOOP)
    got = run_script(str(compiled), device=device, predict=predict, in_process=True)
    want = run_script(str(eager), device=device, predict=predict, in_process=True)
    assert got.model.cls == "Net"  # what torch.compile wrapped, not its wrapper
    assert [(o.op, o.phase, o.module) for o in got.ops] == \
        [(o.op, o.phase, o.module) for o in want.ops]
    assert [(m.name, m.phase) for m in got.modules] == [(m.name, m.phase) for m in want.modules]
    assert "aten.sin.default" in {o.op for o in got.ops}
    note = "torch.compile was called: the run was eager."
    assert any(n.startswith(note) for n in got.notes)
    assert not any(n.startswith(note) for n in want.notes)


@pytest.mark.fast
def test_a_module_compiled_with_fullgraph_before_the_trace_runs_eagerly():
    """`ampscope.trace` of a module compiled before it (a factory's `torch.compile(...,
    fullgraph=True)`), calling a function compiled with fullgraph too. Under the recorders'
    modes TorchDynamo compiles nothing, and fullgraph would fail for that; the run is eager.
    The ops, by hand: Linear on a 2-D input is t + addmm on the CPU, then relu, sin, mul, sum."""

    @torch.compile(fullgraph=True)
    def twice_sin(y):
        return torch.sin(y) * 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return twice_sin(torch.relu(self.fc(x))).sum()

    compiled = torch.compile(Model(), fullgraph=True)
    t = ampscope.trace(compiled, torch.randn(2, 4), setting="fp32", workload="forward",
                       predict=False)
    assert [o.op for o in t.ops] == ["aten.t.default", "aten.addmm.default", "aten.relu.default",
                                     "aten.sin.default", "aten.mul.Tensor", "aten.sum.default"]
    # The stance is back: the compiler's own state (private, read by the test only).
    assert torch._dynamo.eval_frame._stance.stance == "default"


# -- --steps: stopped at the next forward pass ---------------------------------------------------

SCALER = """
import sys
import torch
marks = open(sys.argv[1], "a")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
model.to("cuda")
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
scaler = torch.amp.GradScaler("cuda")
x = torch.randn(2, 8, device="cuda")
for i in range(ITERATIONS):
    marks.write(f"forward {i}\\n")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    marks.write(f"backward {i}\\n")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad(set_to_none=False)
    marks.write(f"lr {sched.get_last_lr()[0]}\\n")
"""


def test_steps_lets_the_step_end_and_stops_at_the_next_forward_pass(tmp_path):
    """Three iterations, `--steps 1`. The truth: the same script with one iteration, which
    simply ends after its first step (what python runs up to the stop point). The traces are
    the same op for op, module call for module call: GradScaler's update, the scheduler and
    zero_grad are in it, and nothing of the second forward pass is."""
    stopped = write(tmp_path / "stopped" / "train.py", SCALER.replace("ITERATIONS", "3"))
    ended = write(tmp_path / "ended" / "train.py", SCALER.replace("ITERATIONS", "1"))
    got = run_script(str(stopped), [str(tmp_path / "stopped.txt")], device="cuda", steps=1,
                     in_process=True)
    want = run_script(str(ended), [str(tmp_path / "ended.txt")], device="cuda", steps=1,
                      in_process=True)
    assert got.notes[0] == ("train.py was stopped after its first optimizer step, as its "
                            "model's next forward pass began.")
    assert want.notes[0] == "train.py ran to its end (1 optimizer step)."

    def ops(t):
        return [(o.op, o.phase, o.module, o.source) for o in t.ops]

    assert ops(got) == ops(want)
    assert [(m.name, m.phase) for m in got.modules] == [(m.name, m.phase) for m in want.modules]
    assert [(c.func, c.source) for c in got.calls] == [(c.func, c.source) for c in want.calls]
    # GradScaler.update() ran after the step (its scale update, torch/amp/grad_scaler.py), and
    # zero_grad(set_to_none=False) zeroed the gradients: both in the optimizer phase.
    after_step = collections.Counter(o.op for o in got.ops if o.phase == "optimizer")
    assert after_step["aten._amp_update_scale_.default"] == 1
    assert any("zero" in op for op in after_step)
    # The code up to the second forward pass ran (the scheduler halved lr 0.001: StepLR's
    # gamma); the pass itself and what follows did not.
    assert (tmp_path / "stopped.txt").read_text() == "forward 0\nbackward 0\nlr 0.0005\nforward 1\n"


def test_what_a_stopped_script_holds_is_alive_at_the_end_whenever_the_collector_runs(
        tmp_path, monkeypatch):
    """The stopped script's globals (`loss`, the batch) go when the garbage collector next runs
    (its frames are a cycle with the exception that stopped it): after the trace is finished,
    or while it is, as it happens. The truth: the same run with the collector off, whose
    globals outlive the run. With a collection forced as the trace is being finished, the
    record is the same: what the script held at the stop is alive at the end (freed None)."""
    script = write(tmp_path / "train.py", "def helper():\n    return model\n"
                   + textwrap.dedent(SCALER).replace("ITERATIONS", "3"))

    def run():
        return run_script(str(script), [str(tmp_path / "marks.txt")], device="cuda", steps=1,
                          in_process=True)

    gc.disable()
    try:
        never = run()
    finally:
        gc.enable()
    finish = Capture.finish

    def collected_first(self, *args, **kwargs):
        gc.collect()
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(Capture, "finish", collected_first)
    collected = run()

    def lives(t):
        return [(s.op, s.created, s.freed) for s in t.storages]

    assert lives(collected) == lives(never)
    loss = [s for s in never.storages if s.op == "aten.mean.default" and s.phase == "forward"]
    assert loss and all(s.freed is None for s in loss)


def test_a_script_that_ends_after_its_last_step_ends_as_it_would(tmp_path):
    """Its gradients, dropped by `zero_grad()` before the run ended, are listed with the dtype
    they had at the step: float32, the dtype of the float32 Linear's parameters (autograd's
    gradients take their parameter's dtype)."""
    script = write(tmp_path / "train.py", """
        import torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        print("after the step")
    """)
    trace = run_script(str(script), in_process=True)
    assert trace.notes[0] == "train.py ran to its end (1 optimizer step)."
    assert [(p.name, p.grad_dtype) for p in trace.parameters] == [("weight", "float32"),
                                                                  ("bias", "float32")]


SAMPLER = """
import torch
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(STEPS):
    model(torch.randn(1, 4)).sum().backward()
    opt.step()
with torch.no_grad():
    y = torch.randn(1, 4)
    for _ in range(10):
        y = model(y)
"""


@pytest.mark.parametrize("script_steps, steps, passes, note", [
    (0, 1, 3, "train.py was stopped after 3 forward passes of its model without an optimizer "
              "step (--max-forwards 3): the trace holds those 3 passes and no optimizer step; "
              "raise --max-forwards, or give 0 for no bound, to let it run on."),
    (1, 2, 4, "train.py was stopped after 3 forward passes of its model since its first "
              "optimizer step (--max-forwards 3): the trace holds its 1 optimizer step and the "
              "3 passes after; raise --max-forwards, or give 0 for no bound, to let it run on."),
])
def test_max_forwards_still_bounds_a_run_that_stops_stepping(tmp_path, script_steps, steps,
                                                             passes, note):
    """A sampler that never steps, and one that steps once and then samples while `--steps`
    asks for two: each stopped as the pass past the bound begins; the trace holds every pass
    that ran (by hand: the steps' passes and three more)."""
    script = write(tmp_path / "train.py", SAMPLER.replace("STEPS", str(script_steps)))
    trace = run_script(str(script), steps=steps, max_forwards=3, in_process=True)
    assert trace.notes[0] == note
    assert sum(1 for m in trace.modules if m.name == "" and m.phase != "backward") == passes


@pytest.mark.parametrize("ending, says", [
    ("raise KeyError('lr')", "raised KeyError at train.py:9: 'lr'"),
    ("sys.exit(3)", "exited with status 3"),
])
def test_a_failure_after_the_last_step_keeps_the_trace_and_says_so(tmp_path, ending, says):
    """The step is traced; its logging (say) then fails: the trace comes back, and its note
    names the failure and its line. Before the last step, the same failure is the run's
    error."""
    body = """
        import sys, torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            if i == FAILING:
                ENDING
    """.replace("ENDING", ending)
    script = write(tmp_path / "train.py", body.replace("FAILING", "0"))
    trace = run_script(str(script), steps=1, in_process=True)
    assert trace.notes[0] == (f"After its first optimizer step, train.py {says}; the trace "
                              "holds the run up to there.")
    assert trace.workload == "train"
    with pytest.raises(AmpscopeError, match="before its second optimizer step" if "exit" in ending
                       else "train.py raised KeyError at train.py:9"):
        run_script(str(script), steps=2, in_process=True)
