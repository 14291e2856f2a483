"""`ampscope train` and `ampscope bench`: their arguments, and the commands (parse, call,
render). cli/__init__.py adds the two subparsers with `add_train_parser` / `add_bench_parser`.

Namesakes, the same concern at another layer: `render/train.py`."""

from __future__ import annotations

import argparse
import contextlib
import sys

from ampscope.cli.common import _console, _progress, _show
from ampscope.cli.exports import add_exports, write_exports
from ampscope.errors import AmpscopeError

DEVICES = ["cpu", "cuda", "mps"]


def add_train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a model with the reference trainer: loss, tokens/s, "
                                     "MFU, memory, checkpoints, a sample")
    p.add_argument("--model", "-m", help="model to train (default: gpt2-tiny on a CPU, gpt2 on "
                                          "a GPU)")
    p.add_argument("--setting", "-s", help="precision setting, e.g. fp32, fp32+amp-bf16, "
                                           "fp32+amp-fp16, bf16 (default: fp32 on a CPU, "
                                           "fp32+amp-bf16 on a GPU)")
    p.add_argument("--device", "-d", choices=DEVICES,
                   help="device (default: cuda when there is one, else cpu)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: 200)")
    p.add_argument("--batch", "-b", type=int, help="sequences per micro-batch, B "
                                                   "(default: 8 on a CPU, 16 on a GPU)")
    p.add_argument("--seq", "-t", type=int, help="tokens per sequence, T (default: 64 on a "
                                                 "CPU, 1024 on a GPU)")
    p.add_argument("--total-batch", type=int, metavar="TOKENS",
                   help="tokens per optimizer step, reached by gradient accumulation "
                        "(a multiple of B×T; default: B×T)")
    p.add_argument("--data", metavar="PATH",
                   help="UTF-8 text file (default: the documentation bundled with CPython)")
    p.add_argument("--tokenizer", choices=["auto", "gpt2", "byte"],
                   help="default auto: GPT-2 BPE when installed and the model's vocabulary "
                        "holds it, else bytes")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 6e-4)")
    p.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 10)")
    p.add_argument("--decay", choices=["cosine", "linear"], help="decay after warmup "
                                                                 "(default: cosine)")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="validation loss every N steps (default: 50)")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="checkpoint every N steps, with --out (default: at the end only)")
    p.add_argument("--out", metavar="DIR", help="write checkpoints to DIR/step-NNNNNN")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (or the newest "
                                                   "in an --out folder); other options default "
                                                   "to the checkpoint's")
    p.add_argument("--compile", action="store_const", const=True, help="torch.compile the model")
    p.add_argument("--seed", type=int, help="seed of the weights and the sample (default: 0)")
    p.add_argument("--sample-tokens", type=int, metavar="N",
                   help="tokens to generate after training (default: 100; 0: none)")
    p.add_argument("--prompt", help="prompt of the sample (default: a newline)")
    p.add_argument("--log-every", type=int, metavar="N",
                   help="print every N-th step (default: 20 lines per run)")
    add_exports(p, "json")
    return p


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="the precision ladder: train steps under each setting, "
                                     "timed: ms/step, tokens/s, speedup, MFU, memory, loss")
    p.add_argument("--model", "-m", help="default: gpt2-tiny on a CPU, gpt2 on a GPU")
    p.add_argument("--ladder", help="comma-separated rungs SETTING[+compile][+flash] (default: "
                                    "fp32,fp32+tf32,fp32+amp-bf16,fp32+amp-bf16+flash,bf16)")
    p.add_argument("--compile", action="store_true", help="torch.compile every rung")
    p.add_argument("--steps", type=int, default=10, help="timed steps per rung "
                                                         "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first "
                                                         "(default: %(default)s)")
    p.add_argument("--batch", "-b", type=int, help="default: 8 on a CPU, 16 on a GPU")
    p.add_argument("--seq", "-t", type=int, help="default: 64 on a CPU, 1024 on a GPU")
    p.add_argument("--total-batch", type=int, metavar="TOKENS",
                   help="tokens per optimizer step (gradient accumulation; default: B×T)")
    p.add_argument("--device", "-d", choices=DEVICES,
                   help="device (default: cuda when there is one, else cpu)")
    p.add_argument("--data", metavar="PATH", help="UTF-8 text file (default: CPython's docs)")
    p.add_argument("--out", metavar="DIR", help="save the plot as DIR/bench.png")
    add_exports(p, "json")
    return p


