"""What every command shares: the console, progress bars, one-line errors, the end (exports
and the rendering), and the run options every model-running command takes."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ampscope.cli.exports import write_exports
from ampscope.errors import AmpscopeError
from ampscope.render.report_kinds import kind_of

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A whole line of any real error is kept; only a runaway one (a tensor's repr, a dump) is cut.
MAX_MESSAGE = 1000


def one_line(message: str) -> str:
    """The first line of a message, without terminal colour codes, cut to a readable length."""
    lines = _ANSI.sub("", message).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _progress():
    """A transient progress bar on stderr, drawn only on a terminal (logs and pipes get none)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = _console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


# A run shorter than this shows its spinner only; a longer one shows its ops and phase.
PROGRESS_AFTER_S = 2.0


@contextlib.contextmanager
def _run_progress(description: str, *, after: float | None = None, console=None
                  ) -> Iterator[None]:
    """While the body runs a model: a spinner with `description` on stderr, and once the run
    has gone on for `after` seconds, a bar with the ops recorded so far and the phase, as the
    op recorder reports them. Only on a terminal: logs and pipes get nothing."""
    import time

    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

    from ampscope.runs.progress import reporting

    after = PROGRESS_AFTER_S if after is None else after
    console = console or _console(stderr=True)
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   TextColumn("{task.fields[done]}"), console=console, transient=True,
                   disable=not console.is_terminal)
    task = bar.add_task(description, total=None, done="")
    start = time.monotonic()

    def on_ops(ops: int, phase: str) -> None:
        if time.monotonic() - start >= after:
            bar.update(task, done=f"{ops:,} ops · {phase}")

    with bar, reporting(on_ops):
        yield


def _show(args: argparse.Namespace, render: Callable[[], object], **parts: Any) -> int:
    """The end of every command: the exports asked for, each from its part (cli/exports.py:
    `json=`, `csv=`, `perfetto=`, `report=`), then the rendering for a person, unless an export
    went to stdout ('-': that document only)."""
    if not write_exports(args, **parts):
        _console().print(render())
    return 0


def show_report(args: argparse.Namespace, report: Any, **view_options: Any) -> int:
    """The end of a registered report's command (render/report_kinds.py): its JSON, its table as
    CSV where it has one, and its view (given `view_options`)."""
    kind = kind_of(report)
    return _show(args, lambda: kind.load("view")(report, **view_options), json=report.to_dict,
                 csv=report.table if kind.table else None)


def _run_options(args: argparse.Namespace):
    """The run options of a command line, checked before anything is built."""
    from ampscope.workloads import RunOptions  # imports torch: only once a command runs

    return RunOptions(workload=args.workload, batch=args.batch, seq=args.seq,
                      optimizer=args.optimizer, new_tokens=args.new_tokens, predict=args.predict,
                      checkpoint=args.checkpoint, optimizer_impl=args.optimizer_impl,
                      exact=args.exact)


def _on_device(settings: list[str], device: str | None) -> list[str]:
    from ampscope.precision import on_device

    return [on_device(s, device) for s in settings] if device else settings


def check_regular(path: str) -> None:
    if not Path(path).is_file():  # a folder, a FIFO (which would block), a missing file
        raise AmpscopeError(f"cannot read {path}: not a regular file; give a trace written "
                            "with `ampscope trace MODEL --json FILE`")


def load_trace(path: str):
    """The trace a JSON file written with `--json` holds; one clear line for anything else."""
    from ampscope.records import Trace

    check_regular(path)
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        return Trace.from_dict(data)
    except OSError as e:
        raise AmpscopeError(f"cannot read {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise AmpscopeError(f"{path} is not a text file; give a trace written with "
                            "`ampscope trace MODEL --json FILE`") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AmpscopeError(f"{path} is not an ampscope trace (write one with "
                            f"`ampscope trace MODEL --json FILE`): {e}") from e
