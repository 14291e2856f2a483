"""The accelerator options: `--gpu NAME`, `--peak-flops DTYPE=FLOPS,...` and `--memory SIZE`,
added by one helper so every command that takes them spells them alike, and resolved into one
`hardware.Accelerator` before anything runs (bad values: one line, exit 2)."""

from __future__ import annotations

import argparse

from ampscope import hardware


def add_hardware_arguments(parser: argparse.ArgumentParser, *, memory: bool = True,
                           gpu_help: str | None = None) -> None:
    """--gpu and --peak-flops; --memory too where the command uses the GPU's memory."""
    parser.add_argument("--gpu", metavar="NAME",
                        help=gpu_help or "accelerator whose figures to use, e.g. h100, a100 "
                                         "(the built-in table and your hardware.toml)")
    parser.add_argument("--peak-flops", metavar="DTYPE=FLOPS,...",
                        help="peak FLOP/s per dtype, e.g. bf16=989e12,fp32=67e12: over --gpu's "
                             "figures, or alone")
    if memory:
        parser.add_argument("--memory", metavar="SIZE",
                            help="the accelerator's memory, e.g. 80GiB or 40GB: over --gpu's")


def resolve_hardware(args: argparse.Namespace) -> None:
    """Set `args.accelerator`: --gpu's entry with --peak-flops / --memory put over it, or None
    when none of them was given (the command's own default then applies)."""
    if not hasattr(args, "gpu"):
        return
    base = hardware.by_name(args.gpu) if args.gpu else None
    given = getattr(args, "peak_flops", None)  # `fit` takes --gpu and --memory only
    peaks = hardware.parse_peak_flops(given) if given is not None else None
    size = getattr(args, "memory", None)
    if not isinstance(size, str):  # `run --memory` is a flag: the memory report
        size = None
    memory = hardware.parse_size(size) if size is not None else None
    args.accelerator = hardware.with_figures(base, peak_flops=peaks, memory_bytes=memory)