# Command-line option → TrainConfig field, for the options that map one to one.
_FIELDS = ("model", "steps", "batch", "seq", "total_batch", "data", "tokenizer", "lr",
           "warmup_steps", "decay", "eval_every", "save_every", "out", "compile", "seed",
           "sample_tokens", "prompt")


def config_from_args(args: argparse.Namespace):
    """The TrainConfig the options ask for: the checkpoint's config under --resume, else the
    device's defaults, with every option given on the command line on top."""
    from dataclasses import replace

    from ampscope.precision import on_device
    from ampscope.train import checkpoint
    from ampscope.train.config import TrainConfig, defaults_for
    from ampscope.train.measure import default_device

    if args.resume:
        base = TrainConfig(**checkpoint.read(args.resume).config)
    else:
        base = defaults_for(args.device or default_device())
    given = {name: getattr(args, name) for name in _FIELDS if getattr(args, name) is not None}
    config = replace(base, **given)
    if args.setting is not None:
        config.setting = args.setting
    if args.device is not None:
        config.setting = on_device(config.setting, args.device)
    return config


def cmd_train(args: argparse.Namespace) -> int:
    from ampscope.render.train import TrainProgress, train_header, train_summary
    from ampscope.train.loop import train, training_setting

    config = config_from_args(args)
    training_setting(config.setting)  # refuse a device this machine lacks before the header
    console = _console(stderr=args.json == "-")  # keep stdout for the JSON
    tokens = config.total_batch or config.batch * config.seq
    start = f", resuming from {args.resume}" if args.resume else ""
    progress = TrainProgress(console, config.steps, args.log_every or max(1, config.steps // 20))
    with contextlib.ExitStack() as stack:

        def on_start() -> None:  # the header and the bar once the options all held
            console.print(f"Training {config.model} under {config.setting}: {config.steps} "
                          f"steps of {tokens:,} tokens{start}", markup=False)
            stack.enter_context(progress)

        result = train(config, resume=args.resume, log=progress, on_start=on_start)
    console.print(train_header(result))
    console.print(train_summary(result))
    write_exports(args, json=result.to_dict)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ampscope.precision import device_available
    from ampscope.render.train import render_bench, save_bench_plot
    from ampscope.train.bench import bench

    if args.device is not None and not device_available(args.device):
        raise AmpscopeError(f"cannot bench on {args.device}: this machine has no {args.device} "
                            "(the ladder times real steps; trace or predict for another device)")

    ladder = None if args.ladder is None else [r.strip() for r in args.ladder.split(",")
                                               if r.strip()]
    if ladder == []:
        raise AmpscopeError("--ladder needs at least one rung, e.g. fp32,fp32+amp-bf16")
    progress = _progress()
    with progress:
        task = progress.add_task("bench", total=len(ladder) if ladder else None)

        def on_rung(i: int, name: str) -> None:
            progress.update(task, completed=i, description=f"rung {name}")

        report = bench(args.model, ladder, device=args.device, steps=args.steps,
                       warmup=args.warmup, batch=args.batch, seq=args.seq,
                       total_batch=args.total_batch, compile=args.compile, data=args.data,
                       on_rung=on_rung)
    _show(args, lambda: render_bench(report), json=report.to_dict)
    if args.json == "-":
        return 0
    if args.out:
        path = save_bench_plot(report, f"{args.out}/bench.png")
        print(f"Wrote {path}" if path else "No plot: no rung ran, or matplotlib is missing",
              file=sys.stderr)
    return 0
