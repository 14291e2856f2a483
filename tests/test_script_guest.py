"""A script under `ampscope run` / `run_script` is a good guest: it ends as under `python`
(its log complete, its atexit handlers run), its files are its own (a predicted run writes no
fake checkpoint, the report lists what it wrote), and nothing it does to its process reaches
the caller (os._exit, fork, chdir, a swapped stdout, torch's global settings).

Each test writes a tiny script and checks the fact a user would check: the bytes of the log
file, the checkpoint `torch.load` reads back, the caller's process still running.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ampscope
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from tests.helpers import state_differences, torch_state

# A model, an optimizer and N steps: what every script below wraps.
STEPS = """
import torch
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def script(tmp_path, body: str, name: str = "train.py"):
    path = tmp_path / name
    path.write_text(STEPS + textwrap.dedent(body))
    return path


def test_a_stopped_scripts_log_is_complete_and_its_atexit_handlers_run(tmp_path, capsys):
    """The script writes its log through a buffered file and logging.FileHandler, and registers
    an atexit handler; `--steps 1` stops it mid-loop, as the model's second forward pass
    begins: the loop's next log lines, written before that pass, are written too. As with
    `python` at exit, every line written before the stop is on disk, and the handler ran."""
    path = script(tmp_path, """
        import atexit, logging, sys
        out = sys.argv[1]
        log = open(out + "/log.txt", "w")
        logging.basicConfig(filename=out + "/logging.txt", level=logging.INFO, force=True)
        atexit.register(lambda: open(out + "/atexit.txt", "w").write("ran"))
        for i in range(5):
            log.write(f"step {i}\\n")
            logging.info("step %d", i)
            step()
    """)
    handlers = logging.getLogger().handlers[:]
    assert main(["run", "--quiet", str(path), str(tmp_path)]) == 0
    assert (tmp_path / "log.txt").read_text() == "step 0\nstep 1\n"
    assert (tmp_path / "logging.txt").read_text() == "INFO:root:step 0\nINFO:root:step 1\n"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert "was stopped after its first optimizer step" in capsys.readouterr().out
    assert logging.getLogger().handlers == handlers  # the script's handler did not stay here


@pytest.mark.fast
def test_the_report_lists_the_files_the_script_wrote(tmp_path):
    (tmp_path / "old.pt").write_bytes(b"old")
    path = script(tmp_path, """
        import sys, numpy as np
        out = sys.argv[1]
        step()
        torch.save(model.state_dict(), out + "/old.pt")
        np.save(out + "/arr.npy", np.arange(3))
        with open(out + "/log.txt", "a") as f:
            f.write("x")
    """)
    trace = ampscope.run_script(str(path), [str(tmp_path)], steps=5, in_process=True)
    [note] = [n for n in trace.notes if n.startswith("The script wrote")]
    for name, how in (("old.pt", "replaced"), ("arr.npy", "created"), ("log.txt", "created")):
        assert f"{tmp_path / name} ({how})" in note
    assert torch.load(tmp_path / "old.pt")["weight"].shape == (2, 4)  # the real save was made


