"""Checks of a parsed command line made before anything runs: flags that do not go together,
sizes out of range, output paths that cannot be written."""

from __future__ import annotations

import argparse
import math

from ampscope.cli.exports import given
from ampscope.errors import AmpscopeError
from ampscope.files import unwritable, unwritable_folder


def check_flags(argv: list[str], args: argparse.Namespace) -> None:
    """Flags argparse accepts together but that contradict each other or mean nothing."""
    if "--predict" in argv and ("--no-predict" in argv or "--real" in argv):
        raise AmpscopeError("give --predict or --real, not both")
    # (fit's --mp-policy goes with --gpus: cli/fit.py checks it; run's --nproc N is its own:
    # script/ranks.py checks it)
    if args.command == "fit" or not hasattr(args, "distributed"):
        pass
    elif args.distributed is None:
        for flag in ("nproc", "mp_policy", "timeout"):
            if getattr(args, flag, None) is not None:
                raise AmpscopeError(f"--{flag.replace('_', '-')} only applies with "
                                    "--distributed ddp|fsdp")
    else:
        if args.nproc is not None and args.nproc < 1:
            raise AmpscopeError("--nproc must be at least 1")
        if args.timeout is not None and not args.timeout > 0:
            raise AmpscopeError("--timeout must be a positive number of seconds")
    # `run --step-time` before the script runs, not after (`--gpu` and `--peak-flops` apply
    # without it: they name the GPU a cuda run's step is predicted on).
    step_time = args.step_time if args.command == "run" else None
    if step_time is not None and not 0 < step_time < math.inf:
        raise AmpscopeError("the step time must be a positive number of seconds")
    total = getattr(args, "total_batch", None)
    if total is not None and total < 1:
        raise AmpscopeError("--total-batch must be a positive number of tokens")
    if args.command in ("train", "bench"):  # the others' sizes: RunOptions and run_script
        for flag in _POSITIVE:
            value = getattr(args, flag, None)
            if value is not None and not 0 < value < math.inf:
                raise AmpscopeError(f"--{flag.replace('_', '-')} must be a positive number; "
                                    f"got {value}")
        for flag in _NOT_NEGATIVE:
            value = getattr(args, flag, None)
            if value is not None and not value >= 0:
                raise AmpscopeError(f"--{flag.replace('_', '-')} must be 0 or more; got {value}")


# Options of train and bench that only make sense above zero, or at zero and above.
_POSITIVE = ("steps", "batch", "seq", "lr", "eval_every", "log_every")
_NOT_NEGATIVE = ("warmup_steps", "warmup", "save_every", "sample_tokens")


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before the run, not after it."""
    if getattr(args, "perfetto", None) == "-":
        raise AmpscopeError("--perfetto writes a file: give a path, e.g. --perfetto step.json")
    asked = given(args)
    to_stdout = [export.flag for export, path in asked if path == "-" and export.stdout]
    if len(to_stdout) > 1:
        raise AmpscopeError(f"{' - and '.join(to_stdout)} - would both write to stdout: give "
                            "one a file")
    paths = [path for export, path in asked if path != "-" or not export.stdout]
    if args.command == "report":
        paths.append(args.output)
    for path in paths:
        why = unwritable(path)
        if why is not None:
            raise AmpscopeError(f"cannot write {path!r}: {why}")
    if args.command in ("train", "bench") and args.out is not None:
        why = unwritable_folder(args.out)
        if why is not None:
            raise AmpscopeError(f"cannot write into --out {args.out!r}: {why}; give another "
                                "folder")
