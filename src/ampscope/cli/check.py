"""`ampscope check`: run a script (or read a saved trace) and say what is wrong with its
precision, as a linter does; the exit status says whether anything failed the check."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

from ampscope.cli.common import _show, load_trace
from ampscope.cli.exports import add_exports
from ampscope.defaults import MAX_FORWARDS
from ampscope.errors import AmpscopeError
from ampscope.hardware.device_types import DEVICE_TYPES

SCHEMA = "ampscope.check/1"
# The exit status when a diagnostic fails the check (errors; warnings too with --strict).
# ampscope's own failures keep theirs (2: bad input or a run that failed).
FAILED = 1


def add_check_parser(sub) -> argparse.ArgumentParser:
    check = sub.add_parser(
        "check", help="run your script (or read a saved trace) and name the precision "
                      "mistakes in it: id, severity, evidence and fix",
        description="Run a training script as `ampscope run` does (or read a trace written "
                    "with --json) and\nreport what the checks find. Exits 1 when an error is "
                    "found (with --strict: a warning too).")
    check.add_argument("--device", "-d", choices=list(DEVICE_TYPES),
                       help="the device the script should see; one this machine lacks is "
                            "virtual (default: this machine's)")
    check.add_argument("--steps", type=int, default=1,
                       help="stop after this many optimizer steps (default: %(default)s)")
    check.add_argument("--max-forwards", type=int, default=MAX_FORWARDS, metavar="N",
                       help="stop a script that runs N forward passes without an optimizer "
                            "step (default: %(default)s)")
    check.add_argument("--predict", action="store_true",
                       help="run on fake tensors: any size, no memory (value checks need a "
                            "real run)")
    check.add_argument("--values", action="store_true",
                       help="also check what the values say (inf/NaN, activations near the "
                            "format's limit, 16-bit updates that round away; not with "
                            "--predict)")
    check.add_argument("-m", dest="module", action="store_true",
                       help="TARGET is a module name, run as `python -m TARGET`")
    check.add_argument("--ignore", action="append", default=[], metavar="ID[,ID]",
                       help="leave out these checks (ids or names, e.g. AMP701 or "
                            "fp32-matmuls-without-tf32); may be repeated")
    check.add_argument("--strict", action="store_true",
                       help="warnings fail the check too (exit 1)")
    check.add_argument("--list", action="store_true", help="list every check and exit")
    check.add_argument("--quiet", "-q", action="store_true", help="hide the script's own output")
    add_exports(check, "json")
    check.add_argument("target", metavar="TARGET", nargs="?",
                       help="the script (with -m, the module), or a trace written with --json")
    check.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                       help="the script's own arguments ('--' first if they could be read as "
                            "ampscope's)")
    return check


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
