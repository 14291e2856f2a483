"""The docs check: every `$ ampscope …` transcript in README.md and docs/*.md runs again and must
print what the page shows (`make docs-check` runs this file alone).

A transcript is a fenced block whose first line starts with `$ `. Every `$ ` line in it is a
command, and the lines up to the next `$ ` line are what it printed: stdout and stderr together,
in the order a terminal shows them. Commands run in this process, through
`ampscope.cli.main(argv)`, at 100 columns (`COLUMNS=100`, which rich and argparse read), in a
folder that holds the files the pages name (see `workdir`).

Both sides are normalised before they are compared: trailing spaces are removed, runs of blank
lines become one, and values measured on the machine (durations, rates, dates, the free memory,
the process's peak RSS: `MEASURED`) are replaced by placeholders.

A line that is `…` or `...`, alone or followed by a comment (`… (trimmed: the optimizer
table)`), stands for lines left out: the documented lines around it must appear in the real
output in that order, the first of them at its start and the last at its end unless a `…` line
stands there.

A block opts out of part of the check with an HTML comment on the line before its fence, which
must give a reason in parentheses:

    <!-- docs-check: skip (reason) -->     not run (the output depends on timing, randomness
                                           or this machine's files)
    <!-- docs-check: words (reason) -->    compared word by word: line wraps and column padding
                                           may differ (a measured value of another width
                                           moves them)
    <!-- docs-check: numbers (reason) -->  as `words`, and every number and size unit may differ (a
                                           table of timings)

The shell a command line may use: `VAR=value` before `ampscope` (`COLUMNS=N` sets the width,
`OMP_NUM_THREADS=N` torch's threads, 1 otherwise), `> FILE` (`/dev/null` too) for stdout, a
`# comment`, and pipes into `head -N`, `tail -N` and `python -c CODE`.

The other tests keep the rest of the pages true: every command has its checked `--help` in
cli.md, docs/api.md names every field of the records, and links between the pages resolve.

To bring the pages up to date after a change:

    python tests/test_docs.py --update [--force] [FILE | FILE:LINE ...]

reruns the blocks in a real shell (a process of its own, as a user runs it) and rewrites every
output that fails the check (with --force: that differs at all, measured values included); a
trimmed block keeps its excerpt, found again by the first line of each run of lines, so
review the diff. `python tests/test_docs.py --show 'ampscope …'` prints what a command prints
in the folder the blocks run in.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIXTURES = Path(__file__).resolve().parent / "docs_fixtures"
COLUMNS = 100

FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*docs-check:\s*(?P<mode>[\w-]+)\s*(?:\((?P<reason>.*)\))?\s*-->$")
MODES = {"skip", "words", "numbers"}
GAP = re.compile(r"^(…|\.\.\.)(\s.*)?$")
LISTING = re.compile(r"^# (?P<name>[\w-]+\.py)\b")  # a ```python block naming its file

# Values measured on the machine that printed them.
MEASURED = [
    (re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?"), "<date>"),
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}\b"), "<clock>"),
    (re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:tok/s|tokens/s|it/s|steps/s)"), "<rate>"),
    (re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:ms|µs|s|min)\b"), "<time>"),
    (re.compile(r"\b\d[\d,]*(?:\.\d+)? ?[KMG]i?B \(process peak RSS\)"),
     "<rss> (process peak RSS)"),
    (re.compile(r"machine's \d[\d.]* ?[KMGT]B free"), "machine's <free> free"),
]
BYTES = re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:[KMGT]i?)?B\b")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


# ---------------------------------------------------------------------------------------------
# Reading the pages


@dataclass
class Command:
    text: str  # the command line after "$ "
    lineno: int
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    path: Path
    lineno: int  # of the opening fence
    commands: list[Command]
    mode: str = "lines"  # or a MODES entry
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.lineno}"

    @property
    def trimmed(self) -> bool:
        return any(GAP.match(line) for c in self.commands for line in c.expected)


@dataclass
class Marker:
    path: Path
    lineno: int
    mode: str
    reason: str
    used: bool = False


def _fences(lines: list[str]):
    """(opening index, closing index, info string) of every fenced block."""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == m.group(1)),
                   len(lines))
        yield i, end, m.group(2)
        i = end + 1


def read_pages(paths=DOC_FILES) -> tuple[list[Block], list[Marker]]:
    blocks, markers = [], []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        page_markers = {}
        for n, line in enumerate(lines):
            m = MARKER.match(line.strip())
            if m:
                page_markers[n] = Marker(path, n + 1, m["mode"], (m["reason"] or "").strip())
            elif line.lstrip().startswith("<!--") and "docs-check" in line:
                page_markers[n] = Marker(path, n + 1, "malformed", "")
        markers += page_markers.values()
        for start, end, _ in _fences(lines):
            body = lines[start + 1:end]
            if not body or not body[0].startswith("$ "):
                continue
            commands = []
            for k, line in enumerate(body):
                if line.startswith("$ "):
                    commands.append(Command(line[2:], start + 2 + k))
                else:
                    commands[-1].expected.append(line)
            block = Block(path, start + 1, commands)
            before = start - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            if before in page_markers:
                marker = page_markers[before]
                marker.used = True
                block.mode, block.reason = marker.mode, marker.reason
            blocks.append(block)
    return blocks, markers


def listings(paths=DOC_FILES) -> dict[str, str]:
    """The Python files the pages list in full: a ```python block whose first line is
    `# NAME.py` (e.g. mymodels.py in docs/models.md), written into the folder the commands run
    in, so the listing is what runs."""
    files: dict[str, str] = {}
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        for start, end, info in _fences(lines):
            m = LISTING.match(lines[start + 1]) if info == "python" and start + 1 < end else None
            if m:
                text = "\n".join(lines[start + 1:end]) + "\n"
                if files.setdefault(m["name"], text) != text:
                    raise AssertionError(f"{path.name} lists {m['name']} differently from "
                                         "another page")
    return files


# ---------------------------------------------------------------------------------------------
# Running a command line


@dataclass
class Shell:
    env: dict[str, str]
    argv: list[str]  # after "ampscope"
    stdout_to: str | None = None
    pipes: list[list[str]] = field(default_factory=list)


def parse_command(text: str) -> Shell:
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|>")
    lexer.whitespace_split = True
    tokens = list(lexer)
    env = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    stages, current = [], []
    for token in tokens:
        if token == "|":
            stages.append(current)
            current = []
        else:
            current.append(token)
    stages.append(current)
    first, *pipes = stages
    stdout_to = None
    if ">" in first:
        at = first.index(">")
        if at != len(first) - 2:
            raise ValueError(f"unsupported redirection in {text!r}")
        stdout_to = first[at + 1]
        first = first[:at]
    if not first or first[0] != "ampscope":
        raise ValueError(f"not an ampscope command line: {text!r}")
    for stage in pipes:
        if not (stage[:1] in (["head"], ["tail"]) or stage[:2] == ["python", "-c"]):
            raise ValueError(f"unsupported pipe stage {' '.join(stage)!r} in {text!r}")
    return Shell(env, first[1:], stdout_to, pipes)


class _Stream(io.TextIOBase):
    """One of stdout and stderr; both append to one list, so their order is kept."""

    def __init__(self, chunks: list, name: str):
        self.chunks, self.name = chunks, name

    def write(self, text: str) -> int:
        self.chunks.append((self.name, text))
        return len(text)

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


_TERMINAL = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES", "COLUMNS")


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    import torch

    saved_env = dict(os.environ)
    saved_threads = torch.get_num_threads()
    for key in _TERMINAL:
        os.environ.pop(key, None)
    os.environ["COLUMNS"] = str(COLUMNS)
    os.environ.update(env)
    # One thread unless the command line says otherwise: on a machine shared with other jobs
    # (CI, pytest -n 2 on 2 cores), OpenMP threads waiting for each other made the same run up
    # to 10x slower. The outputs are the same with 1 or 2 threads.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", 1)))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)


@contextlib.contextmanager
def _forget_imports():
    """Modules a command imported from the current folder (mymodels, broken, ...) are dropped
    afterwards, and sys.path restored: other tests in this process write their own files of
    the same names."""
    modules, path, here = set(sys.modules), list(sys.path), os.getcwd()
    try:
        yield
    finally:
        for name in set(sys.modules) - modules:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(here + os.sep):
                del sys.modules[name]
        sys.path[:] = path


def _main(argv: list[str]) -> int:
    from ampscope.cli import main

    try:
        return main(argv)
    except SystemExit as e:  # argparse: --help, usage errors
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except Exception:  # noqa: BLE001 - --debug re-raises: Python would print the traceback and exit 1
        traceback.print_exc()
        return 1


def _pipe(stage: list[str], text: str) -> str:
    if stage[0] in ("head", "tail"):
        count = int(stage[-1].lstrip("-"))
        lines = text.splitlines(keepends=True)
        return "".join(lines[:count] if stage[0] == "head" else lines[-count:])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), _stdin(text):
        exec(compile(stage[2], "<string>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


@contextlib.contextmanager
def _stdin(text: str):
    saved, sys.stdin = sys.stdin, io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def run_command(text: str) -> str:
    """What the command line prints, run in the current directory."""
    shell = parse_command(text)
    chunks: list = []
    with (_environment(shell.env), _forget_imports(),
          contextlib.redirect_stdout(_Stream(chunks, "out")),
          contextlib.redirect_stderr(_Stream(chunks, "err"))):
        _main(shell.argv)
    stdout = "".join(t for name, t in chunks if name == "out")
    stderr = "".join(t for name, t in chunks if name == "err")
    if shell.stdout_to:
        if shell.stdout_to != "/dev/null":
            Path(shell.stdout_to).write_text(stdout, encoding="utf-8")
        return stderr
    if shell.pipes:
        for stage in shell.pipes:
            stdout = _pipe(stage, stdout)
        return stderr + stdout
    return "".join(t for _, t in chunks)


# ---------------------------------------------------------------------------------------------
# Comparing


def normalise(lines: list[str], mode: str = "lines") -> list[str]:
    """Trailing spaces removed, measured values replaced, one blank line at most, none at the
    ends; for `words` and `numbers` the words of each run of lines between two `…` lines (and
    for `numbers` every number as `#`)."""
    out: list[str] = []
    for line in lines:
        line = line.rstrip()
        for pattern, placeholder in MEASURED if mode != "exact" else ():
            line = pattern.sub(placeholder, line)
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    if mode in ("words", "numbers"):
        words: list[str] = []
        for line in out:
            if GAP.match(line):
                words.append(line)
                continue
            if mode == "numbers":
                line = NUMBER.sub("#", BYTES.sub("<bytes>", line))
            words += re.sub(r"━+", "━", line).split()
        return words
    return out


def matches(expected: list[str], actual: list[str]) -> str | None:
    """None when `actual` is `expected` with the `…` gaps filled; else what is missing."""
    segments: list[list[str]] = [[]]
    for item in expected:
        if GAP.match(item):
            segments.append([])
        else:
            segments[-1].append(item)
    if len(segments) == 1:
        return None if expected == actual else "the output differs"
    segments = [_strip_blank(s) for s in segments]
    first, *middle, last = segments
    if actual[:len(first)] != first:
        return "the first lines differ"
    pos = len(first)
    for segment in middle:
        found = _find(actual, segment, pos)
        if found is None:
            return f"not found in order: {segment[0]!r} and {len(segment) - 1} more"
        pos = found + len(segment)
    if last and (len(actual) - len(last) < pos or actual[len(actual) - len(last):] != last):
        return f"the last lines differ, from {last[0]!r}"
    return None


def _strip_blank(items: list[str]) -> list[str]:
    start, end = 0, len(items)
    while start < end and not items[start]:
        start += 1
    while end > start and not items[end - 1]:
        end -= 1
    return items[start:end]


def _find(items: list[str], segment: list[str], start: int) -> int | None:
    if not segment:
        return start
    for i in range(start, len(items) - len(segment) + 1):
        if items[i:i + len(segment)] == segment:
            return i
    return None


def check_block(block: Block) -> list[str]:
    """Run the block's commands in order; one message per command whose output differs."""
    problems = []
    for command in block.commands:
        printed = run_command(command.text).splitlines()
        expected, actual = normalise(command.expected, block.mode), normalise(printed, block.mode)
        why = matches(expected, actual)
        if why:
            import difflib

            diff = "\n".join(difflib.unified_diff(expected, actual, "documented", "printed",
                                                  lineterm="", n=2))
            problems.append(f"{block.path.relative_to(ROOT)}:{command.lineno}: $ {command.text}\n"
                            f"{why}\n{diff}")
    return problems


