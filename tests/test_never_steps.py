"""A script that never reaches an optimizer step under `ampscope run`: by default, one that has
made no optimizer (an evaluation loop, a sampler) is stopped after 100 passes of its model, in
seconds rather than the minutes 10,000 passes took; one that has made an optimizer is allowed
1,000 passes without a step, so that an evaluation of nanoGPT's size before its first step
(200 batches of each of 2 splits: 400 passes) still reaches that step. The note says what was
traced and why it stopped, and the module table counts passes, not optimizer steps that never
ran.

Each script counts its own forward passes, so the count checked is the script's, not ampscope's.
"""

from __future__ import annotations

import textwrap

from ampscope.analysis.flow import module_flow, repeat_unit
from ampscope.cli import main
from ampscope.script import run_script
from tests.helpers import blocks, call

# A model that never steps; `passes` counts the calls that ran to their end, and is written
# where the test reads it as the script ends (ampscope runs the script's atexit handlers).
NEVER_STEPS = """
import atexit, sys, torch
model = torch.nn.Linear(4, 2)
passes, out = 0, sys.argv[1]
atexit.register(lambda: open(out, "w").write(str(passes)))
with torch.no_grad():
    while True:
        model(torch.randn(1, 4))
        passes += 1
"""


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def module_rows(out: str) -> dict[str, str]:
    """The module table's rows by their first cell: the rendered line."""
    return {line.split("│")[0].strip(): line for line in out.splitlines() if "│" in line}


def test_the_default_stops_a_script_without_an_optimizer_after_100_passes(tmp_path, capsys):
    """Before: 10,000 passes (127 s on a quiet 2-core machine) and a report of "× 10000 steps"
    though no step ran."""
    script = write(tmp_path / "evaluate.py", NEVER_STEPS)
    count = tmp_path / "passes.txt"
    assert main(["run", str(script), str(count)]) == 0
    assert count.read_text() == "100"
    raw = capsys.readouterr().out
    out = " ".join(raw.split())
    assert ("evaluate.py was stopped after 100 forward passes of its model without an "
            "optimizer step (--max-forwards 100, the default for a script that has made no "
            "optimizer): the trace holds those 100 passes and no optimizer step; raise "
            "--max-forwards, or give 0 for no bound, to let it run on.") in out
    assert "workload forward" in out
    assert module_rows(raw)["(model)"].split("│")[-1].strip() == "× 100 passes"
    assert "× 100 steps" not in out


def test_a_script_with_an_optimizer_may_evaluate_400_passes_before_its_step(tmp_path):
    """nanoGPT's train.py makes its optimizer, then estimates its loss on 200 batches of each
    split before its first step: the default lets those 400 passes run and traces the step.
    Asked for a second step that never comes (the script samples forever after its first), the
    run is stopped 1,000 passes after the first."""
    script = write(tmp_path / "train.py", """
        import torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            for _ in range(400):
                model(torch.randn(1, 4))
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        with torch.no_grad():
            while True:
                model(torch.randn(2, 4))
    """)
    trace = run_script(str(script), steps=2, in_process=True)
    assert trace.notes[0] == (
        "train.py was stopped after 1,000 forward passes of its model since its first "
        "optimizer step (--max-forwards 1000, the default for a script that has made an "
        "optimizer): the trace holds its 1 optimizer step and the 1,000 passes after; raise "
        "--max-forwards, or give 0 for no bound, to let it run on.")
    assert trace.workload == "train"
    forwards = [m for m in trace.modules if m.name == "" and m.phase != "backward"]
    assert [m.inputs[0].shape for m in forwards] == [(1, 4)] * 400 + [(3, 4)] + [(2, 4)] * 1000


def test_the_flag_still_sets_the_bound(tmp_path):
    script = write(tmp_path / "evaluate.py", NEVER_STEPS)
    count = tmp_path / "passes.txt"
    trace = run_script(str(script), [str(count)], max_forwards=7, in_process=True)
    assert count.read_text() == "7"
    assert trace.notes[0].startswith("evaluate.py was stopped after 7 forward passes of its "
                                     "model without an optimizer step (--max-forwards 7): the "
                                     "trace holds those 7 passes and no optimizer step;")
    trace = run_script(str(script), [str(count)], max_forwards=150, in_process=True)
    assert count.read_text() == "150"  # above the default without an optimizer


def test_repeated_passes_are_steps_only_where_the_workload_steps():
    """A training run's micro-steps and generate's decode steps are steps; the passes of a run
    that never stepped (its workload "forward") or of a custom workload are passes."""
    step = blocks(2)
    calls = step + [call(len(step) + c.index, c.name, c.type, c.depth, c.inputs, c.outputs)
                    for c in step]
    assert [repeat_unit(w) for w in ("train", "generate", "forward", "custom")] == [
        "steps", "steps", "passes", "passes"]
    assert repeat_unit("train", "forward") == "passes"
    assert module_flow(calls, unit=repeat_unit("forward"))[0].note == "× 2 passes"
    assert module_flow(calls, unit=repeat_unit("train"))[0].note == "× 2 steps"
