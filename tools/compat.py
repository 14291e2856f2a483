#!/usr/bin/env python3
"""ampscope against one PyTorch release after another (docs/compatibility.md).

For each torch build it creates a fresh virtual environment in a temporary folder, installs that
torch alone first, then ampscope from this checkout with its normal dependency resolution
(`pip install "<checkout>[hf,dev]"`) and checks that torch was not replaced. It then runs the
ten commands of COMMANDS (each writing its JSON), the core tests (CORE_TESTS, with pytest),
compares every command's normalised JSON with the golden recorded on torch 2.13
(tests/golden/compat/), and deletes the environment. Differences from a golden fail the build
unless an entry of tests/golden/compat/allowlist.json explains them for that release.

    python3 tools/compat.py 2.9.1 2.15.0         # those builds, then a summary table
    python3 tools/compat.py --all                # the eight builds of BUILDS (make compat-matrix)
    python3 tools/compat.py --ci                 # the oldest and the newest (make compat-ci)
    python3 tools/compat.py --venv .venv         # an existing environment: nothing installed
    python3 tools/compat.py --update --venv .venv    # record the goldens again (torch 2.13 only)
    python3 tools/compat.py --list               # the builds, commands and core tests

The exit status is 0 when every build passed, 1 when one failed (a pip step, torch replaced, a
command, a core test, a golden difference outside the allowlist), 2 on a usage error.
Logs (pip, each command's stdout and stderr, the tests' JUnit XML, the differences) are kept
under out/compat/<build>/.

Standard library only: it runs with the system's python3, before any environment exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = ROOT / "tests" / "golden" / "compat"
ALLOWLIST = GOLDEN_DIR / "allowlist.json"
GOLDEN_RELEASE = (2, 13)  # the goldens are recorded on this release (the repository's own)


@dataclasses.dataclass(frozen=True)
class Build:
    name: str
    requirement: str  # what pip installs first, alone
    cuda: bool  # a CUDA-built wheel (torch.version.cuda set) or the CPU one
    isolated: bool = False  # pip --isolated: no local config, so no local +cpu wheel either


BUILDS = {b.name: b for b in [
    Build("2.9.1", "torch==2.9.1", cuda=True),
    Build("2.10.0", "torch==2.10.0", cuda=True),
    Build("2.11.0", "torch==2.11.0", cuda=True),
    Build("2.12.1", "torch==2.12.1", cuda=True),
    # This machine's pip configuration finds the local 2.13.0+cpu wheel (the repository's own).
    Build("2.13.0-cpu", "torch==2.13.0", cuda=False),
    # --isolated ignores that configuration: the default (CUDA-built) wheel from the index.
    Build("2.13.0-cuda", "torch==2.13.0", cuda=True, isolated=True),
    Build("2.14.1", "torch==2.14.1", cuda=True),
    Build("2.15.0", "torch==2.15.0", cuda=True),
]}
CI_BUILDS = ["2.9.1", "2.15.0"]


@dataclasses.dataclass(frozen=True)
class Command:
    name: str  # the golden's file name, without .json
    argv: tuple[str, ...]  # after `ampscope`
    json: bool = True  # compare its --json output (False: its text output)

    @property
    def line(self) -> str:
        return "ampscope " + shlex.join(self.argv)

    def argv_with_json(self, path: Path) -> list[str]:
        """--json goes right after the subcommand: `run` passes what follows the script on."""
        if not self.json:
            return list(self.argv)
        return [self.argv[0], "--json", str(path), *self.argv[1:]]


COMMANDS = [
    Command("01-trace", ("trace",)),
    Command("02-trace-gpt2-tiny-real", ("trace", "gpt2-tiny", "--real", "--seq", "16")),
    Command("03-trace-gpt2-tiny-cuda-amp",
            ("trace", "gpt2-tiny", "-s", "cuda:fp32+amp-bf16", "--seq", "16")),
    Command("04-trace-nanochat-d4-diagram",
            ("trace", "nanochat-d4", "--setting", "fp32+amp-bf16", "--diagram")),
    Command("05-memory-llama-3-8b", ("memory", "llama-3-8b", "-d", "cuda", "-s", "bf16")),
    Command("06-fit-llama-3-8b", ("fit", "llama-3-8b", "--gpu", "h100", "-s", "bf16",
                                  "--seq", "4096")),
    Command("07-matrix-gpt2-tiny", ("matrix", "gpt2-tiny", "--seq", "16")),
    Command("08-run-gpt-train", ("run", "--device", "cuda", "--steps", "1",
                                 "examples/gpt/train.py", "--batch_size=4")),
    Command("09-policy", ("policy",)),
    Command("10-numerics-gpt2-tiny", ("numerics", "gpt2-tiny", "--seq", "16")),
]

# The example script command 08 runs (its data is made before the commands).
EXAMPLE_SCRIPT = ROOT / "examples" / "gpt" / "train.py"

CORE_TESTS = [f"tests/test_{name}.py" for name in [
    "capture", "predict", "fake_cache", "shortcuts", "virtual_device", "run_script",
    "emulation", "state", "memory", "flops"]]

# Seconds. The 2-core machine shared with other work is the measure.
TIMEOUT_VENV = 300
TIMEOUT_PIP = 1800
TIMEOUT_COMMAND = 600
TIMEOUT_TESTS = 2400


# ---------------------------------------------------------------------------------------------
# Normalising and comparing (tested by tests/test_compat_harness.py)

# Keys whose values depend on the run, not on the answer: timings, versions, paths, dates.
VOLATILE_KEYS = frozenset({
    "torch", "torch_version", "version", "python", "platform", "host", "hostname", "pid",
    "cwd", "path", "file", "date", "datetime", "timestamp", "created_at", "time", "elapsed",
    "duration", "seconds", "wall", "wall_s", "peak_rss", "rss",
})
VOLATILE_SUFFIXES = ("_seconds", "_ms", "_ns", "_time_s", "_elapsed", "_date", "_path")

_VERSION = re.compile(r"(?<![\w.])\d+\.\d+\.\d+(?:[+.][A-Za-z0-9]+)*(?![\w.])")
_NAMED_VERSION = re.compile(r"\b(PyTorch|torch|CUDA|cuDNN|ROCm|Python) \d+(?:\.\d+)*")
_ABS_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)+")
_DURATION = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|min|h)\b")
FLOAT_DIGITS = 6  # significant digits a golden keeps
REL_TOL = 1e-3  # floats closer than this (relative) are the same answer
ABS_TOL = 1e-9


def is_volatile(key: str) -> bool:
    k = key.lower()
    return k in VOLATILE_KEYS or k.endswith(VOLATILE_SUFFIXES)


def normalise_text(s: str, torch_version: str | None = None) -> str:
    """A string with this run's versions and absolute folders replaced by placeholders."""
    s = _ABS_PATH.sub("<dir>/", s)  # first: a folder's name may hold a version
    if torch_version:
        s = s.replace(torch_version, "<version>")
    s = _NAMED_VERSION.sub(lambda m: f"{m.group(1)} <version>", s)
    return _VERSION.sub("<version>", s)


