"""`ampscope` command line: the entry points (`main`, and `run` for the console script).

- `parser.py`: the arguments, a function per command; `checks.py`: what is refused before
  anything runs; `examples.py`: the examples every `--help` ends with;
- `commands.py`, `train.py`, `fit.py`, `check.py`: one function per command (call the library,
  render);
- `common.py`: what the commands share (console, progress, one-line errors, the end of each);
  `exports.py`: `--json`, `--csv`, `--perfetto`, `--report`, each registered once;
- `hardware.py`: `--gpu`, `--peak-flops`, `--memory`; `version.py`: `--version -v`;
- `startup.py`: a command's imports with the garbage collector paused.

No analysis lives here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TextIO

from ampscope.cli import commands, exports, startup
from ampscope.cli.checks import check_flags, check_outputs
from ampscope.cli.common import one_line
from ampscope.cli.hardware import resolve_hardware
from ampscope.cli.parser import (
    _GLOBAL_FLAGS,
    _parser,
    _UsageError,
    _values_after_dashes,
    default_setting,
)
from ampscope.defaults import DEFAULT_MODEL, DEFAULT_SETTING
from ampscope.errors import AmpscopeError, DtypeMismatchError
from ampscope.tricks import exact_path

# Nothing imported here imports torch: `--help`, `--version` and argument errors answer at once;
# the commands (cli/commands.py) import the library inside each function.
__all__ = ["DEFAULT_MODEL", "DEFAULT_SETTING", "default_setting", "main", "one_line", "run",
           "_parser", "_values_after_dashes"]


@contextlib.contextmanager
def _verbose(on: bool):
    """With -v, the "ampscope" logger's INFO records go to stderr while the command runs."""
    if not on:
        yield
        return
    logger = logging.getLogger("ampscope")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ampscope: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def _stdout_kept_for_the_document() -> Iterator[TextIO]:
    """The stream `--json -` writes to, kept for the document alone while the command runs.

    User code's prints are redirected to stderr in Python; a subprocess the script starts
    writes to file descriptor 1 directly. So while the command runs, descriptor 1 is pointed at
    stderr too, and the document is written to a duplicate of the real stdout. Where
    `sys.stdout` is not descriptor 1 (a caller that captured it), it is used as it is."""
    try:
        real = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):
        real = False
    if not real:
        yield sys.stdout
        return
    sys.stdout.flush()
    kept = os.dup(1)
    stream = open(kept, "w", encoding=sys.stdout.encoding or "utf-8", closefd=False)  # noqa: SIM115
    os.dup2(2, 1)
    try:
        yield stream
    finally:
        stream.flush()
        sys.stdout.flush()
        os.dup2(kept, 1)
        os.close(kept)


def run() -> None:
    """The console script: `main`, then exit without the interpreter's teardown.

    After a large trace, freeing its hundreds of thousands of records one by one takes about a
    second and serves nothing: output is flushed here and files were closed where written.
    """
    code = main(freeze_imports=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None, *, freeze_imports: bool = False) -> int:
    """Run one command; its exit code. `freeze_imports` (the console script, which owns its
    process) keeps the collector from walking the command's imports again (cli/startup.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not [a for a in argv if a not in _GLOBAL_FLAGS]:
        argv.append("trace")  # bare `ampscope` traces the built-in default model
    if "--version" in argv and ("-v" in argv or "--verbose" in argv):
        from ampscope.cli.version import print_environment

        print_environment()
        return 0
    argv = _values_after_dashes(argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            args = parser.parse_args([*argv, "trace"])
    except _UsageError as e:
        print(f"ampscope: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    try:
        if args.command in ("trace", "memory", "flops") and args.setting is None:
            args.setting = default_setting(args.model)
        check_flags(argv, args)
        check_outputs(args)
        resolve_hardware(args)
        startup.preload(args, freeze=freeze_imports)
        command = getattr(commands, f"cmd_{args.command}", commands.registered_command)
        with _verbose(args.verbose), exact_path(getattr(args, "exact", False)):
            if not exports.to_stdout(args):
                return command(args)
            # JSON (or CSV) alone on stdout: whatever user code prints goes to stderr.
            with _stdout_kept_for_the_document() as stream:
                exports.json_stream = stream
                try:
                    with contextlib.redirect_stdout(sys.stderr):
                        return command(args)
                finally:
                    exports.json_stream = None
    except DtypeMismatchError as e:
        if args.debug:
            raise
        # The diagnosis is the answer here: its lines follow the one-line error.
        print(f"ampscope: error while tracing {args.model}: {one_line(str(e))}", file=sys.stderr)
        for line in e.diagnosis.lines:
            print(f"  {line}", file=sys.stderr)
        return _status(e)
    except AmpscopeError as e:
        if args.debug:
            raise
        print(f"ampscope: error: {one_line(str(e))}", file=sys.stderr)
        return _status(e)
    except KeyboardInterrupt:
        print("ampscope: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the model (or ampscope) raised: one line unless --debug
        if args.debug:
            raise
        where = f" while tracing {args.model}" if getattr(args, "model", None) else ""
        from ampscope.runtime.user_frames import user_line  # torch is loaded by now

        line = user_line(e)  # the model's line that raised
        at = f" at {line}" if line else ""
        print(f"ampscope: error{where}: {type(e).__name__}{at}: {one_line(str(e))} "
              "(run with --debug for the traceback)", file=sys.stderr)
        return 2


def _status(error: BaseException) -> int:
    """The exit status for `error`: the status of the script whose run it ended (`ampscope
    run`: the script's own `sys.exit(n)`, `os._exit(n)` or 1 for its uncaught exception, as
    under `python`), else 2, ampscope's own failure. A command that ran no script has not
    loaded the module that keeps those statuses (nor torch, which it would import)."""
    ending = sys.modules.get("ampscope.script.ending")  # loaded by every script run
    return ending.run_status(error) if ending is not None else 2


if __name__ == "__main__":
    sys.exit(main())
