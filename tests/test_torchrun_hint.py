"""A script written for torchrun, run by `ampscope run` as one plain process: it reads
torchrun's environment, finds it unset, and the one-line error says how to run it as ranks."""

from __future__ import annotations

import pytest

from ampscope.cli import main

NEEDS_TORCHRUN = """
import os
local_rank = int(os.environ["LOCAL_RANK"])
"""

HINT = ("(the script expects torchrun's environment, and LOCAL_RANK is not set: run it as "
        "ranks with `ampscope run --nproc N`, --nproc 1 for one)")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(NEEDS_TORCHRUN)
    return str(path)


def test_a_missing_torchrun_variable_is_named(script, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["run", script]) == 1  # the script's own KeyError, as under python
    err = capsys.readouterr().err
    assert "train.py raised KeyError at train.py:3: 'LOCAL_RANK'" in err
    assert HINT in " ".join(err.split())


def test_no_hint_where_the_variable_is_set(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    path = tmp_path / "train.py"
    path.write_text(NEEDS_TORCHRUN + "raise KeyError('LOCAL_RANK')\n")
    assert main(["run", str(path)]) == 1
    assert "torchrun's environment" not in capsys.readouterr().err