def normalise(value: Any, torch_version: str | None = None) -> Any:
    """A command's JSON without what changes from run to run: volatile keys dropped (at any
    depth), versions and absolute folders in strings replaced, floats rounded to FLOAT_DIGITS
    significant digits. Lists keep their order."""
    if isinstance(value, dict):
        return {k: normalise(v, torch_version) for k, v in value.items() if not is_volatile(k)}
    if isinstance(value, list):
        return [normalise(v, torch_version) for v in value]
    if isinstance(value, str):
        return normalise_text(value, torch_version)
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{FLOAT_DIGITS}g}")
    return value


def normalise_output(text: str, torch_version: str | None = None) -> list[str]:
    """A command's printed output as lines, for a command without JSON: trailing spaces gone,
    versions, folders and durations replaced."""
    return [_DURATION.sub("<time>", normalise_text(line.rstrip(), torch_version))
            for line in text.splitlines()]


@dataclasses.dataclass(frozen=True)
class Difference:
    path: str  # golden/key/3:label/key: a list element is `index:label` (its op, name, …)
    kind: str  # changed | missing (in the golden, not now) | added (now, not in the golden)
    golden: Any = None
    actual: Any = None

    def __str__(self) -> str:
        def short(v: Any) -> str:
            s = json.dumps(v, sort_keys=True)
            return s if len(s) <= 100 else s[:97] + "..."
        if self.kind == "changed":
            return f"{self.path}: {short(self.golden)} -> {short(self.actual)}"
        if self.kind == "missing":
            return f"{self.path}: missing now (golden {short(self.golden)})"
        return f"{self.path}: added {short(self.actual)}"


LABEL_KEYS = ("op", "name", "func", "setting", "variant", "label", "category", "what", "kind",
              "text")


