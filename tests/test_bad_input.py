"""Bad input, class by class, for every command: each case exits 2 with exactly one line on
stderr that names the problem, and nothing on stdout (user code's own prints aside).

Cases run in-process through `ampscope.cli.main` (fast); a few go through the real console
script at the end, to prove the entry point behaves the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampscope.cli import main

RUNNERS = ["trace", "matrix", "report", "memory", "flops", "numerics"]  # take a MODEL spec
SIZED = ["trace", "matrix", "report", "memory", "flops", "diff"]  # take --new-tokens too

FACTORIES = textwrap.dedent('''
    import sys
    import torch

    def raises():
        raise RuntimeError("the factory failed")

    def exits_0():
        sys.exit(0)

    def exits_1():
        sys.exit(1)

    def exits_text():
        raise SystemExit("bye")

    def returns_none():
        return None

    def returns_text():
        return "a model"

    def returns_tensor():
        return torch.zeros(2)

    def returns_class():
        return torch.nn.Linear

    def prints_then_returns_none():
        print("USER: building")
        return None

    def needs_arguments(width):
        return torch.nn.Linear(width, width)

    def recurses():
        return recurses()

    def interrupted_by_eof():
        raise EOFError()

    not_callable = 3
''')

MODULES = {
    "factories.py": FACTORIES,
    "exits_on_import.py": "import sys\nsys.exit(3)\n",
    "raises_on_import.py": "raise ImportError('needs a package this machine lacks')\n",
    "syntax_error.py": "def build(:\n",
    "prints_on_import.py": "print('USER: importing')\nraise ValueError('then it fails')\n",
    "script_raises.py": "raise RuntimeError('the script failed')\n",
    "script_exits.py": "import sys\nsys.exit(0)\n",
    "script_without_model.py": "x = 1 + 1\n",
    "script_syntax.py": "for\n",
}


class Blocked(Exception):
    pass


@pytest.fixture(autouse=True)
def no_case_may_block():
    """A case that would block (reading a FIFO waits for a writer forever) fails instead of
    hanging the suite."""
    def blocked(signum, frame):
        raise Blocked("still running after 120 s: blocked or far too slow")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def bad(tmp_path, monkeypatch):
    """A folder of bad inputs: files of every kind, and modules that misbehave."""
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
        monkeypatch.delitem(sys.modules, name[:-3], raising=False)
    os.mkfifo(tmp_path / "pipe.json")
    os.mkfifo(tmp_path / "pipe.txt")
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "folder.json").mkdir()
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "text.json").write_text("not json at all\n")
    (tmp_path / "list.json").write_text("[1, 2]\n")
    (tmp_path / "other.json").write_text('{"schema": "something/1"}\n')
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00\x01\x89PNG")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x01\x89PNG" * 100)
    (tmp_path / "binary.py").write_bytes(b"\xff\xfe\x00\x01\x89PNG")
    (tmp_path / "afile").write_text("")
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "binconfig").mkdir()
    (tmp_path / "binconfig" / "config.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "notype").mkdir()
    (tmp_path / "notype" / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "nockpt").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def case(argv: str, message: str, *, user: str = ""):
    """One bad command line (split on spaces; '' stands for an empty argument), a part of the
    message it must give, and the lines user code itself prints (allowed on stderr)."""
    return pytest.param([("" if a == "''" else a) for a in argv.split()], message, user,
                        id=argv)


CASES = [
    # --- unknown model names, in every command that takes one --------------------------
    *[case(f"{c} gtp2", "did you mean 'gpt2'") for c in RUNNERS],
    case("diff fp32 bf16 --model gtp2", "did you mean 'gpt2'"),
    case("train --model gtp2", "did you mean 'gpt2'"),
    case("bench --model gtp2", "did you mean 'gpt2'"),
    case("trace llama3-8b", "did you mean 'llama-3-8b'"),
    case("trace zzzzzz", "unknown model 'zzzzzz'"),
    case("memory ''", "unknown model ''"),
    case("trace hf:", "hf:"),
    case("trace hf:/no/such/dir", "/no/such/dir: no such file or folder"),
    case("trace hf:noconfig", "no config.json"),
    case("trace hf:binconfig", "not a UTF-8 text file"),
    case("trace hf:notype", "has no model_type"),
    case("trace hf:pipe.json", "not a regular file or folder"),
    case("trace no_such_module_xyz:build", "no_such_module_xyz"),
    case("trace factories:no_such_factory", "no_such_factory"),
    case("trace :build", ":build"),
    case("trace factories:", "factories:"),
    # --- factories that raise, exit, print or return the wrong type ---------------------
    case("trace factories:raises", "the factory failed"),
    case("matrix factories:raises", "the factory failed"),
    case("memory factories:raises", "the factory failed"),
    case("flops factories:raises", "the factory failed"),
    case("numerics factories:raises", "the factory failed"),
    case("report factories:raises", "the factory failed"),
    case("trace factories:exits_0", "called sys.exit(0) instead of returning a model"),
    case("matrix factories:exits_0", "called sys.exit(0)"),
    case("memory factories:exits_0", "called sys.exit(0)"),
    case("flops factories:exits_0", "called sys.exit(0)"),
    case("numerics factories:exits_0", "called sys.exit(0)"),
    case("report factories:exits_0", "called sys.exit(0)"),
    case("trace factories:exits_1", "called sys.exit(1)"),
    case("trace factories:exits_text", "called sys.exit('bye')"),
    case("trace exits_on_import:build", "importing 'exits_on_import' called sys.exit(3)"),
    case("trace raises_on_import:build", "needs a package this machine lacks"),
    case("trace syntax_error:build", "SyntaxError"),
    case("trace prints_on_import:build --json -", "then it fails", user="USER: importing"),
    case("trace factories:returns_none", "returned a NoneType; return an nn.Module"),
    case("memory factories:returns_none", "returned a NoneType; return an nn.Module"),
    case("trace factories:returns_text", "returned a str; return an nn.Module"),
    case("trace factories:returns_tensor", "returned a Tensor; return an nn.Module"),
    case("trace factories:returns_class", "returned a type; return an nn.Module"),
    case("trace factories:prints_then_returns_none --json -", "returned a NoneType",
         user="USER: building"),
    case("trace factories:needs_arguments", "needs_arguments"),
    case("trace factories:not_callable", "not_callable"),
    case("trace factories:recurses", "RecursionError"),
    case("trace factories:interrupted_by_eof", "EOFError"),
    # --- malformed settings ------------------------------------------------------------
    case("trace gpt2-tiny -s fp32+amp-int8", "[DEVICE:]PARAMS[+amp[-AMP]][+tf32]"),
    case("trace gpt2-tiny -s xla:fp32", "not one ampscope can run or emulate"),
    case("trace gpt2-tiny -s ''", "[DEVICE:]PARAMS"),
    case("trace gpt2-tiny -s fp32++amp", "[DEVICE:]PARAMS"),
    case("trace gpt2-tiny -s fp8", "[DEVICE:]PARAMS"),
    case("trace gpt2-tiny -s mps:fp32 --device cuda", "names device 'mps' but --device is"),
    case("memory gpt2-tiny -s bogus", "[DEVICE:]PARAMS"),
    case("flops gpt2-tiny -s bogus", "[DEVICE:]PARAMS"),
    case("matrix gpt2-tiny --settings fp32,bogus", "bogus"),
    case("matrix gpt2-tiny --settings ,", "at least one setting"),
    case("report gpt2-tiny --settings bogus", "bogus"),
    case("numerics gpt2-tiny --settings bogus", "bogus"),
    case("numerics gpt2-tiny --settings ''", "at least one setting"),
    case("diff fp32 bogus --model gpt2-tiny", "bogus"),
    case("train -s bogus --steps 1", "bogus"),
    case("bench --ladder bogus --steps 1", "bogus"),
    case("bench --ladder fp32+flash+flash --steps 1", "repeated part 'flash'"),
    case("bench --ladder , --steps 1", "at least one rung"),
    case("trace gpt2-tiny --mp-policy param=bf16 --distributed fsdp --predict --seq 4 "
         "--mp-policy bogus", "bogus"),
    # --- non-positive sizes --------------------------------------------------------------
    *[case(f"{c} gpt2-tiny --batch 0", "positive integers; got batch=0")
      for c in [*RUNNERS]],
    *[case(f"{c} gpt2-tiny --seq -3", "positive integers; got seq=-3") for c in RUNNERS],
    *[case(f"{c} gpt2-tiny --new-tokens 0 -w generate", "new_tokens=0")
      for c in ["trace", "matrix", "report", "memory", "flops"]],
    case("diff fp32 bf16 --model gpt2-tiny --batch 0", "positive integers; got batch=0"),
    case("flops gpt2-tiny --step-time 0", "step time must be a positive number"),
    case("flops gpt2-tiny --step-time -1", "step time must be a positive number"),
    case("flops gpt2-tiny --step-time nan", "step time must be a positive number"),
    case("flops gpt2-tiny --step-time inf", "step time must be a positive number"),
    case("train --steps 0", "--steps must be a positive"),
    case("train --batch 0", "--batch must be a positive"),
    case("train --seq -1", "--seq must be a positive"),
    case("train --total-batch 0", "--total-batch must be a positive number"),
    case("train --total-batch 7 --batch 2 --seq 2", "--total-batch 7 is not a multiple of"),
    case("train --lr 0", "--lr must be a positive"),
    case("train --lr nan", "--lr must be a positive"),
    case("train --warmup-steps -1", "--warmup-steps must be"),
    case("train --eval-every 0", "--eval-every must be a positive"),
    case("train --save-every -1", "--save-every must be"),
    case("train --sample-tokens -1", "--sample-tokens must be"),
    case("train --log-every 0", "--log-every must be a positive"),
    case("bench --steps 0", "--steps must be a positive"),
    case("bench --warmup -1", "--warmup must be"),
    case("bench --batch 0", "--batch must be a positive"),
    case("bench --seq 0", "--seq must be a positive"),
    case("bench --total-batch 0", "--total-batch must be a positive number"),
    case("run --steps 0 script_without_model.py", "--steps must be at least 1"),
    case("trace gpt2-tiny --distributed ddp --nproc 0", "--nproc must be at least 1"),
    case("trace gpt2-tiny --distributed ddp --timeout 0", "--timeout must be a positive"),
    case("trace gpt2-tiny --distributed ddp --timeout nan", "--timeout must be a positive"),
    # --- absurd sizes ----------------------------------------------------------------------
    case("trace gpt2-tiny --seq 100000", "context length"),
    case("numerics gpt2-tiny --seq 100000", "context length"),
    case("memory gpt2-tiny --seq 1000000000", "context length"),
    case("trace gpt2-tiny --batch 1000000000000", "at most 2,147,483,647; got "
         "batch=1,000,000,000,000"),
    case("trace gpt2-tiny --batch 99999999999999999999999", "at most 2,147,483,647"),
    case("trace gpt2-tiny --new-tokens 99999999999999999999 -w generate",
         "at most 2,147,483,647; got new_tokens="),
    case("numerics gpt2-tiny --batch 100000000", "would not fit: their ids alone need"),
    case("memory gpt2-tiny --batch 100000000 --predict", "would not fit: their ids alone need"),
    case("trace gpt2-tiny --batch 1000000 --no-predict", "would not fit: its predicted peak"),
    case("train --batch 1000000000000 --steps 1", "at most 2,147,483,647"),
    case("train --seq 100000 --steps 1", "exceeds gpt2-tiny's context length 64"),
    # --- malformed numbers and unknown choices (argparse's checks, in one line) -----------
    case("trace gpt2-tiny --batch abc", "invalid int value: 'abc'"),
    case("trace gpt2-tiny --seq 1.5", "invalid int value: '1.5'"),
    case("memory gpt2-tiny --batch ''", "invalid int value: ''"),
    case("flops gpt2-tiny --step-time fast", "invalid float value: 'fast'"),
    case("train --lr high", "invalid float value: 'high'"),
    case("bench --steps many", "invalid int value: 'many'"),
    case("trace gpt2-tiny -w bogus", "invalid choice: 'bogus'"),
    case("trace gpt2-tiny --device tpu", "invalid choice: 'tpu'"),
    case("trace gpt2-tiny --optimizer lion", "invalid choice: 'lion'"),
    case("numerics gpt2-tiny --reference fp16", "invalid choice: 'fp16'"),
    case("numerics gpt2-tiny -w generate", "invalid choice: 'generate'"),
    case("policy --dtype fp8", "invalid choice: 'fp8'"),
    case("train --tokenizer sentencepiece", "invalid choice: 'sentencepiece'"),
    case("train --decay step", "invalid choice: 'step'"),
    case("trace gpt2-tiny --distributed zero", "invalid choice: 'zero'"),
    case("bogus", "invalid choice: 'bogus'"),
    case("trace gpt2-tiny --no-such-flag", "unrecognized arguments: --no-such-flag"),
    case("trace gpt2-tiny extra", "unrecognized arguments: extra"),
    case("flops gpt2-tiny --step-time 1 --measure", "not allowed with argument --step-time"),
    case("trace gpt2-tiny --json", "expected one argument"),
    case("diff onlyone", "the following arguments are required: b"),
    case("run", "the following arguments are required: TARGET"),
    # refused before the script runs (the script is not even looked for)
    case("run --step-time -1 train.py", "step time must be a positive number"),
    case("run --step-time nan train.py", "step time must be a positive number"),
    case("run --gpu h1000 train.py", "unknown accelerator 'h1000'"),
    case("trace gpt2-tiny --gpu h1000", "unknown accelerator 'h1000'"),
    case("matrix gpt2-tiny --gpu h1000", "unknown accelerator 'h1000'"),
    case("formats abc", "abc"),
    case("formats 1e5x", "1e5x"),
    case("policy --op no_op_has_this_name", "no op containing 'no_op_has_this_name'"),
    case("policy --compare cpu tpu", "tpu"),
    case("policy --compare cpu", "expected 2 arguments"),
    # --- contradictory or meaningless flags ----------------------------------------------
    case("trace gpt2-tiny --predict --no-predict", "--predict or --real, not both"),
    case("trace gpt2-tiny --predict --real", "--predict or --real, not both"),
    case("memory gpt2-tiny --no-predict --predict", "--predict or --real, not both"),
    case("trace gpt2-tiny --nproc 4", "--nproc only applies with --distributed"),
    case("trace gpt2-tiny --mp-policy param=bf16", "--mp-policy only applies with --distributed"),
    case("memory gpt2-tiny --timeout 5", "--timeout only applies with --distributed"),
    case("trace gpt2-tiny --distributed ddp -w forward", "--distributed runs the train workload"),
    case("memory gpt2-tiny --device mps --measure", "--measure needs a real CUDA"),
    case("flops gpt2-tiny --device cuda --measure", "this machine has no cuda"),
    case("flops gpt2-tiny --gpu h1000 --step-time 1 --predict --seq 4",
         "unknown accelerator 'h1000'; known:"),
    case("bench -d cuda", "cannot bench on cuda: this machine has no cuda"),
    case("bench -d mps", "cannot bench on mps: this machine has no mps"),
    case("train -d cuda --steps 1", "cuda"),
    case("train -s cuda:fp32 --steps 1", "cuda"),
    case("diff a.json fp32", "two trace files or two settings"),
    # --- input files: missing, folder, FIFO, binary, empty, not ours ----------------------
    case("diff missing.json other.json", "cannot read missing.json"),
    case("diff folder.json other.json", "cannot read folder.json: not a regular file"),
    case("diff pipe.json other.json", "cannot read pipe.json: not a regular file"),
    case("diff other.json pipe.json", "cannot read pipe.json: not a regular file"),
    case("diff binary.json other.json", "binary.json is not a text file"),
    case("diff empty.json other.json", "empty.json is not an ampscope trace"),
    case("diff text.json other.json", "text.json is not an ampscope trace"),
    case("diff list.json other.json", "list.json is not an ampscope trace"),
    case("diff other.json other.json", "other.json is not an ampscope trace"),
    case("train --data missing.txt --steps 1", "cannot read --data missing.txt"),
    case("train --data folder.json --steps 1", "cannot read --data folder.json"),
    case("train --data pipe.txt --steps 1", "cannot read --data pipe.txt: not a regular file"),
    case("train --data binary.txt --steps 1", "binary.txt is not UTF-8 text"),
    case("train --data empty.json --steps 1", "empty.json has 0 tokens"),
    case("bench --data pipe.txt --steps 1", "cannot read --data pipe.txt: not a regular file"),
    case("bench --data missing.txt --steps 1", "cannot read --data missing.txt"),
    case("train --resume missing --steps 1", "no checkpoint in missing"),
    case("train --resume nockpt --steps 1", "no checkpoint in nockpt"),
    case("train --resume afile --steps 1", "no checkpoint in afile"),
    case("train --resume pipe.json --steps 1", "no checkpoint in pipe.json"),
    case("run missing.py", "missing.py"),
    case("run folder.json", "folder.json"),
    case("run pipe.py", "pipe.py: not a regular file"),
    case("run binary.py", "binary.py"),
    case("run script_syntax.py", "SyntaxError"),
    case("run script_raises.py", "the script failed"),
    case("run script_exits.py", "script_exits.py"),
    case("run script_without_model.py", "script_without_model.py"),
    case("run -m no_such_module_xyz", "no_such_module_xyz"),
    # --- output paths: missing folder, a folder, empty, under a file -----------------------
    *[case(f"{c} gpt2-tiny --json /no/such/folder/out.json", "no folder /no/such/folder")
      for c in RUNNERS],
    case("diff fp32 bf16 --json /no/such/folder/d.json", "no folder"),
    case("trace gpt2-tiny --json ''", "no path given"),
    case("trace gpt2-tiny --json folder.json", "it is a folder"),
    case("trace gpt2-tiny --json afile/x.json", "no folder afile"),
    case("report gpt2-tiny -o /no/such/folder/r.html", "no folder"),
    case("report gpt2-tiny -o folder.json", "it is a folder"),
    case("report gpt2-tiny -o ''", "no path given"),
    case("models --json /no/such/folder/m.json", "no folder"),
    case("policy --json folder.json", "it is a folder"),
    case("formats 1 --json /no/such/folder/f.json", "no folder"),
    case("train --json /no/such/folder/t.json --steps 1", "no folder"),
    case("bench --json folder.json --steps 1", "it is a folder"),
    case("train --out afile --steps 1", "it is a file, not a folder"),
    case("bench --out afile --steps 1", "it is a file, not a folder"),
    case("run --json /no/such/folder/r.json script_without_model.py", "no folder"),
    case("numerics gpt2-tiny --json ''", "no path given"),
]


# Scripts that fail on their own, as `python SCRIPT` would: `ampscope run` ends with python's
# status for them, 1 (an uncaught exception; a file python cannot compile).
SCRIPTS_THAT_FAIL = {"binary.py", "script_syntax.py", "script_raises.py"}


@pytest.mark.parametrize(("argv", "message", "user"), CASES)
def test_bad_input_is_refused_in_one_line(bad, capsys, argv, message, user):
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip() and line != user]
    expected = 1 if argv[0] == "run" and argv[-1] in SCRIPTS_THAT_FAIL else 2
    assert code == expected, (code, out[-300:], err[-300:])
    assert out == "", out[-300:]
    assert len(lines) == 1 and lines[0].startswith("ampscope: error"), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err


def test_at_least_146_cases_class_by_class():
    assert len(CASES) >= 146


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("argv", [["trace", "gpt2-tiny", "--json", "{ro}/t.json"],
                                  ["report", "gpt2-tiny", "-o", "{ro}/r.html"],
                                  ["train", "--out", "{ro}/ckpt", "--steps", "1"]])
def test_a_read_only_output_folder_is_refused(tmp_path, capsys, argv):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main([a.replace("{ro}", str(ro)) for a in argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "not writable" in err and len(err.strip().splitlines()) == 1
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize(("argv", "message"), [
    (["trace", "gpt2-tiny", "--batch", "abc"], "invalid int value: 'abc'"),
    (["trace", "factories:exits_0"], "called sys.exit(0)"),
    (["diff", "pipe.json", "other.json"], "not a regular file"),
    (["trace", "gpt2-tiny", "--predict", "--no-predict"], "not both"),
])
def test_the_console_script_refuses_the_same_way(bad, argv, message):
    """The real entry point (`ampscope`, which leaves through os._exit) in a fresh process."""
    script = Path(sys.executable).parent / "ampscope"
    done = subprocess.run([str(script), *argv], capture_output=True, text=True, check=False,
                          cwd=bad, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(bad)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