# ---------------------------------------------------------------------------------------------
# The folder the commands run in


def build_workdir(path: Path) -> Path:
    """The files the pages' command lines name: the `# NAME.py` listings of the pages,
    tests/docs_fixtures/ (broken.py, syncing.py), examples/ (with the token file its training
    script writes), a saved trace a.json, models.json, bad.json, and small Hugging Face folders
    for hf:PATH."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in listings().items():
        (path / name).write_text(text, encoding="utf-8")
    for file in FIXTURES.glob("*.py"):
        shutil.copy(file, path / file.name)
    # The project's example scripts, as `ampscope run examples/gpt/train.py` names them.
    shutil.copytree(ROOT / "examples", path / "examples", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("data", "__pycache__"))
    with _chdir(path):
        # The example script writes its token file on its first run, and the report lists
        # files a script creates: one run first, so every page shows a later run.
        for command in ("ampscope trace gpt2-tiny --seq 8 -s fp32 --json a.json > /dev/null",
                        "ampscope models --json models.json > /dev/null",
                        "ampscope run -q examples/gpt/train.py --n_layer=1 --block_size=8 "
                        "> /dev/null"):
            run_command(command)
    (path / "bad.json").write_text("{'schema': 'ampscope.trace/1'}\n")
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' "Writing model shards" bar
        _hf_folders(path)
    return path


def _hf_folders(path: Path) -> None:
    import json

    import torch
    import transformers

    llama = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=64, tie_word_embeddings=False)
    config = transformers.LlamaConfig(**llama)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path / "tiny-llama-weights")  # config.json and model.safetensors
    config.save_pretrained(path / "tiny-llama")  # a folder named like a model, without hf:
    (path / "empty").mkdir(exist_ok=True)
    (path / "bad").mkdir(exist_ok=True)
    (path / "bad" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (path / "nomodel").mkdir(exist_ok=True)
    (path / "nomodel" / "config.json").write_text(json.dumps({"model_type": "nosuch"}))
    transformers.ViTConfig().save_pretrained(path / "vit")
    config.save_pretrained(path / "two")
    for name in ("ckpt.pt", "other.pt"):
        torch.save(model.state_dict(), path / "two" / name)
    transformers.LlamaConfig(**(llama | {"hidden_size": 32})).save_pretrained(path / "mismatch")
    torch.save(model.state_dict(), path / "mismatch" / "ckpt.pt")
    config.save_pretrained(path / "evil")
    torch.save({"model": _Evil()}, path / "evil" / "ckpt.pt")


@contextlib.contextmanager
def _chdir(path: Path):
    saved = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(saved)


class _Evil:
    """Pickles a call: what torch.load(weights_only=True) refuses to run."""

    def __reduce__(self):
        return (print, ("this ran",))


# ---------------------------------------------------------------------------------------------
# The tests

BLOCKS, MARKERS = read_pages()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return build_workdir(tmp_path_factory.mktemp("docs"))


@pytest.mark.parametrize("block", [b for b in BLOCKS], ids=[b.id for b in BLOCKS])
def test_documented_output_is_what_the_command_prints(block, workdir, monkeypatch):
    if block.mode == "skip":
        pytest.skip(block.reason)
    monkeypatch.chdir(workdir)
    problems = check_block(block)
    assert not problems, "\n\n".join(problems)


@pytest.mark.fast
def test_every_opt_out_names_its_mode_and_reason_and_precedes_a_transcript():
    bad = [f"{m.path.relative_to(ROOT)}:{m.lineno}" for m in MARKERS
           if m.mode not in MODES or not m.reason or not m.used]
    assert not bad, ("a docs-check marker must read <!-- docs-check: MODE (reason) --> with MODE "
                     f"one of {sorted(MODES)}, right before a $ block: {bad}")


@pytest.mark.fast
def test_commands_run_at_100_columns():
    from rich.console import Console

    with _environment({}):
        assert Console().width == COLUMNS
    printed = run_command("ampscope trace --help").splitlines()
    assert max(map(len, printed)) <= COLUMNS < max(map(len, run_command(
        "COLUMNS=140 ampscope trace --help").splitlines()))


@pytest.mark.fast
def test_every_command_line_is_one_the_check_can_run():
    for block in BLOCKS:
        for command in block.commands:
            parse_command(command.text)  # raises on a shell feature it does not handle


@pytest.mark.fast
def test_cli_md_shows_the_help_of_every_command():
    """The options of each command are documented by its checked `--help` output, so cli.md
    cannot list an option the parser lacks or miss one it has."""
    from ampscope.cli import _parser

    [sub] = [a for a in _parser()._actions if a.dest == "command"]
    shown = {c.text for b in BLOCKS if b.path.name == "cli.md" and b.mode != "skip"
             for c in b.commands}
    missing = [name for name in ["", *sub.choices]
               if " ".join(["ampscope", name, "--help"]).replace("  ", " ") not in shown]
    assert not missing, f"docs/cli.md has no checked `ampscope COMMAND --help` for {missing}"


@pytest.mark.fast
def test_every_command_listed_without_output_parses():
    """Command lines shown without their output (```sh blocks such as the README's "More of the
    same") are not run, but they must use options the parser has."""
    from ampscope.cli import _parser, _values_after_dashes

    bad = []
    for path in DOC_FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        for start, end, info in _fences(lines):
            body = "\n".join(lines[start + 1:end]).replace("\\\n", " ").splitlines()
            if info in ("python", "json") or (body and body[0].startswith("$ ")):
                continue
            for line in body:
                if not line.startswith("ampscope ") or "[" in line:  # "[" : a usage synopsis
                    continue
                argv = shlex.split(line, comments=True)[1:]
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        _parser().parse_args(_values_after_dashes(argv))
                except SystemExit:
                    bad.append(f"{path.relative_to(ROOT)}: {line}")
    assert not bad, "\n".join(bad)


@pytest.mark.fast
def test_api_md_names_every_field_of_the_records():
    import dataclasses

    from ampscope import records
    from ampscope.records import Trace

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    rows = {m["name"]: m["row"]
            for m in re.finditer(r"^\| `(?P<name>\w+)` \|(?P<row>.*)$", text, re.M)}
    classes = [c for c in vars(records).values() if isinstance(c, type)
               and dataclasses.is_dataclass(c) and c.__module__.startswith(records.__name__)
               and c is not Trace]
    missing = []
    for cls in classes:
        row = rows.get(cls.__name__, "")
        missing += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)
                    if f"`{f.name}`" not in row]
    block = re.search(r"^class Trace:\n(.*?)^```", text, re.M | re.S)
    missing += [f"Trace.{f.name}" for f in dataclasses.fields(Trace)
                if not block or not re.search(rf"^ +{f.name}: ", block[1], re.M)]
    assert not missing, f"docs/api.md does not name {missing} (the records table, `class Trace`)"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    lines = path.read_text(encoding="utf-8").splitlines()
    fenced = set()
    for start, end, _ in _fences(lines):
        fenced.update(range(start, end + 1))
    for n, line in enumerate(lines):
        m = re.match(r"^#{1,6} (.*)$", line)
        if m and n not in fenced:
            slug = _slug(m[1])
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.fast
def test_links_between_the_pages_resolve():
    """Every relative link of README.md, docs/*.md, benchmarks/README.md and CONTRIBUTING.md
    names a file of the repository and, for a page, one of its headings."""
    broken = []
    for path in [*DOC_FILES, ROOT / "benchmarks" / "README.md", ROOT / "CONTRIBUTING.md"]:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or ROOT not in linked.parents:
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---------------------------------------------------------------------------------------------
# python tests/test_docs.py --update | --dry-run [FILE | FILE:LINE ...]; --show COMMAND


def shell(command: str, cwd: Path) -> str:
    """What the command line prints in a real shell, as a terminal shows it: stdout and stderr
    on one pipe (unbuffered, so in order), COLUMNS=100 unless it sets another, and this
    environment's ampscope first on PATH. --update writes this, not the in-process output: a
    process of its own has the peak RSS a user sees."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in _TERMINAL}
    env |= {"COLUMNS": str(COLUMNS), "PYTHONUNBUFFERED": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return done.stdout


def retrim(expected: list[str], printed: list[str]) -> list[str] | None:
    """The same excerpt of the new output: each run of documented lines between `…` lines is
    found again by its first line and replaced by as many printed lines (the last run, when no
    `…` follows it, by the rest of the output). None when a first line is not found."""
    runs: list[list[str]] = [[]]
    gaps: list[str] = []
    for line in expected:
        if GAP.match(line):
            gaps.append(line)
            runs.append([])
        else:
            runs[-1].append(line)
    key = [" ".join(normalise([line])) for line in printed]
    out: list[str] = []
    pos = 0
    for k, run in enumerate(runs):
        if k:
            out.append(gaps[k - 1])
        run = _strip_blank(run)
        if not run:
            continue
        if k == 0:
            start = 0
        else:
            start = next((i for i in range(pos, len(printed))
                          if key[i] == " ".join(normalise([run[0]]))), None)
            if start is None:
                return None
        end = len(printed) if k == len(runs) - 1 else start + len(run)
        out += printed[start:end]
        pos = end
    return out


def _update(targets: list[str], write: bool, force: bool = False) -> int:
    """Rerun the blocks; rewrite each output that fails the check (with force: that differs in
    any way, measured values included, also in a `words` or `numbers` block)."""
    import tempfile

    paths = sorted({(ROOT / t.partition(":")[0]).resolve() for t in targets}) or DOC_FILES
    blocks = [b for b in read_pages(paths)[0]
              if not targets or b.id in targets or str(b.path.relative_to(ROOT)) in targets]
    failed = 0
    edits: dict[Path, list[tuple[int, int, list[str]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = build_workdir(Path(tmp) / "docs")
        for block in blocks:
            if block.mode == "skip":
                print(f"skip  {block.id}: {block.reason}")
                continue
            started = time.perf_counter()
            for command in block.commands:
                printed = [line.rstrip() for line in shell(command.text, work).splitlines()]
                while printed and not printed[-1]:
                    printed.pop()
                while printed and not printed[0]:  # a progress bar's line off a terminal
                    printed.pop(0)
                mode = "exact" if force else block.mode
                if matches(normalise(command.expected, mode), normalise(printed, mode)) is None:
                    continue
                where = f"{block.path.relative_to(ROOT)}:{command.lineno} $ {command.text}"
                new = retrim(command.expected, printed) if block.trimmed else printed
                if new is None or matches(normalise(new, block.mode),
                                          normalise(printed, block.mode)) is not None:
                    failed += 1
                    print(f"FAIL  {where} (trimmed: edit by hand)\n" + "\n".join(printed))
                    continue
                edits.setdefault(block.path, []).append(
                    (command.lineno, len(command.expected), new))
                print(f"{'fixed' if write else 'DIFF '} {where}")
            print(f"{time.perf_counter() - started:5.1f}s {block.id}")
    for path, changes in edits.items() if write else ():
        lines = path.read_text(encoding="utf-8").splitlines()
        for lineno, count, new in sorted(changes, reverse=True):
            lines[lineno:lineno + count] = new  # the output follows the "$ " line (1-based)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 1 if failed or (edits and not write) else 0


def _show(command: str) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(shell(command, build_workdir(Path(tmp) / "docs")), end="")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] in (["--update"], ["--dry-run"]):
        force = "--force" in args
        sys.exit(_update([a for a in args[1:] if a != "--force"], args[0] == "--update", force))
    if args[:1] == ["--show"] and len(args) == 2:
        sys.exit(_show(args[1]))
    sys.exit("usage: python tests/test_docs.py --update|--dry-run [--force] "
             "[FILE | FILE:LINE ...]\n"
             "       python tests/test_docs.py --show 'ampscope …'")