def element_label(i: int, element: Any) -> str:
    """A list element's path segment: its index and, for an object, what names it."""
    if isinstance(element, dict):
        for key in LABEL_KEYS:
            v = element.get(key)
            if isinstance(v, str) and v:
                return f"{i}:{v[:60]}"
    return str(i)


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        if math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)
    return type(a) is type(b) and a == b


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


# A numerics comparison (analysis/numerics.py: rel_l2, max_abs, sqnr_db of a run against its
# float64 reference) whose relative error both documents put at float32's rounding is noise:
# which float32 matmul kernel the CPU picks (its vector extensions, the BLAS build) changes it
# by tens of percent from one machine to the next, with no change in ampscope or torch.
ROUNDING_REL_L2 = 1e-6  # float32's epsilon is 1.2e-7: a few roundings
ROUNDING_KEYS = ("rel_l2", "max_abs", "sqnr_db")


def _rounding_noise(golden: dict, actual: dict) -> bool:
    """Both sides are error metrics at float32's rounding."""
    values = (golden.get("rel_l2"), actual.get("rel_l2"))
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < ROUNDING_REL_L2
               for v in values)


def compare(golden: Any, actual: Any, path: str = "") -> list[Difference]:
    """Every difference between two normalised documents. Lists are aligned first (difflib), so
    an op inserted by one release is one `added` element, not a shift of all that follow."""
    if isinstance(golden, dict) and isinstance(actual, dict):
        out: list[Difference] = []
        noise = _rounding_noise(golden, actual)
        for key in golden:
            if noise and key in ROUNDING_KEYS and key in actual:
                continue
            sub = f"{path}/{key}"
            if key not in actual:
                out.append(Difference(sub, "missing", golden=golden[key]))
            else:
                out += compare(golden[key], actual[key], sub)
        out += [Difference(f"{path}/{key}", "added", actual=actual[key])
                for key in actual if key not in golden]
        return out
    if isinstance(golden, list) and isinstance(actual, list):
        if len(golden) == len(actual):
            return [d for i, (g, a) in enumerate(zip(golden, actual, strict=True))
                    for d in compare(g, a, f"{path}/{element_label(i, g)}")]
        out = []
        matcher = difflib.SequenceMatcher(None, [_canon(g) for g in golden],
                                          [_canon(a) for a in actual], autojunk=False)
        for tag, g0, g1, a0, a1 in matcher.get_opcodes():
            if tag == "equal":
                continue
            n = min(g1 - g0, a1 - a0)
            for k in range(n):
                out += compare(golden[g0 + k], actual[a0 + k],
                               f"{path}/{element_label(g0 + k, golden[g0 + k])}")
            out += [Difference(f"{path}/{element_label(i, golden[i])}", "missing",
                               golden=golden[i]) for i in range(g0 + n, g1)]
            out += [Difference(f"{path}/{element_label(i, actual[i])}", "added",
                               actual=actual[i]) for i in range(a0 + n, a1)]
        return out
    if _same_leaf(golden, actual):
        return []
    return [Difference(path or "/", "changed", golden=golden, actual=actual)]


def release(version: str) -> tuple[int, ...]:
    """(2, 12, 1) from '2.12.1+cu128'; (2, 15) from '2.15'."""
    base = re.match(r"\d+(?:\.\d+)*", version.strip())
    if not base:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in base.group(0).split("."))


def in_range(version: str, spec: str) -> bool:
    """Whether a torch version lies in a range such as '>=2.9,<2.12' (comma: and). A bound
    compares as many parts as it gives: '<2.12' admits 2.11.9, not 2.12.0; '==2.12' admits
    every 2.12.x."""
    have = release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)", clause)
        if not m:
            raise ValueError(f"not a version bound: {clause!r} (in {spec!r})")
        op, bound = m.group(1), release(m.group(2))
        mine = have[:len(bound)] + (0,) * max(0, len(bound) - len(have))
        ok = {">=": mine >= bound, "<=": mine <= bound, ">": mine > bound, "<": mine < bound,
              "==": mine == bound, "!=": mine != bound}[op]
        if not ok:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class Allowed:
    torch: str  # a release range: '>=2.9,<2.12'
    path: str  # an fnmatch pattern on a difference's path: `*` crosses `/`
    reason: str
    wheel: str = "any"  # any | cpu | cuda: which builds of a release

    def applies(self, version: str, cuda: bool) -> bool:
        return (in_range(version, self.torch)
                and self.wheel in ("any", "cuda" if cuda else "cpu"))

    def covers(self, difference: Difference) -> bool:
        return fnmatch.fnmatchcase(difference.path, self.path)


