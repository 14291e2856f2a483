"""The command line's surface: --version, py.typed, the examples of every --help, the answers
that import no torch, the user's hardware figures, and the "ampscope" logger behind -v."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from ampscope import hardware
from ampscope.cli import _parser, _values_after_dashes, main
from ampscope.cli.checks import check_flags as _check_flags
from ampscope.cli.examples import examples
from ampscope.cli.hardware import add_hardware_arguments, resolve_hardware
from ampscope.errors import AmpscopeError

ROOT = Path(__file__).parent.parent


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- --version and py.typed -----------------------------------------------------------------


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"ampscope {version('ampscope')}\n"
    result = subprocess.run([sys.executable, "-m", "ampscope", "--version"],
                            capture_output=True, text=True, check=True)
    assert result.stdout == f"ampscope {version('ampscope')}\n"


@pytest.mark.slow
def test_the_wheel_ships_py_typed(tmp_path):
    """PEP 561: type checkers read the package's hints only when py.typed is in the wheel."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("ampscope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ampscope/py.typed" in names
    assert "ampscope/schemas/trace.schema.json" in names or any(
        n.startswith("ampscope/schemas/") and n.endswith(".json") for n in names)


# --- examples in --help ---------------------------------------------------------------------


EXAMPLES = examples()  # the table's and the registered reports'


def test_every_command_has_examples():
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(EXAMPLES) - {""}
    for name, command in sub.choices.items():
        text = command.format_help()
        assert text.rstrip().endswith(EXAMPLES[name][-1].rstrip()), name
        assert all(line in text for line in EXAMPLES[name]), name


@pytest.mark.fast
@pytest.mark.parametrize("command,line", [(c, line) for c, lines in EXAMPLES.items()
                                          for line in lines])
def test_each_example_parses(command, line):
    """Parse only: every example names flags and values the parser accepts, for its command."""
    argv = shlex.split(line, comments=True)
    assert argv[0] == "ampscope"
    argv = _values_after_dashes(argv[1:])
    args = _parser().parse_args(argv)
    assert args.command == (command or argv[0])  # the top level's examples: any command
    _check_flags(argv, args)
    resolve_hardware(args)  # --gpu, --peak-flops: known names, well-formed values


# --- answers that import no torch -----------------------------------------------------------

_NO_TORCH = [["--help"], ["--version"], ["models"], ["models", "--json", "-"], ["formats"],
             ["trace", "--batch", "x"], ["flops", "--gpu", "nope"], ["trace", "--nproc", "2"],
             *[[name, "--help"] for name in EXAMPLES if name]]


