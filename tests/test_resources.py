"""Runs that would not fit are predicted, or refused in one line, before anything big is
allocated: the predicted peak (activations included) is held to the free memory."""

from __future__ import annotations

import pytest

import ampscope
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.models import registry


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
    with pytest.raises(AmpscopeError, match="AMPSCOPE_MEMORY_LIMIT='lots' is not a size"):
        ampscope.trace("gpt2-tiny", batch=64, seq=64, predict=False)


@pytest.mark.parametrize("value, expected", [
    ("8G", 8 * 2**30), ("8g", 8 * 2**30), ("512M", 512 * 2**20), ("4K", 4096), ("1e9", 10**9),
    (" 20M ", 20 * 2**20), ("1", 1),
])
def test_the_limit_reads_bytes_and_a_binary_suffix(monkeypatch, value, expected):
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", value)
    assert registry.available_memory_bytes() == expected


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_limit_is_no_limit(monkeypatch, tmp_path, value):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   1000 kB\n")
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", value)
    assert registry.available_memory_bytes(meminfo) == 1000 * 1024


@pytest.mark.parametrize("value, message", [
    ("lots", "AMPSCOPE_MEMORY_LIMIT='lots' is not a size in bytes; write e.g. 16G, 512M or 8e9"),
    ("G", "AMPSCOPE_MEMORY_LIMIT='G' is not a size in bytes; write e.g. 16G, 512M or 8e9"),
    ("5GG", "AMPSCOPE_MEMORY_LIMIT='5GG' is not a size in bytes; write e.g. 16G, 512M or 8e9"),
    ("nan", "AMPSCOPE_MEMORY_LIMIT='nan' is not a size in bytes; write e.g. 16G, 512M or 8e9"),
    ("0", "AMPSCOPE_MEMORY_LIMIT='0' must be a positive size in bytes, e.g. 16G"),
    ("-5G", "AMPSCOPE_MEMORY_LIMIT='-5G' must be a positive size in bytes, e.g. 16G"),
    ("-inf", "AMPSCOPE_MEMORY_LIMIT='-inf' must be a positive size in bytes, e.g. 16G"),
    ("0.3", "AMPSCOPE_MEMORY_LIMIT='0.3' is less than one byte; write e.g. 16G or 512M"),
    ("inf", "AMPSCOPE_MEMORY_LIMIT='inf' must be a finite size in bytes; write e.g. 16G, or "
            "unset it to use the memory this machine has"),
    ("1e400", "AMPSCOPE_MEMORY_LIMIT='1e400' is too large to be a size in bytes; write e.g. "
              "16G, or unset it to use the memory this machine has"),
])
def test_a_limit_that_is_no_size_is_refused_in_one_line(monkeypatch, capsys, value, message):
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", value)
    with pytest.raises(AmpscopeError) as e:
        registry.available_memory_bytes()
    assert str(e.value) == message
    # and from the command line: that line, exit 2, nothing else on stderr
    code = main(["trace", "gpt2-tiny", "--no-predict"])
    out, err = capsys.readouterr()
    assert code == 2 and err == f"ampscope: error: {message}\n"