def load_allowlist(path: Path = ALLOWLIST) -> list[Allowed]:
    entries = json.loads(path.read_text(encoding="utf-8"))["entries"]  # "about": the format
    out = []
    for e in entries:
        unknown = set(e) - {"torch", "path", "reason", "wheel"}
        if unknown or not e.get("reason") or e.get("wheel", "any") not in ("any", "cpu", "cuda"):
            raise ValueError(f"{path}: bad allowlist entry {e} (each entry: torch, path, reason;"
                             " wheel optional: any, cpu or cuda)")
        in_range("0", e["torch"])  # a bad range fails here, before any build
        out.append(Allowed(**e))
    return out


def split_allowed(differences: list[Difference], allowlist: list[Allowed], version: str,
                  cuda: bool) -> tuple[list[Difference], list[tuple[Difference, Allowed]]]:
    """(not allowed, allowed with the entry that allows each) for this torch build."""
    active = [a for a in allowlist if a.applies(version, cuda)]
    bad, allowed = [], []
    for d in differences:
        entry = next((a for a in active if a.covers(d)), None)
        if entry is None:
            bad.append(d)
        else:
            allowed.append((d, entry))
    return bad, allowed


def dump_golden(doc: Any) -> str:
    """A golden as text: indented objects, one line per list element of scalars or objects at
    depth two and below, so that a diff of two goldens reads line by line and stays small."""
    def enc(v: Any, depth: int) -> str:
        if depth >= 3 or not isinstance(v, (dict, list)) or not v:
            return json.dumps(v, ensure_ascii=False, sort_keys=False)
        pad, inner = " " * depth, " " * (depth + 1)
        if isinstance(v, dict):
            items = [f"{inner}{json.dumps(k)}: {enc(x, depth + 1)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        items = [f"{inner}{enc(x, depth + 1)}" for x in v]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return enc(doc, 0) + "\n"


# ---------------------------------------------------------------------------------------------
# Running one build

START = time.monotonic()


def clock(since: float) -> str:
    s = int(time.monotonic() - since)
    return f"{s // 60}m{s % 60:02d}s"


class Log:
    def __init__(self, build: str, since: float):
        self.build, self.since = build, since

    def __call__(self, message: str) -> None:
        print(f"[{self.build} {clock(self.since)} | total {clock(START)}] {message}", flush=True)


@dataclasses.dataclass
class Proc:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False


def run(argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
        cwd: Path | None = None, log_to: Path | None = None) -> Proc:
    """A process in a session of its own, so that a timeout ends it and its children (pytest's
    workers) together. Its output goes to log_to (when given) as well."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\ntimed out after {timeout:.0f} s"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    rc = proc.returncode if not timed_out else 124
    if log_to is not None:
        log_to.parent.mkdir(parents=True, exist_ok=True)
        log_to.write_text(f"$ {shlex.join(argv)}\n# rc={rc} {time.monotonic() - t0:.1f}s\n"
                          f"--- stdout\n{out}\n--- stderr\n{err}\n", encoding="utf-8")
    return Proc(rc, out, err, time.monotonic() - t0, timed_out)


def first_error_line(p: Proc) -> str:
    """The line that says what went wrong: a traceback's last line, else the first line that
    names an error, else the last line printed."""
    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
    if p.timed_out:
        return lines[-1] if lines else "timed out"
    if any(ln.startswith("Traceback") for ln in lines):
        tail = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception|Exit|Interrupt)\b", ln)]
        return (tail or lines)[-1][:200]
    named = [ln for ln in lines if re.search(r"error|exception|failed", ln, re.I)]
    if named:
        return named[0][:200]
    rest = lines or [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
    return rest[-1][:200] if rest else f"exit status {p.rc}, nothing printed"


@dataclasses.dataclass
class CommandResult:
    name: str
    line: str
    rc: int
    seconds: float
    error: str = ""


@dataclasses.dataclass
class Result:
    build: str
    pip: str = "not run"  # ok, or what failed
    pip_ok: bool = False
    torch_before: str = ""
    torch_after: str = ""
    commands: list[CommandResult] = dataclasses.field(default_factory=list)
    tests: dict[str, int] | None = None  # passed, failed, skipped, errors
    failed_tests: list[str] = dataclasses.field(default_factory=list)
    tests_note: str = ""
    tests_wanted: bool = True  # False: --no-tests or --update, so none are counted
    differences: list[str] = dataclasses.field(default_factory=list)  # not allowed
    allowed: int = 0
    golden_missing: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    harness_error: str = ""

    @property
    def commands_ok(self) -> int:
        return sum(c.rc == 0 and not c.error for c in self.commands)

    @property
    def passed(self) -> bool:
        return (self.pip_ok and not self.harness_error
                and self.commands_ok == len(COMMANDS)
                and (not self.tests_wanted or (
                    self.tests is not None
                    and self.tests["failed"] == 0 and self.tests["errors"] == 0
                    and self.tests["passed"] > 0))
                and not self.differences and not self.golden_missing)

    def summary(self) -> str:
        t = self.tests
        tests = (f"{t['passed']}/{t['failed'] + t['errors']}/{t['skipped']}"
                 if t else f"not run{': ' + self.tests_note if self.tests_note else ''}")
        golden = f"{len(self.differences)}"
        if self.golden_missing:
            golden += f" (+{len(self.golden_missing)} without golden)"
        if self.allowed:
            golden += f" ({self.allowed} allowed)"
        verdict = "PASS" if self.passed else "FAIL"
        extra = f" | harness: {self.harness_error}" if self.harness_error else ""
        return (f"{self.build}: {verdict} | pip {self.pip} | commands "
                f"{self.commands_ok}/{len(COMMANDS)} | core tests passed/failed/skipped {tests}"
                f" | golden diffs {golden} | {_mmss(self.seconds)}{extra}")


def _mmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s"


def torch_identity(python: Path, env: dict[str, str]) -> str:
    """'2.9.1+cu128 cuda=12.8' for the torch this interpreter imports ('' when none)."""
    p = run([str(python), "-c", "import torch; print(torch.__version__, 'cuda=%s' % "
             "torch.version.cuda)"], timeout=300, env=env)
    return p.stdout.strip() if p.rc == 0 else ""


def pip_list_line(python: Path, env: dict[str, str]) -> str:
    """torch's line of `pip list`."""
    p = run([str(python), "-m", "pip", "list", "--disable-pip-version-check"], timeout=300,
            env=env)
    return next((" ".join(ln.split()) for ln in p.stdout.splitlines()
                 if ln.split()[:1] == ["torch"]), "torch: not installed")


def copy_checkout(dest: Path) -> Path:
    """The working tree as it is (tracked and untracked files git does not ignore), so that
    pip's build writes nothing into the checkout."""
    git = shutil.which("git")
    files: list[str] = []
    if git and (ROOT / ".git").exists():
        p = subprocess.run([git, "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=False)
        if p.returncode == 0:
            files = [f for f in p.stdout.decode().split("\0") if f]
    if files:
        for f in files:
            src = ROOT / f
            if src.is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f)
    else:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "build", "*.egg-info", "out"), dirs_exist_ok=True)
    return dest


