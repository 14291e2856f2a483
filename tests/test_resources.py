"""Runs that would not fit are predicted, or refused in one line, before anything big is
allocated: the predicted peak (activations included) is held to the free memory."""

from __future__ import annotations

import pytest

import ampscope
from ampscope.errors import AmpscopeError


def test_a_step_whose_activations_do_not_fit_is_predicted(monkeypatch):
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", "20M")  # the weights fit; 4096 tokens do not
    t = ampscope.trace("gpt2-tiny", batch=64, seq=64)
    assert t.mode == "predict"  # the default: nothing is allocated for values


def test_it_is_refused_when_predicting_was_ruled_out(monkeypatch):
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", "20M")
    with pytest.raises(AmpscopeError, match="a real run of gpt2-tiny would not fit: its "
                                            "predicted peak is"):
        ampscope.trace("gpt2-tiny", batch=64, seq=64, predict=False)


def test_a_step_that_fits_runs_for_real(monkeypatch):
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", "8G")
    t = ampscope.trace("gpt2-tiny", batch=64, seq=64, workload="forward", predict=False)
    assert t.mode == "run"


def test_a_malformed_limit_is_one_line(monkeypatch):
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", "lots")
    with pytest.raises(AmpscopeError, match="AMPSCOPE_MEMORY_LIMIT='LOTS' is not a size"):
        ampscope.trace("gpt2-tiny", batch=64, seq=64, predict=False)