@pytest.mark.parametrize("argv", _NO_TORCH, ids=" ".join)
def test_answers_that_need_no_model_import_no_torch(argv):
    """The parser, --help, --version, `models`, `formats` and argument errors answer in a fresh
    interpreter without importing torch (a second or more of start-up)."""
    code = ("import sys\nfrom ampscope.cli import main\n"
            f"try:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', code, "
            "file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("no torch"), result.stderr[-2000:]
    expected = 2 if argv[0] in ("trace", "flops") and "--help" not in argv else 0
    assert last == f"no torch {expected}"


def test_the_package_root_imports_no_torch_until_a_name_is_used():
    code = ("import sys, ampscope\nassert 'torch' not in sys.modules\n"
            "assert 'ampscope.render.report_kinds' not in sys.modules  # read when first asked\n"
            "names = ampscope.__all__\nassert 'torch' not in sys.modules\n"
            "ampscope.trace\nassert 'torch' in sys.modules\n"
            "from ampscope.records import Trace\nassert hasattr(Trace, '_repr_html_')\n"
            "from ampscope.render.report_kinds import REPORTS\n"
            "reports = {n for n, k in REPORTS.items() if k.public}\n"
            "print(sorted(names) == sorted({*ampscope._EXPORTS, *reports}),"
            " {'memory', 'flops', 'numerics', 'policy'} <= reports, 'formats' in names,"
            " all(n in dir(ampscope) and getattr(ampscope, n) for n in names))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["True", "True", "False", "True"], result.stderr[-2000:]


# --- the user's hardware ----------------------------------------------------------------------


def test_an_unknown_gpu_is_refused_with_the_known_names(capsys):
    code, out, err = run(capsys, "flops", "gpt2-tiny", "--gpu", "a6000")
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("ampscope: error: unknown accelerator 'a6000'; known: a10, a100, ")
    assert all(a.name in err for a in hardware.KNOWN)


@pytest.mark.fast
@pytest.mark.parametrize("flag,value,message", [
    ("--peak-flops", "bf16=abc", "'abc' is not a number of FLOP/s"),
    ("--peak-flops", "bf17=1e12", "unknown dtype 'bf17'"),
    ("--peak-flops", "bf16", "write DTYPE=FLOPS pairs"),
    ("--peak-flops", "fp32=-1", "must be a positive number"),
])
def test_malformed_peak_flops_is_one_line(capsys, flag, value, message):
    code, out, err = run(capsys, "flops", "gpt2-tiny", flag, value)
    assert code == 2 and err.count("\n") == 1 and message in err


def test_peak_flops_parse_to_flop_per_second():
    assert hardware.parse_peak_flops("bf16=989e12, fp32=67e12") == {
        "bfloat16": 989e12, "float32": 67e12}
    assert hardware.parse_peak_flops("float8=2e15") == {"float8": 2e15}


@pytest.mark.parametrize("text,size", [("80GiB", 80 * 2**30), ("40GB", 40 * 10**9),
                                       ("512 MiB", 512 * 2**20), ("1e9", 10**9),
                                       ("1.5TiB", 3 * 2**39)])
def test_sizes(text, size):
    assert hardware.parse_size(text) == size


@pytest.mark.fast
@pytest.mark.parametrize("text", ["12XB", "GiB", "-1GB", "", "80G", "nan"])
def test_a_malformed_size_is_refused(text):
    with pytest.raises(AmpscopeError, match="is not a size: write e.g. 80GiB") as info:
        hardware.parse_size(text)
    assert "\n" not in str(info.value)


def _hardware_args(*argv):
    parser = argparse.ArgumentParser()
    add_hardware_arguments(parser)
    args = parser.parse_args(argv)
    resolve_hardware(args)
    return args.accelerator


@pytest.mark.fast
def test_command_line_figures_go_over_the_named_gpu():
    acc = _hardware_args("--gpu", "h100", "--peak-flops", "bf16=800e12", "--memory", "94GiB")
    h100 = hardware.by_name("h100")
    assert acc.peak_flops == {**h100.peak_flops, "bfloat16": 800e12}
    assert acc.memory_bytes == 94 * 2**30 and acc.title == h100.title
    assert acc.sources["bfloat16"] == "the command line" and acc.sources["float32"] == (
        h100.sources["float32"])
    alone = _hardware_args("--peak-flops", "fp32=1e12")
    assert (alone.name, dict(alone.peak_flops), alone.memory_bytes) == ("custom", {"float32": 1e12},
                                                                         None)
    assert _hardware_args() is None  # nothing given: the command's own default applies
    with pytest.raises(AmpscopeError, match="'12XB' is not a size"):
        _hardware_args("--memory", "12XB")


def test_mfu_uses_the_peaks_given(capsys):
    """MFU against `--peak-flops fp32=1e12` is the step's float32 FLOPs over 1e12 FLOP/s over
    the step time, the definition (hardware.mfu), with the FLOPs counted in the same run."""
    code, out, _ = run(capsys, "flops", "gpt2-tiny", "--seq", "8", "-s", "fp32",
                       "--step-time", "0.01", "--peak-flops", "fp32=1e12", "--json", "-")
    data = json.loads(out)
    assert code == 0 and data["utilization"]["device"] == "the given accelerator"
    assert data["utilization"]["mfu"] == pytest.approx(
        data["by_dtype"]["float32"] / 1e12 / 0.01)


TABLE = """
[a6000]
title = "NVIDIA RTX A6000"
patterns = ['\\ba6000\\b']
memory = "48GiB"
bandwidth = 768e9
peak_flops = { bf16 = 154.8e12, fp32 = 38.7e12 }

[h100]
peak_flops = { bf16 = 800e12 }
"""


def test_the_user_table_is_merged_over_the_built_in_one(tmp_path, monkeypatch, capsys):
    path = tmp_path / "hardware.toml"
    path.write_text(TABLE)
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(path))
    a6000 = hardware.by_name("a6000")
    assert (a6000.title, a6000.memory_bytes, a6000.bandwidth_bytes_per_s) == (
        "NVIDIA RTX A6000", 48 * 2**30, 768e9)
    assert dict(a6000.peak_flops) == {"bfloat16": 154.8e12, "float32": 38.7e12}
    assert a6000.sources["bfloat16"] == str(path)
    assert hardware.lookup("NVIDIA RTX A6000") == a6000
    h100 = hardware.by_name("h100")  # overridden: bf16 replaced, the rest kept
    assert h100.peak_flops["bfloat16"] == 800e12
    assert h100.peak_flops["float32"] == hardware.H100.peak_flops["float32"]
    assert h100.memory_bytes == hardware.H100.memory_bytes
    assert hardware.lookup("NVIDIA H100 80GB HBM3") == h100
    code, out, _ = run(capsys, "flops", "gpt2-tiny", "--seq", "8", "-s", "fp32",
                       "--step-time", "0.01", "--gpu", "a6000", "--json", "-")
    data = json.loads(out)
    assert code == 0 and data["utilization"]["device"] == "NVIDIA RTX A6000"
    assert data["utilization"]["mfu"] == pytest.approx(
        data["by_dtype"]["float32"] / 38.7e12 / 0.01)


@pytest.mark.fast
@pytest.mark.parametrize("text,message", [
    ("[a6000\nmemory = 1", "is not valid TOML: "),
    ("[a6000]\nmemory = \"48XB\"\npeak_flops = { bf16 = 1e12 }", "[a6000]: '48XB' is not a size"),
    ("[a6000]\npeak_flops = { bf16 = 1e12 }", "[a6000]: a new accelerator needs memory"),
    ("[h100]\npeak = 1", "[h100]: unknown key 'peak'"),
    ("[h100]\npeak_flops = { bf16 = \"fast\" }", "peak_flops bf16 must be a positive number"),
])
def test_a_broken_user_table_is_one_line(tmp_path, monkeypatch, capsys, text, message):
    path = tmp_path / "hardware.toml"
    path.write_text(text)
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(path))
    code, out, err = run(capsys, "flops", "gpt2-tiny", "--gpu", "h100")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("ampscope: error: ") and message in err and str(path) in err