def command_env(base: dict[str, str], venv: Path) -> dict[str, str]:
    env = dict(base)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "100"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def read_junit(path: Path) -> tuple[dict[str, int], list[str]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failed = []
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in kinds:
            counts["failed"] += 1
            failed.append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            failed.append(name + " (error)")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failed


def golden_path(command: Command) -> Path:
    return GOLDEN_DIR / f"{command.name}.json"


def document(command: Command, json_file: Path, stdout: str, torch_version: str) -> Any:
    if command.json:
        return normalise(json.loads(json_file.read_text(encoding="utf-8")), torch_version)
    return normalise_output(stdout, torch_version)


def check_environment(result: Result, venv: Path, env: dict[str, str], build: Build | None,
                      work: Path, logs: Path, log: Log, *, update: bool, tests: bool,
                      allowlist: list[Allowed]) -> None:
    """The ten commands, the core tests and the golden comparison in a ready environment."""
    python = venv / "bin" / "python"
    ampscope = venv / "bin" / "ampscope"
    cenv = command_env(env, venv)
    ident = torch_identity(python, cenv)
    version = ident.split()[0] if ident else ""
    cuda = "cuda=None" not in ident
    if update and (not version or release(version)[:2] != GOLDEN_RELEASE):
        raise SystemExit(f"--update records the goldens on torch {GOLDEN_RELEASE[0]}."
                         f"{GOLDEN_RELEASE[1]}; this environment has {ident or 'no torch'}")
    outputs = work / "json"
    outputs.mkdir(parents=True, exist_ok=True)
    # The example training script writes its token file on its first run, and `ampscope run`
    # lists the files a script created: make it first, with plain Python, so that every build's
    # run of the script is a later one whatever ran before (a fresh checkout has none).
    run([str(python), str(EXAMPLE_SCRIPT), "--max_iters=0"], timeout=TIMEOUT_COMMAND, env=cenv,
        cwd=ROOT, log_to=logs / "commands" / "00-example-data.log")
    for i, command in enumerate(COMMANDS, 1):
        log(f"command {i}/{len(COMMANDS)}: {command.line}")
        target = outputs / f"{command.name}.json"
        p = run([str(ampscope), *command.argv_with_json(target)], timeout=TIMEOUT_COMMAND,
                env=cenv, cwd=ROOT, log_to=logs / "commands" / f"{command.name}.log")
        res = CommandResult(command.name, command.line, p.rc, p.seconds)
        if p.rc != 0:
            res.error = first_error_line(p)
        elif command.json and not target.exists():
            res.error = "exit status 0 but no JSON written"
        result.commands.append(res)
        log(f"  rc={p.rc} {p.seconds:.1f}s" + (f": {res.error}" if res.error else ""))
        if res.error:
            continue
        try:
            doc = document(command, target, p.stdout, version)
        except (OSError, ValueError) as e:
            res.error = f"unreadable JSON: {e}"
            continue
        gpath = golden_path(command)
        if update:
            gpath.parent.mkdir(parents=True, exist_ok=True)
            gpath.write_text(dump_golden({"command": command.line, "recorded_on_torch": ident,
                                          "output": doc}), encoding="utf-8")
            log(f"  golden written: {gpath.relative_to(ROOT)}")
            continue
        if not gpath.exists():
            result.golden_missing.append(command.name)
            log(f"  no golden {gpath.relative_to(ROOT)} (record them with --update)")
            continue
        golden = json.loads(gpath.read_text(encoding="utf-8"))["output"]
        diffs = compare(golden, doc, command.name)
        bad, allowed = split_allowed(diffs, allowlist, version, cuda)
        result.differences += [str(d) for d in bad]
        result.allowed += len(allowed)
        if diffs:
            log(f"  golden: {len(bad)} differences, {len(allowed)} allowed")
        with (logs / "golden-differences.txt").open("a", encoding="utf-8") as f:
            f.writelines(f"NOT ALLOWED {d}\n" for d in bad)
            f.writelines(f"allowed ({a.reason}) {d}\n" for d, a in allowed)
    if update or not tests:
        result.tests_note = "skipped (--update)" if update else "skipped (--no-tests)"
        result.tests_wanted = False
        return
    log(f"core tests: pytest {len(CORE_TESTS)} files")
    junit = work / "junit.xml"
    p = run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
             f"--junitxml={junit}", *CORE_TESTS], timeout=TIMEOUT_TESTS, env=cenv, cwd=ROOT,
            log_to=logs / "core-tests.log")
    if junit.exists():
        result.tests, result.failed_tests = read_junit(junit)
        shutil.copy2(junit, logs / "junit.xml")
    else:
        result.tests_note = first_error_line(p)
    t = result.tests
    log(f"  pytest rc={p.rc} in {p.seconds:.0f}s: "
        + (f"passed/failed/skipped {t['passed']}/{t['failed'] + t['errors']}/{t['skipped']}"
           if t else result.tests_note))


