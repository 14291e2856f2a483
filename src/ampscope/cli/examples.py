"""The examples at the end of every command's `--help`: in one table, and a registered report's
in its registration (render/report_kinds.py `examples=`).

Each line is a command a person can paste: tests/test_cli_surface.py parses every one with the
real parser, so an example that names a removed flag or a wrong value fails there. A `#` starts
the short comment that says what the example shows.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ampscope.render.report_kinds import REPORTS

EXAMPLES: dict[str, tuple[str, ...]] = {
    "": (
        "ampscope trace gpt2-tiny --seq 8            # dtypes of one train step, on the CPU",
        "ampscope memory gpt2 -d cuda --predict      # every byte of a CUDA step, on fake tensors",
        "ampscope models                             # the models ampscope can build",
    ),
    "trace": (
        "ampscope trace nanochat-tiny --seq 8 --setting fp32+amp-bf16",
        "ampscope trace gpt2-tiny --seq 8 --device cuda --ops   # emulated CUDA, every op",
        "ampscope trace llama-3-70b -d cuda -s bf16 --seq 4096  # any size: fake tensors",
        "ampscope trace gpt2-tiny --seq 8 --real                # real tensors, real values",
    ),
    "run": (
        "ampscope run --device cuda --steps 1 train.py --batch_size=4",
        "ampscope run --device cuda -m scripts.base_train -- --depth=4",
        "ampscope run --predict --device cuda train.py   # full size, no memory",
        "ampscope run --nproc 2 --device cuda train_ddp.py   # 2 ranks, as torchrun",
    ),
    "check": (
        "ampscope check --device cuda train.py --batch_size=4",
        "ampscope check --strict --ignore AMP701 train.py   # in CI: warnings fail too",
        "ampscope check trace.json   # a trace written with --json",
        "ampscope check --list",
    ),
    "fit": (
        "ampscope fit llama-3-8b --gpu h100 -s bf16 --seq 4096",
        "ampscope fit gpt2 --memory 24GiB --seq auto   # the longest sequence too",
    ),
    "matrix": (
        "ampscope matrix gpt2-tiny --seq 8",
        "ampscope matrix nanochat-tiny --settings fp32+amp-bf16,cuda:fp32+amp-bf16 --seq 8",
    ),
    "report": (
        "ampscope report gpt2-tiny --seq 8 -o report.html",
        "ampscope report gpt2-tiny --settings fp32,fp32+amp-bf16 --seq 8 --numerics",
    ),
    "diff": (
        "ampscope diff fp32 fp32+amp-bf16 --model gpt2-tiny --seq 8",
        "ampscope diff fp32+amp-bf16 cuda:fp32+amp-bf16 --model gpt2-tiny --ops",
        "ampscope diff a.json b.json   # two traces written with --json",
    ),
    "train": (
        "ampscope train --model gpt2-tiny --steps 200",
        "ampscope train --model gpt2-tiny -s fp32+amp-bf16 --steps 50 --out runs/tiny",
        "ampscope train --resume runs/tiny --steps 100",
    ),
    "bench": (
        "ampscope bench --model gpt2-tiny --steps 5",
        "ampscope bench --ladder fp32,fp32+amp-bf16 --out runs/bench",
    ),
    "models": (
        "ampscope models",
        "ampscope models --json models.json",
    ),
}


def examples() -> dict[str, tuple[str, ...]]:
    """Every command's examples (the top level's under ""): the table's and the reports'."""
    return {**EXAMPLES, **{k.name: k.examples for k in REPORTS.values() if k.examples}}


def add_examples(parser: argparse.ArgumentParser,
                 commands: Mapping[str, argparse.ArgumentParser]) -> None:
    """Give the top-level parser and every command with examples their examples, printed as
    written (RawDescriptionHelpFormatter keeps the lines and their alignment)."""
    table = examples()
    for name, p in {"": parser, **commands}.items():
        if name in table:
            p.epilog = "examples:\n" + "".join(f"  {line}\n" for line in table[name])
            p.formatter_class = argparse.RawDescriptionHelpFormatter
