"""`ampscope fit`: its arguments and the command (parse, call, render). cli/__init__.py adds
the subparser with `add_fit_parser`.

Namesakes, the same concern at another layer: `analysis/fit.py`, `api/fit.py`, `render/fit.py`."""

from __future__ import annotations

import argparse

from ampscope.cli.common import _console, _show
from ampscope.cli.exports import add_exports
from ampscope.errors import AmpscopeError


def add_fit_parser(sub) -> argparse.ArgumentParser:
    from ampscope.hardware import KNOWN

    p = sub.add_parser(
        "fit", help="the largest micro-batch (and sequence) whose predicted train step fits a "
                    "GPU, and what would buy room")
    p.add_argument("model", help="model spec: a name from `ampscope models`, hf:PATH, or "
                                 "package.module:factory")
    p.add_argument("--gpu", metavar="NAME",
                   help=f"the GPU whose memory to fill: {', '.join(a.name for a in KNOWN)}")
    p.add_argument("--memory", metavar="SIZE",
                   help="the memory to fit in instead, e.g. 80GiB, 80GB, 24576MiB")
    p.add_argument("--setting", "-s", default="fp32+amp-bf16",
                   help="precision setting; without a DEVICE: prefix it runs on cuda when "
                        "--gpu is given (default: %(default)s)")
    p.add_argument("--seq", "-t", default="64", metavar="T|auto",
                   help="tokens per sequence, or auto: the longest power of two up to the "
                        "model's context that fits at batch 1 (default: %(default)s)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"],
                   help="optimizer of the train step (default: %(default)s)")
    p.add_argument("--gpus", type=int, metavar="N",
                   help="search parallel plans on N GPUs: FSDP2 over the GPUs times tensor "
                        "parallelism of 2, 4 or 8, with and without activation checkpointing, "
                        "each at its largest micro-batch per rank")
    p.add_argument("--mp-policy", metavar="param=…,reduce=…",
                   help="with --gpus: FSDP2's MixedPrecisionPolicy, e.g. param=bf16,reduce=fp32 "
                        "with -s fp32 (default: none, the setting's dtypes)")
    p.add_argument("--no-variants", action="store_true",
                   help="only the search: skip what would buy room")
    add_exports(p, "json")
    return p


def _plans(args: argparse.Namespace, seq: int | str, console) -> int:
    from ampscope.api.parallel_plans import check_arguments, plans
    from ampscope.render.plans import render_plans

    if seq == "auto":
        raise AmpscopeError("--seq auto does not apply with --gpus; give the tokens per sequence")
    assert isinstance(seq, int)
    check_arguments(args.gpus, seq)  # before the first line of progress
    console.print(f"Searching the plans of {args.model} on {args.gpus} GPUs (traced ranks on "
                  "fake tensors and a fake process group):", markup=False)
    report = plans(args.model, args.gpus, gpu=args.gpu, memory_size=args.memory,
                   setting=args.setting, mp_policy=args.mp_policy, seq=seq,
                   optimizer=args.optimizer, on_probe=console.print)
    return _show(args, lambda: render_plans(report), json=report.to_dict)


def cmd_fit(args: argparse.Namespace) -> int:
    from ampscope.api.fit import fit
    from ampscope.render.fit import probe_line, render_fit

    if args.seq == "auto":
        seq: int | str = "auto"
    else:
        try:
            seq = int(args.seq)
        except ValueError:
            raise AmpscopeError(f"--seq takes a number of tokens or auto, not {args.seq!r}") from None
    # The probes go to stdout as they run, or to stderr when stdout carries the JSON.
    console = _console(stderr=args.json == "-")
    if args.gpus is not None:
        return _plans(args, seq, console)
    if args.mp_policy is not None:
        raise AmpscopeError("--mp-policy only applies with --gpus N")
    console.print(f"Probing {args.model} (predicted train steps on fake tensors):", markup=False)
    report = fit(args.model, gpu=args.gpu, memory_size=args.memory, setting=args.setting,
                 seq=seq, optimizer=args.optimizer, variants=not args.no_variants,
                 on_probe=lambda p: console.print(probe_line(p)))
    return _show(args, lambda: render_fit(report), json=report.to_dict)