def check_build(build: Build, venv_root: Path, out: Path, allowlist: list[Allowed], *,
                tests: bool = True, update: bool = False) -> Result:
    since = time.monotonic()
    log = Log(build.name, since)
    result = Result(build.name)
    logs = out / build.name
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    venv_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"tmp-compat-{build.name}-", dir=venv_root))
    try:
        venv = tmp / "venv"
        log(f"creating {venv}")
        p = run([sys.executable, "-m", "venv", str(venv)], timeout=TIMEOUT_VENV,
                log_to=logs / "venv.log")
        if p.rc != 0:
            result.pip = "venv failed"
            result.harness_error = first_error_line(p)
            return result
        no_constraints = tmp / "no-constraints.txt"
        no_constraints.write_text("")
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env["PIP_CONSTRAINT"] = str(no_constraints)  # the machine's cap on torch, lifted
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip"] + (["--isolated"] if build.isolated else [])
        log(f"pip install --no-cache-dir {build.requirement}"
            + (" (--isolated)" if build.isolated else ""))
        p = run([*pip, "install", "--no-cache-dir", "--progress-bar", "off", build.requirement],
                timeout=TIMEOUT_PIP, env=env, log_to=logs / "pip-torch.log")
        if p.rc != 0:
            result.pip = "torch install failed"
            log(f"  {result.pip}: {first_error_line(p)}")
            return result
        ident_before = torch_identity(python, env)
        result.torch_before = pip_list_line(python, env)
        log(f"  installed in {p.seconds:.0f}s: {ident_before}")
        if ("cuda=None" in ident_before) == build.cuda:
            result.pip = (f"wrong wheel ({ident_before}, wanted a "
                          f"{'CUDA' if build.cuda else 'CPU'} build)")
            return result
        log("copying the checkout")
        src = copy_checkout(tmp / "ampscope")
        log('pip install "<checkout>[hf,dev]"')
        p = run([str(python), "-m", "pip", "install", "--progress-bar", "off",
                 f"{src}[hf,dev]"], timeout=TIMEOUT_PIP, env=env,
                log_to=logs / "pip-ampscope.log")
        ident_after = torch_identity(python, env)
        result.torch_after = pip_list_line(python, env)
        print(f"    before: {result.torch_before}  ({ident_before})\n"
              f"    after:  {result.torch_after}  ({ident_after})", flush=True)
        if p.rc != 0:
            result.pip = "ampscope install failed"
            log(f"  {result.pip}: {first_error_line(p)}")
            return result
        if ident_after != ident_before or result.torch_after != result.torch_before:
            result.pip = f"TORCH REPLACED ({result.torch_before} -> {result.torch_after})"
            log(f"  {result.pip}")
            return result
        result.pip, result.pip_ok = "ok", True
        log(f"  installed in {p.seconds:.0f}s; torch kept")
        check_environment(result, venv, env, build, tmp, logs, log, update=update, tests=tests,
                          allowlist=allowlist)
        return result
    except Exception as e:  # noqa: BLE001 - the harness's own failure: reported, the next build still runs
        result.harness_error = f"{type(e).__name__}: {e}"
        log(f"harness error: {result.harness_error}")
        return result
    finally:
        log(f"deleting {tmp}")
        shutil.rmtree(tmp, ignore_errors=True)
        result.seconds = time.monotonic() - since


