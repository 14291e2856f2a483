"""`ampscope check`: run a script (or read a saved trace) and say what is wrong with its
precision, as a linter does; the exit status says whether anything failed the check."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

from ampscope.cli.common import _show, load_trace
from ampscope.errors import AmpscopeError

SCHEMA = "ampscope.check/1"
# The exit status when a diagnostic fails the check (errors; warnings too with --strict).
# ampscope's own failures keep theirs (2: bad input or a run that failed).
FAILED = 1


def cmd_check(args: argparse.Namespace) -> int:
    from ampscope.analysis.checks import RULES, check_trace, unknown_ids
    from ampscope.render.diagnostics import diagnostics_text

    if args.list:
        for r in sorted(RULES.values(), key=lambda r: r.id):
            print(f"{r.id}  {r.severity:<7}  {r.name}: {r.summary}")
        return 0
    if args.target is None:
        raise AmpscopeError("give the script to check (or a trace written with --json), or "
                            "--list")
    ignore = [n.strip() for given in args.ignore for n in given.split(",") if n.strip()]
    unknown = unknown_ids(ignore)
    if unknown:
        raise AmpscopeError(f"no check {unknown[0]!r}: `ampscope check --list` lists them")
    if args.values and args.predict:
        raise AmpscopeError("--values needs a real run: give --values or --predict, not both")
    args.model = args.target  # named in one-line errors
    trace = _trace(args)
    if Path(args.target).suffix == ".json":  # a saved trace: judged by today's checks
        trace.diagnostics = check_trace(trace)
    found = [d for d in trace.diagnostics if d.id not in ignore and d.name not in ignore]
    failing = ("error", "warning") if args.strict else ("error",)

    def document() -> dict:
        return {"schema": SCHEMA, "target": args.target, "device": trace.setting.device,
                "mode": trace.mode, "diagnostics": [d.to_dict() for d in found],
                "failed": any(d.severity in failing for d in found)}

    _show(args, lambda: diagnostics_text(found, trace.setting.device), json=document)
    return FAILED if any(d.severity in failing for d in found) else 0


def _trace(args: argparse.Namespace):
    """The trace to check: the script run (as `ampscope run` does), or the saved trace."""
    if Path(args.target).suffix == ".json" and not args.module:
        if args.script_args:
            raise AmpscopeError(f"{' '.join(args.script_args)!r} follows the trace {args.target}:"
                                " give ampscope's options before it")
        return load_trace(args.target)
    from ampscope.script import run_script

    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    quiet = contextlib.redirect_stdout(io.StringIO()) if args.quiet else contextlib.nullcontext()
    with quiet:
        return run_script(args.target, script_args, module=args.module, device=args.device,
                          steps=args.steps, predict=args.predict, max_forwards=args.max_forwards,
                          in_process=True, values=args.values)
