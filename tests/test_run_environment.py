"""One run environment (runs/environment.py): every command's run is assembled there.

The source is read (AST): outside the environment and the modules that define each context,
no module constructs a virtual device, a fake mode, an emulation or a capture, or enters
`applied` or `predicting` itself. And the one fallback: a speed trick's failure reruns the
attempt on the exact path, once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ampscope.precision import parse_setting, resolve_device
from ampscope.runs.environment import RunEnvironment, exact_retry
from ampscope.tricks import TrickFailed, exact

SRC = Path(__file__).resolve().parents[1] / "src" / "ampscope"

# What a run is assembled from, and the modules allowed to construct or enter each: the
# environment, and the module that defines it (or, for a capture, the distributed capture,
# which is a capture kind a user's own job builds on each rank).
ASSEMBLY = {
    "applied": {"runs/environment.py", "precision/apply.py"},
    "predicting": {"runs/environment.py", "runtime/predict.py"},
    "fake_mode": {"runs/environment.py", "runtime/predict.py"},
    "VirtualDevice": {"runs/environment.py", "runtime/virtual_device.py"},
    "Emulation": {"runs/environment.py", "runtime/emulation.py", "precision/apply.py"},
    "Capture": {"runs/environment.py", "runs/session.py", "distributed/capture.py"},
}


def _calls() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call):
                # `applied(...)`, `predict.fake_mode()`; not a method of an environment
                # (`env.applied(...)`, `RunEnvironment(s).applied(...)`).
                func = node.func
                name = func.id if isinstance(func, ast.Name) else \
                    func.attr if isinstance(func, ast.Attribute) and isinstance(
                        func.value, ast.Name) and func.value.id not in ("env", "self") else None
                if name in ASSEMBLY and rel not in ASSEMBLY[name]:
                    found.append((rel, name, node.lineno))
    return found


@pytest.mark.fast
def test_no_command_assembles_a_run_itself():
    assert _calls() == []


@pytest.mark.fast
def test_the_scan_sees_an_assembly(tmp_path, monkeypatch):
    """The scan is not blind: a module that builds its own virtual device is found."""
    bad = SRC / "api" / "_scan_probe_tmp.py"
    bad.write_text("from ampscope.runtime.virtual_device import VirtualDevice\n"
                   "v = VirtualDevice('cuda')\n")
    try:
        assert ("api/_scan_probe_tmp.py", "VirtualDevice", 2) in _calls()
    finally:
        bad.unlink()


@pytest.mark.fast
def test_a_failed_trick_reruns_once_on_the_exact_path():
    seen = []

    def attempt() -> str:
        seen.append(exact())
        if not exact():
            raise TrickFailed("a replayed block differed")
        return "traced"

    assert exact_retry(attempt) == "traced"
    assert seen == [False, True]


@pytest.mark.fast
def test_an_error_on_the_exact_path_is_the_one_reported():
    def attempt() -> None:
        raise TrickFailed("still") if not exact() else ValueError("the model's own")

    with pytest.raises(ValueError, match="the model's own"):
        exact_retry(attempt)


@pytest.mark.fast
def test_one_virtual_device_loads_and_runs_an_emulated_model():
    """The device a model's own code saw while it was built is the one it runs on."""
    env = RunEnvironment(resolve_device(parse_setting("cuda:fp32")), predict=True)
    if env.virtual is None:
        pytest.skip("this machine has CUDA: nothing is emulated")
    lm = env.load("gpt2-tiny", device="meta")
    assert env.virtual is not None and env.target == "cuda"
    with env.applied(lm.module), env.device_active():
        assert next(lm.module.parameters()).device.type == "cuda"
    assert not torch.cuda.is_available()