def sweep(venv_root: Path, older_than: float = 6 * 3600) -> None:
    """Environments a killed run left behind (SIGKILL leaves no time to delete them): those
    older than older_than seconds, so that a run going on beside this one keeps its own."""
    if not venv_root.is_dir():
        return
    for old in venv_root.glob("tmp-compat-*"):
        try:
            stale = time.time() - old.stat().st_mtime > older_than
        except OSError:
            continue
        if stale and old.is_dir():
            print(f"deleting {old}, left by an earlier run", flush=True)
            shutil.rmtree(old, ignore_errors=True)


def check_existing(venv: Path, out: Path, allowlist: list[Allowed], *, tests: bool,
                   update: bool) -> Result:
    """An environment that is there already (`--venv`): nothing installed, nothing deleted."""
    since = time.monotonic()
    name = f"venv:{venv.name}"
    log = Log(name, since)
    result = Result(name, pip="existing", pip_ok=True)
    logs = out / venv.name
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    env = dict(os.environ)
    result.torch_before = result.torch_after = pip_list_line(venv / "bin" / "python", env)
    log(f"existing environment {venv} ({result.torch_before})")
    with tempfile.TemporaryDirectory(prefix="tmp-compat-") as tmp:
        check_environment(result, venv, env, None, Path(tmp), logs, log, update=update,
                          tests=tests, allowlist=allowlist)
    result.seconds = time.monotonic() - since
    return result


# ---------------------------------------------------------------------------------------------
# Reporting