def test_a_predicted_run_writes_no_safetensors_file_of_fake_weights(tmp_path):
    """safetensors' save_file (what Hugging Face's Trainer writes) of fake weights is skipped
    and reported with the bytes it would have held: 2x4 + 2 float32 = 40 bytes."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    good = {"weight": torch.ones(2, 4), "bias": torch.zeros(2)}
    save_file(good, tmp_path / "model.safetensors")
    before = (tmp_path / "model.safetensors").read_bytes()
    path = script(tmp_path, """
        import sys
        from safetensors.torch import save_file
        step()
        save_file(model.state_dict(), sys.argv[1] + "/model.safetensors")
    """)
    trace = ampscope.run_script(str(path), [str(tmp_path)], predict=True, steps=5)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert torch.equal(load_file(tmp_path / "model.safetensors")["weight"], good["weight"])
    [note] = [n for n in trace.notes if "was not written" in n]
    assert note.startswith("save_file(..., ") and "train.py:13" in note
    assert "40 B of fake tensors (float32 40 B)" in note


def test_os_exit_in_the_script_ends_the_script_not_the_caller(tmp_path):
    path = script(tmp_path, """
        import os
        os._exit(4)
    """)
    for in_process in (True, False):
        with pytest.raises(AmpscopeError, match=r"os\._exit\(4\)|status 4"):
            ampscope.run_script(str(path), in_process=in_process)
    assert os.getpid() > 0  # still here: the test process was not ended


def test_a_forked_child_that_returns_does_not_come_back_into_the_caller(tmp_path):
    """The script forks; its child calls sys.exit(0). Under `python` that ends the child. Here
    the child must not return from run_script into this test: only one process appends its pid
    to the file after the call."""
    marks = tmp_path / "after.txt"
    path = script(tmp_path, """
        import os, sys
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        step()
    """)
    trace = ampscope.run_script(str(path), in_process=True)
    with open(marks, "a") as f:
        f.write(f"{os.getpid()}\n")
    assert marks.read_text() == f"{os.getpid()}\n"
    assert trace.workload == "train"


def test_a_dataloader_with_worker_processes_runs_as_usual(tmp_path):
    path = script(tmp_path, """
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=3, num_workers=2)
        for (x,) in loader:
            model(x).sum().backward()
            opt.step()
    """)
    trace = ampscope.run_script(str(path), steps=2, in_process=True)
    assert trace.notes[0] == ("train.py was stopped after its second optimizer step, as its "
                              "model's next forward pass began.")


@pytest.mark.fast
def test_the_callers_process_is_as_it_was_after_a_script_changed_it(tmp_path, monkeypatch):
    """Everything a training script commonly sets for its process comes back, whether the
    script finished or raised; and the same script runs twice in one process."""
    monkeypatch.setenv("AMPSCOPE_TEST_KEEP", "1")
    path = script(tmp_path, """
        import logging, os, signal, sys
        torch.autograd.set_detect_anomaly(True)
        torch.backends.cudnn.benchmark = True
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_num_threads(1)
        torch.set_default_device("meta")
        torch.set_default_device("cpu")
        os.environ["AMPSCOPE_TEST_NEW"] = "1"
        del os.environ["AMPSCOPE_TEST_KEEP"]
        os.chdir(sys.argv[1])
        sys.stdout = open(os.devnull, "w")
        signal.signal(signal.SIGUSR1, lambda *a: None)
        logging.basicConfig(level=logging.DEBUG)
        step()
        if sys.argv[2] == "raise":
            raise ValueError("after the changes")
    """)
    handler, stdout = signal.getsignal(signal.SIGUSR1), sys.stdout
    before = torch_state()
    for how in ("finish", "raise", "finish"):
        if how == "raise":
            with pytest.raises(AmpscopeError, match="after the changes"):
                ampscope.run_script(str(path), [str(tmp_path / "x"), how], steps=5,
                                    in_process=True)
        else:
            (tmp_path / "x").mkdir(exist_ok=True)
            ampscope.run_script(str(path), [str(tmp_path / "x"), how], steps=5, in_process=True)
        assert state_differences(before, torch_state()) == []
        assert os.environ.get("AMPSCOPE_TEST_KEEP") == "1"
        assert "AMPSCOPE_TEST_NEW" not in os.environ
        assert signal.getsignal(signal.SIGUSR1) is handler and sys.stdout is stdout
        assert logging.getLogger().level == logging.WARNING


def test_a_script_that_never_steps_is_stopped_after_max_forwards(tmp_path, capsys):
    path = script(tmp_path, """
        with torch.no_grad():
            while True:
                model(torch.randn(1, 4))
    """)
    assert main(["run", "--max-forwards", "30", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("train.py was stopped after 30 forward passes of its model without an optimizer "
            "step (--max-forwards 30): the trace holds those 30 passes and no optimizer step"
            ) in " ".join(out.split())


def test_relative_outputs_land_where_the_command_started(tmp_path, monkeypatch, capsys):
    (tmp_path / "elsewhere").mkdir()
    path = script(tmp_path, """
        import os
        os.chdir("elsewhere")
        step()
    """)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--quiet", "--json", "o.json", str(path)]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["workload"] == "train"
    assert not (tmp_path / "elsewhere" / "o.json").exists()


def test_the_report_reaches_stdout_though_the_script_swapped_it(tmp_path, capsys):
    path = script(tmp_path, """
        import io, sys
        sys.stdout = io.StringIO()
        step()
    """)
    assert main(["run", str(path)]) == 0
    assert "train.py ran to its end (1 optimizer step)" in capsys.readouterr().out


def test_json_on_stdout_is_not_mixed_with_a_subprocess_output(tmp_path):
    """`--json -`: a subprocess the script starts writes to the inherited descriptor 1; that
    goes to stderr with the script's prints, and stdout holds the JSON alone."""
    path = script(tmp_path, """
        import subprocess
        subprocess.run(["echo", "from a subprocess"], check=True)
        print("from the script")
        step()
    """)
    done = subprocess.run([sys.executable, "-m", "ampscope", "run", "--json", "-", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["workload"] == "train"
    assert "from a subprocess" in done.stderr and "from the script" in done.stderr


@pytest.mark.fast
def test_a_syntax_error_names_the_scripts_line(tmp_path, capsys):
    path = tmp_path / "train.py"
    path.write_text("import torch\n\nx = (1,\n")
    assert main(["run", str(path)]) == 1  # as python ends on a syntax error
    err = capsys.readouterr().err
    assert "train.py raised SyntaxError at train.py:3:" in err and "frozen" not in err


def test_a_script_in_a_child_process_prints_where_the_caller_prints(tmp_path, capsys):
    """By default run_script runs the script in a spawned child; its prints reach the caller's
    sys.stdout (captured here), and the trace comes back whole."""
    path = script(tmp_path, """
        print("hello from the script")
        step()
    """)
    child = ampscope.run_script(str(path))
    assert "hello from the script" in capsys.readouterr().out
    here = ampscope.run_script(str(path), in_process=True)
    assert [o.op for o in child.ops] == [o.op for o in here.ops]
    assert child.notes == here.notes


def test_installed_modules_in_the_scripts_folder_are_not_forgotten(tmp_path, monkeypatch):
    """A project's environment often lies in the project's folder (.venv). The script's own
    modules are forgotten after the run, so a second run imports them again; the environment's
    (torch's, whose import registers operators once per process) must be kept."""
    from ampscope.script import target

    venv = tmp_path / ".venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "installed_pkg_for_test.py").write_text("X = 1\n")
    (tmp_path / "own_module_for_test.py").write_text("Y = 2\n")
    monkeypatch.setattr(target, "_installed", lambda: (str(venv) + os.sep,))
    path = script(tmp_path, f"""
        import sys
        sys.path.append({str(venv / "lib")!r})
        import installed_pkg_for_test, own_module_for_test
        step()
    """)
    try:
        for _ in range(2):
            ampscope.run_script(str(path), in_process=True)
            assert "installed_pkg_for_test" in sys.modules
            assert "own_module_for_test" not in sys.modules
    finally:
        sys.modules.pop("installed_pkg_for_test", None)


def test_a_distributed_script_runs_twice_in_one_process_without_warnings(tmp_path):
    """The script makes a gloo process group of one rank and leaves it: it is destroyed after
    the run (the next run makes its own). On the virtual CUDA device, a script that picks NCCL
    because CUDA "is there" gets torch's one error, without torch's warning about this build."""
    import torch.distributed as dist

    path = script(tmp_path, """
        import os, sys
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", sys.argv[1])
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    """)
    port = _free_port()
    for _ in range(2):
        trace = ampscope.run_script(str(path), [port], in_process=True)
        assert trace.workload == "train" and not dist.is_initialized()
    # Warnings as a user's terminal shows them (pytest would collect them instead).
    done = subprocess.run([sys.executable, "-m", "ampscope", "run", "--device", "cuda",
                           str(path), _free_port()], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1  # the script's own error, as under python
    assert done.stderr.splitlines() == [
        "ampscope: error: train.py raised RuntimeError at train.py:15: Distributed package "
        "doesn't have NCCL built in"]


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
