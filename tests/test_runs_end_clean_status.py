"""`ampscope run`'s exit status is the script's own, as under `python`: `sys.exit(n)`,
`os._exit(n)`, 1 for an exception the script did not catch; ampscope's own failures keep
theirs (2). Each script is run as `python` runs it first, and the status it gave there is the
one the run must carry (script/ending.py's `run_status`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.script import run_script
from ampscope.script.ending import run_status

MODEL = """
import os
import sys
import torch
from torch import nn

model = nn.Linear(4, 4)
"""

FORWARD = MODEL + "model(torch.randn(2, 4))\n"  # a script that never steps

STEP = MODEL + """
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
opt.step()
"""

ENDINGS = {
    "os._exit(4)": FORWARD + "sys.stdout.flush()\nos._exit(4)\n",
    "sys.exit(3)": FORWARD + "sys.exit(3)\n",
    "sys.exit(message)": FORWARD + "sys.exit('giving up')\n",
    "raise": FORWARD + "raise ValueError('bad batch')\n",
}


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def _python(script: str) -> int:
    """The status `python SCRIPT` ends with."""
    return subprocess.run([sys.executable, script], capture_output=True, check=False).returncode


def _status_of_run(script: str, **options) -> int:
    try:
        trace = run_script(script, **options)
    except AmpscopeError as e:
        return run_status(e)
    return run_status(trace)


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_scripts_own_status_is_the_runs(tmp_path, ending):
    script = _script(tmp_path, ENDINGS[ending])
    expected = _python(script)
    assert expected == {"os._exit(4)": 4, "sys.exit(3)": 3, "sys.exit(message)": 1,
                        "raise": 1}[ending]
    assert _status_of_run(script, in_process=True) == expected


def test_the_status_comes_back_from_the_child_process(tmp_path):
    script = _script(tmp_path, ENDINGS["os._exit(4)"])
    with pytest.raises(AmpscopeError, match=r"os\._exit\(4\)") as failed:
        run_script(script)  # in a spawned child, the API's default
    assert run_status(failed.value) == 4


def test_a_status_after_the_last_step_comes_with_the_trace(tmp_path):
    script = _script(tmp_path, STEP + "sys.stdout.flush()\nos._exit(5)\n")
    assert _python(script) == 5
    for in_process in (True, False):
        trace = run_script(script, in_process=in_process)
        assert trace.workload == "train" and trace.model.name == "Linear"
        assert any("os._exit(5)" in note for note in trace.notes)
        assert run_status(trace) == 5


def test_a_run_that_ends_well_is_0(tmp_path):
    script = _script(tmp_path, STEP + "model(torch.randn(2, 4))\n")  # stopped at this pass
    assert run_status(run_script(script, in_process=True)) == 0


def test_ampscopes_own_failure_keeps_2(tmp_path):
    # Predicted, the script reads a fake tensor's value: ampscope cannot run it, the script
    # did nothing wrong (under python it runs to its end, status 0).
    script = _script(tmp_path, MODEL + "if model(torch.randn(2, 4)).sum() > 0:\n    pass\n")
    assert _python(script) == 0
    with pytest.raises(AmpscopeError, match="predict mode cannot run") as failed:
        run_script(script, predict=True, in_process=True)
    assert run_status(failed.value) == 2


@pytest.mark.parametrize("ending", ["os._exit(4)", "raise"])
def test_the_cli_exits_with_the_scripts_status(tmp_path, ending, capsys):
    script = _script(tmp_path, ENDINGS[ending])
    assert main(["run", script]) == _python(script)