def table(results: list[Result]) -> str:
    rows = [("build", "pip outcome", "commands", "core tests passed/failed/skipped",
             "golden diffs", "time", "verdict")]
    for r in results:
        t = r.tests
        rows.append((
            r.build, r.pip + (f"; {r.harness_error}" if r.harness_error else ""),
            f"{r.commands_ok}/{len(COMMANDS)}" if r.commands else "-",
            f"{t['passed']}/{t['failed'] + t['errors']}/{t['skipped']}" if t else "-",
            (f"{len(r.differences)}" + (f" ({r.allowed} allowed)" if r.allowed else "")
             + (f" (+{len(r.golden_missing)} no golden)" if r.golden_missing else ""))
            if r.commands else "-",
            _mmss(r.seconds), "PASS" if r.passed else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def details(r: Result, limit: int = 15) -> list[str]:
    out = []
    for c in r.commands:
        if c.error:
            out.append(f"  command failed: {c.line}: rc={c.rc}: {c.error}")
    for name in r.failed_tests[:limit]:
        out.append(f"  test failed: {name}")
    if len(r.failed_tests) > limit:
        out.append(f"  … {len(r.failed_tests) - limit} more failed tests")
    for d in r.differences[:limit]:
        out.append(f"  golden: {d}")
    if len(r.differences) > limit:
        out.append(f"  … {len(r.differences) - limit} more golden differences "
                   f"(out/compat/{r.build}/golden-differences.txt)")
    for name in r.golden_missing:
        out.append(f"  no golden for {name}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tools/compat.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="*", metavar="BUILD", help=f"of: {', '.join(BUILDS)}")
    ap.add_argument("--all", action="store_true", help="every build of BUILDS")
    ap.add_argument("--ci", action="store_true", help=f"the CI's builds: {', '.join(CI_BUILDS)}")
    ap.add_argument("--venv", type=Path, help="check this existing environment instead "
                    "(nothing installed or deleted)")
    ap.add_argument("--update", action="store_true",
                    help="write the goldens from this run (torch 2.13 only; no tests)")
    ap.add_argument("--no-tests", action="store_true", help="skip the core tests")
    ap.add_argument("--venv-root", type=Path,
                    default=Path(os.environ.get("COMPAT_VENV_ROOT") or tempfile.gettempdir()),
                    help="where the temporary environments go (default: $COMPAT_VENV_ROOT or "
                         "the system's temporary folder); each is deleted after its build")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "compat",
                    help="where the logs go (default: out/compat)")
    ap.add_argument("--json-report", type=Path, help="write the results as JSON here too")
    ap.add_argument("--list", action="store_true", help="print the builds, commands, core tests")
    args = ap.parse_args(argv)

    if args.list:
        for b in BUILDS.values():
            print(f"build {b.name}: pip install {'--isolated ' if b.isolated else ''}"
                  f"{b.requirement} ({'CUDA' if b.cuda else 'CPU'} wheel)")
        for c in COMMANDS:
            print(f"command {c.name}: {c.line}")
        print("core tests:", " ".join(CORE_TESTS))
        return 0
    names = list(BUILDS) if args.all else CI_BUILDS if args.ci else args.builds
    unknown = [n for n in names if n not in BUILDS]
    if unknown:
        ap.error(f"unknown build {', '.join(unknown)}; known: {', '.join(BUILDS)}")
    if bool(names) == bool(args.venv):
        ap.error("give builds (or --all / --ci) or --venv, not both")
    if args.update and len(names) > 1:
        ap.error("--update takes one environment: --venv PATH or the build 2.13.0-cpu")
    allowlist = load_allowlist()

    def stop(signum, frame):  # CI's timeout or ^C: unwind, so that the environments go
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)

    if names:
        sweep(args.venv_root)
    results: list[Result] = []
    try:
        if args.venv:
            results.append(check_existing(args.venv.resolve(), args.out, allowlist,
                                          tests=not (args.no_tests or args.update),
                                          update=args.update))
        for n in names:
            allowlist = load_allowlist()  # read again: an entry added meanwhile counts
            r = check_build(BUILDS[n], args.venv_root.resolve(), args.out, allowlist,
                            tests=not args.no_tests, update=args.update)
            results.append(r)
            print(r.summary(), flush=True)
            for line in details(r):
                print(line, flush=True)
    except KeyboardInterrupt as e:
        print(f"stopped ({e}); environments deleted", flush=True)
        return 1
    if args.json_report:
        args.json_report.parent.mkdir(parents=True, exist_ok=True)
        args.json_report.write_text(json.dumps(
            [dataclasses.asdict(r) | {"passed": r.passed} for r in results], indent=1))
    if args.update:
        r = results[0]
        ok = r.commands_ok == len(COMMANDS)
        print(f"goldens {'written' if ok else 'NOT all written'} to "
              f"{GOLDEN_DIR.relative_to(ROOT)} ({r.commands_ok}/{len(COMMANDS)} commands)")
        for line in details(r):
            print(line)
        return 0 if ok else 1
    if args.venv:
        print(results[0].summary())
        for line in details(results[0]):
            print(line)
    print(f"\ncompatibility, {len(results)} build(s), {clock(START)} in all:\n{table(results)}",
          flush=True)
    failed = [r.build for r in results if not r.passed]
    print(f"compat: {len(results) - len(failed)} of {len(results)} builds passing"
          + (f"; failing: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