def test_a_missing_table_named_by_the_environment_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(tmp_path / "nope.toml"))
    with pytest.raises(AmpscopeError, match="nope.toml'?: no such file"):
        hardware.by_name("h100")


def test_the_default_table_path_is_in_the_config_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("AMPSCOPE_HARDWARE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert hardware.user_table_path() == tmp_path / "ampscope" / "hardware.toml"
    assert hardware.table() == hardware.KNOWN  # no file: the built-in table
    (tmp_path / "ampscope").mkdir()
    (tmp_path / "ampscope" / "hardware.toml").write_text(TABLE)
    assert hardware.by_name("a6000").title == "NVIDIA RTX A6000"


# --- the "ampscope" logger and -v -------------------------------------------------------------


def test_the_library_configures_no_handler():
    import ampscope  # noqa: F401

    handlers = logging.getLogger("ampscope").handlers
    assert handlers and all(isinstance(h, logging.NullHandler) for h in handlers)


def test_decisions_are_logged_where_they_are_made(caplog):
    import ampscope

    with caplog.at_level(logging.INFO, logger="ampscope"):
        t = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16", seq=8, predict=True)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ampscope.")]
    # Every note the trace carries was logged as the decision was made, in the same words.
    assert t.notes and set(t.notes) <= set(messages)
    by_logger = {r.name: r.getMessage() for r in caplog.records}
    assert by_logger["ampscope.api.preparation"] == (
        "Predicted on fake tensors, as asked: no weight was materialised.")
    assert by_logger["ampscope.precision.apply"] == (
        "Running under cuda:fp32+amp-bf16: parameters in float32, autocast bfloat16, float32 "
        "matmul precision 'highest'; cuda emulated on the CPU")
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name.startswith("ampscope"))


def test_verbose_shows_the_decisions_on_stderr(capsys):
    code, out, err = run(capsys, "-v", "trace", "gpt2-tiny", "--seq", "8", "-s", "fp32")
    assert code == 0
    assert "ampscope: Predicted on fake tensors (the default" in err
    code, out, err = run(capsys, "-v", "trace", "gpt2-tiny", "--seq", "8", "-s", "fp32", "--real")
    assert code == 0
    assert ("ampscope: gpt2-tiny runs for real under fp32, as asked: its weights, gradients and "
            "optimizer state fit in memory") in err
    assert "ampscope: Running under fp32: parameters in float32, autocast off" in err
    assert "Running under" not in out
    assert logging.getLogger("ampscope").level == logging.NOTSET  # put back after the command
    code, _, quiet = run(capsys, "trace", "gpt2-tiny", "--seq", "8", "-s", "fp32")
    assert code == 0 and "Running under" not in quiet
    code, _, after = run(capsys, "trace", "gpt2-tiny", "--seq", "8", "-s", "fp32", "--verbose")
    assert code == 0 and "ampscope: Running under fp32" in after


def test_verbose_before_formats_keeps_negative_values(capsys):
    code, out, _ = run(capsys, "-v", "formats", "-inf", "--json", "-")
    assert code == 0 and json.loads(out)["values"][0]["text"] == "-inf"
