"""`ampscope` command line: parse, call the library, render. No analysis lives here."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence

from ampscope.api import DEFAULT_MATRIX_SETTINGS
from ampscope.errors import AmpscopeError, DtypeMismatchError

DEFAULT_MODEL = "gpt2"
DEFAULT_SETTING = "fp32+amp-bf16"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_MESSAGE = 300


def one_line(message: str) -> str:
    """The first line of a message, without terminal colour codes, cut to a readable length."""
    lines = _ANSI.sub("", message).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampscope",
        description="Which precision does every tensor of a PyTorch model really run in?",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command")

    trace = sub.add_parser("trace", help="trace one workload of a model under one setting")
    _add_model_argument(trace)
    trace.add_argument("--setting", "-s", default=DEFAULT_SETTING,
                       help="precision setting, e.g. fp32, bf16, fp32+amp-bf16, fp32+tf32 "
                            "(default: %(default)s)")
    _add_run_arguments(trace)
    trace.add_argument("--ops", action="store_true", help="add the op-level listing")
    trace.add_argument("--diagram", action="store_true",
                       help="draw the dtype flow of one forward pass, one block drawn once")
    _add_distributed_arguments(trace)

    matrix = sub.add_parser("matrix", help="one workload under several settings, side by side")
    _add_model_argument(matrix)
    matrix.add_argument("--settings", default=",".join(DEFAULT_MATRIX_SETTINGS),
                        help="comma-separated settings (default: %(default)s)")
    _add_run_arguments(matrix)

    report = sub.add_parser("report", help="one self-contained HTML page: findings, dtype flow, "
                                           "settings matrix, memory and FLOPs")
    _add_model_argument(report)
    report.add_argument("--settings", default=",".join(DEFAULT_MATRIX_SETTINGS),
                        help="comma-separated settings (default: %(default)s)")
    _add_run_arguments(report)
    report.add_argument("--numerics", action="store_true",
                        help="add each setting's divergence from an fp64 run, layer by layer "
                             "(real runs of the forward or train workload)")
    report.add_argument("--output", "-o", default="report.html", metavar="PATH",
                        help="the HTML file to write (default: %(default)s)")

    diff = sub.add_parser("diff", help="what changed dtype between two traces or two settings")
    diff.add_argument("a", help="a trace JSON file (from --json), or a setting")
    diff.add_argument("b", help="a trace JSON file, or a setting")
    diff.add_argument("--model", "-m", default=DEFAULT_MODEL,
                      help="model to trace when A and B are settings (default: %(default)s)")
    _add_run_arguments(diff)
    diff.add_argument("--ops", action="store_true", help="add the ops that changed dtype")

    memory = sub.add_parser("memory", help="every byte of one step by category and dtype; the "
                                           "peak and where it happens")
    _add_model_argument(memory)
    memory.add_argument("--setting", "-s", default=DEFAULT_SETTING,
                        help="precision setting (default: %(default)s)")
    _add_run_arguments(memory)
    memory.add_argument("--measure", action="store_true",
                        help="on a real CUDA device, also run the step and show "
                             "torch.cuda.max_memory_allocated beside the prediction")
    _add_distributed_arguments(memory)

    flops = sub.add_parser("flops", help="FLOPs of one step by phase, dtype and module; MFU")
    _add_model_argument(flops)
    flops.add_argument("--setting", "-s", default=DEFAULT_SETTING,
                       help="precision setting (default: %(default)s)")
    _add_run_arguments(flops)
    timing = flops.add_mutually_exclusive_group()
    timing.add_argument("--step-time", type=float, metavar="SECONDS",
                        help="measured wall time of one step, for throughput and MFU")
    timing.add_argument("--measure", action="store_true",
                        help="time the untraced step on this machine (a real device only)")
    flops.add_argument("--gpu", metavar="NAME",
                       help="accelerator whose peak FLOP/s MFU uses, e.g. h100, a100 (default: "
                            "this machine's GPU; h100 for emulated cuda)")

    numerics = sub.add_parser("numerics", help="how far each setting's values drift from a "
                                               "high-precision reference, layer by layer")
    _add_model_argument(numerics)
    numerics.add_argument("--settings", default="fp32,fp32+amp-bf16,bf16",
                          help="comma-separated settings (default: %(default)s)")
    numerics.add_argument("--reference", default="fp64", choices=["fp64", "fp32"],
                          help="the setting every other is compared with (default: %(default)s)")
    numerics.add_argument("--workload", "-w", default="forward", choices=["forward", "train"],
                          help="train adds the loss's and the gradients' divergence "
                               "(default: %(default)s)")
    numerics.add_argument("--batch", "-b", type=int, default=1, help="default: %(default)s")
    numerics.add_argument("--seq", "-t", type=int, default=64, help="default: %(default)s")
    numerics.add_argument("--device", "-d", choices=["cpu", "cuda", "mps", "xpu"],
                          help="device of every setting without a DEVICE: prefix (emulated "
                               "when absent: CUDA's dtypes, the CPU's kernels)")
    numerics.add_argument("--all", action="store_true", help="every module, not only blocks")
    numerics.add_argument("--json", metavar="PATH", help="write the result as JSON ('-' for stdout)")
    numerics.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help=argparse.SUPPRESS)

    formats = sub.add_parser("formats", help="number formats: range, eps, and how each stores "
                                             "given values")
    formats.add_argument("values", nargs="*", metavar="VALUE",
                         help="decimal values to store in every format, e.g. 1e-8 65504 0.1 nan "
                              "-inf")
    formats.add_argument("--json", metavar="PATH",
                         help="write the result as JSON ('-' for stdout)")
    formats.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    policy = sub.add_parser("policy", help="the autocast policy of this PyTorch build, per op")
    policy.add_argument("--device", "-d", choices=["cpu", "cuda", "mps", "xpu"], default="cpu",
                        help="device whose policy to show (default: %(default)s)")
    policy.add_argument("--dtype", choices=["bf16", "fp16"],
                        help="autocast dtype (default: the device's own default)")
    policy.add_argument("--op", metavar="NAME", help="only ops whose name contains NAME")
    policy.add_argument("--compare", nargs=2, metavar=("DEV1", "DEV2"),
                        help="only the ops where two devices' policies differ")
    policy.add_argument("--quiz", action="store_true",
                        help="what x.sum(), x.mean(), softmax, ... return on cpu, cuda and mps")
    policy.add_argument("--json", metavar="PATH", help="write the result as JSON ('-' for stdout)")
    policy.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)

    from ampscope.train.command import add_bench_parser, add_train_parser

    add_train_parser(sub)  # ampscope train: the reference trainer (train/command.py)
    add_bench_parser(sub)  # ampscope bench: the precision ladder

    models = sub.add_parser("models", help="list the built-in models and the HF zoo")
    models.add_argument("--json", metavar="PATH", help="write the list as JSON ('-' for stdout)")
    models.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    return parser


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="model spec: a name from `ampscope models`, hf:PATH, or "
                             "package.module:factory (default: %(default)s)")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What every command that runs a model takes: the workload and its size, and --json."""
    parser.add_argument("--workload", "-w", default="train",
                        choices=["train", "forward", "generate"], help="default: %(default)s")
    parser.add_argument("--batch", "-b", type=int, default=1, help="default: %(default)s")
    parser.add_argument("--seq", "-t", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"],
                        help="optimizer of the train step (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=4,
                        help="tokens sampled by the generate workload (default: %(default)s)")
    parser.add_argument("--device", "-d", choices=["cpu", "cuda", "mps", "xpu"],
                        help="device of every setting without a DEVICE: prefix; a device this "
                             "machine lacks is emulated on the CPU")
    parser.add_argument("--predict", action=argparse.BooleanOptionalAction, default=None,
                        help="run on fake tensors: no memory, any model size (default: only "
                             "when a real run would not fit)")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON ('-' for stdout)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # SUPPRESS: keep a top-level --debug


# --- distributed (DDP, FSDP2): see ampscope/distributed and docs/distributed.md -----------------


def _add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--distributed", choices=["ddp", "fsdp"],
                        help="run the train step under DDP or FSDP2 on --nproc ranks (real "
                             "processes; with --predict, rank 0 of N on a fake process group)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--mp-policy", metavar="POLICY",
                        help="FSDP2 MixedPrecisionPolicy, e.g. param=bf16,reduce=fp32 "
                             "(DDP: reduce= only, a compress hook)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a real distributed run may take (default: %(default)s)")


def cmd_distributed(args: argparse.Namespace) -> int:
    from ampscope.distributed import Parallel, launch, parse_mp_policy, predict
    from ampscope.distributed.render import render_distributed

    if args.workload != "train":
        raise AmpscopeError("--distributed runs the train workload")
    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    parallel = Parallel(args.distributed, args.nproc, **parse_mp_policy(args.mp_policy))
    common = {"setting": setting, "batch": options["batch"], "seq": options["seq"],
              "optimizer": options["optimizer"]}
    with _console(stderr=True).status(
            f"{'Predicting' if args.predict else 'Running'} {args.model} under "
            f"{args.distributed.upper()} on {args.nproc} ranks…"):
        if args.predict:
            report = predict(args.model, parallel, **common)
        else:
            report = launch(args.model, parallel, timeout=args.timeout, **common)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_distributed(report))


def _run_options(args: argparse.Namespace) -> dict:
    if args.batch < 1 or args.seq < 1 or args.new_tokens < 1:
        raise AmpscopeError("--batch, --seq and --new-tokens must be positive integers")
    return {"workload": args.workload, "batch": args.batch, "seq": args.seq,
            "optimizer": args.optimizer, "new_tokens": args.new_tokens, "predict": args.predict}


def _on_device(settings: list[str], device: str | None) -> list[str]:
    from ampscope.settings import on_device

    return [on_device(s, device) for s in settings] if device else settings


def _progress():
    """A transient progress bar on stderr, drawn only on a terminal (logs and pipes get none)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = _console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def cmd_trace(args: argparse.Namespace) -> int:
    if args.distributed:
        return cmd_distributed(args)
    from ampscope.api import trace
    from ampscope.render.text import render_trace

    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    status = _console(stderr=True)
    with status.status(f"Tracing {args.model}: {args.workload} under {setting}…"):
        result = trace(args.model, setting=setting, **options)
    return _show(args, result.to_json,
                 lambda: render_trace(result, ops=args.ops, diagram=args.diagram))


def cmd_matrix(args: argparse.Namespace) -> int:
    from ampscope.api import matrix
    from ampscope.render.matrix import render_matrix

    options = _run_options(args)
    settings = _on_device([s.strip() for s in args.settings.split(",") if s.strip()], args.device)
    if not settings:
        raise AmpscopeError("--settings needs at least one setting, e.g. fp32,fp32+amp-bf16")
    progress = _progress()
    with progress:
        task = progress.add_task(f"Building {args.model}…", total=len(settings))

        def on_setting(i: int, name: str) -> None:
            progress.update(task, completed=i, description=f"{args.workload} under {name}")

        result, _ = matrix(args.model, settings=settings, on_setting=on_setting, **options)
        progress.update(task, completed=len(settings))
    return _show(args, lambda: json.dumps(result.to_dict(), indent=1),
                 lambda: render_matrix(result))


def cmd_report(args: argparse.Namespace) -> int:
    from ampscope.analysis.flops import flop_report
    from ampscope.analysis.memory import memory_report
    from ampscope.api import matrix, numerics, tokens_of
    from ampscope.render.html import report_html

    options = _run_options(args)
    settings = _on_device([s.strip() for s in args.settings.split(",") if s.strip()], args.device)
    if not settings:
        raise AmpscopeError("--settings needs at least one setting, e.g. fp32,fp32+amp-bf16")
    if args.numerics and args.workload not in ("forward", "train"):
        raise AmpscopeError("--numerics compares the forward or train workload, not "
                            f"{args.workload}")
    runs = len(settings) + (len(settings) + 1 if args.numerics else 0)
    progress = _progress()
    with progress:
        task = progress.add_task(f"Building {args.model}…", total=runs)

        def on_setting(i: int, name: str) -> None:
            progress.update(task, completed=i, description=f"{args.workload} under {name}")

        def on_numerics(i: int, name: str) -> None:
            progress.update(task, completed=len(settings) + i, description=f"numerics: {name}")

        result, traces = matrix(args.model, settings=settings, on_setting=on_setting, **options)
        values = None
        if args.numerics:
            values = numerics(args.model, settings=settings, workload=args.workload,
                              batch=args.batch, seq=args.seq, optimizer=args.optimizer,
                              on_setting=on_numerics)
    page = report_html(traces, result, memory=[memory_report(t) for t in traces],
                       flops=[flop_report(t, tokens=tokens_of(t)) for t in traces],
                       numerics=values)
    if args.json:
        _write_json(json.dumps(result.to_dict(), indent=1), args.json)
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise AmpscopeError(f"cannot write {args.output}: {e.strerror}") from e
    print(f"Wrote {args.output}", file=sys.stderr)  # plain: a path must not be wrapped
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    if args.distributed:
        return cmd_distributed(args)
    from ampscope.api import measure_peak_memory, memory
    from ampscope.render.memory import render_memory

    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    if args.measure:
        from ampscope.settings import parse_setting, resolve_device

        target = resolve_device(parse_setting(setting))
        if target.device != "cuda" or target.emulated:
            raise AmpscopeError(
                f"--measure needs a real CUDA device and {target.name} runs "
                f"{'emulated ' if target.emulated else ''}on {target.run_device}"
            )
    with _console(stderr=True).status(f"Tracing the memory of {args.model} under {setting}…"):
        report = memory(args.model, setting=setting, **options)
    measured = None
    if args.measure:
        timed = {k: v for k, v in options.items() if k != "predict"}
        with _console(stderr=True).status(f"Running the {args.workload} step on the device…"):
            measured = measure_peak_memory(args.model, setting=setting, **timed)
    if args.json:
        data = report.to_dict()
        data["measured"] = measured
        _write_json(json.dumps(data, indent=1), args.json)
        if args.json == "-":
            return 0
    _console().print(render_memory(report))
    if measured is not None:
        predicted = report.peak.rounded_bytes or report.peak.bytes
        error = (predicted - measured["max_memory_allocated"]) / measured["max_memory_allocated"]
        _console().print(f"\nMeasured on {measured['device']}: max_memory_allocated "
                         f"{measured['max_memory_allocated']:,} B; predicted {predicted:,} B "
                         f"({100 * error:+.1f}%)")
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ampscope.analysis.flops import utilization
    from ampscope.api import flops, measure_step
    from ampscope.render.flops import render_flops

    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    if args.step_time is not None and args.step_time <= 0:
        raise AmpscopeError("--step-time must be a positive number of seconds")
    with _console(stderr=True).status(f"Counting FLOPs of {args.model} under {setting}…"):
        report = flops(args.model, setting=setting, **options)
    seconds = args.step_time
    if args.measure:
        timed = {k: v for k, v in options.items() if k != "predict"}
        with _console(stderr=True).status(f"Timing the {args.workload} step of {args.model}…"):
            seconds = measure_step(args.model, setting=setting, **timed)
    used = None
    if seconds is not None:
        used = utilization(report, seconds, _accelerator(args.gpu, report.setting),
                           report.setting.get("matmul_precision", "highest"))
    data = report.to_dict() | {"utilization": asdict(used) if used else None}
    return _show(args, lambda: json.dumps(data, indent=1), lambda: render_flops(report, used))


def _accelerator(name: str | None, setting: dict):
    """The accelerator whose peaks MFU is held to: the one named, this machine's GPU, or the
    H100 an emulated CUDA run stands for; None when unknown (MFU n/a)."""
    from ampscope import hardware

    if name:
        return hardware.by_name(name)
    if setting.get("device") != "cuda":
        return None
    if setting.get("emulated"):
        return hardware.by_name("h100")
    import torch

    return hardware.lookup(torch.cuda.get_device_name())


def cmd_numerics(args: argparse.Namespace) -> int:
    from ampscope.api import numerics
    from ampscope.render.numerics import render_numerics

    if args.batch < 1 or args.seq < 1:
        raise AmpscopeError("--batch and --seq must be positive integers")
    settings = _on_device([s.strip() for s in args.settings.split(",") if s.strip()], args.device)
    if not settings:
        raise AmpscopeError("--settings needs at least one setting, e.g. fp32+amp-bf16,bf16")
    progress = _progress()
    with progress:
        task = progress.add_task(f"Building {args.model}…", total=len(settings) + 1)

        def on_setting(i: int, name: str) -> None:
            progress.update(task, completed=i, description=f"{args.workload} under {name}")

        report = numerics(args.model, settings=settings, reference=args.reference,
                          workload=args.workload, batch=args.batch, seq=args.seq,
                          on_setting=on_setting)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_numerics(report, all_modules=args.all))


def _values_after_dashes(argv: list[str]) -> list[str]:
    """`ampscope formats -inf -1e-8`: argparse reads "-inf" and "-1e-8" as unknown options (it
    only knows plain negative numbers like -2), so move the values behind a "--"."""
    leading = [a for a in argv[:argv.index("formats")] if a == "--debug"] if "formats" in argv else []
    if argv[len(leading):len(leading) + 1] != ["formats"] or "--" in argv:
        return argv
    options, values, rest = [*leading], [], iter(argv[len(leading) + 1:])
    for arg in rest:
        if arg == "--json":
            options += [arg, next(rest, "")]
        elif arg.startswith("--") or arg == "-h":
            options.append(arg)
        else:
            values.append(arg)
    global_options = [o for o in options if o in leading]
    options = options[len(global_options):]
    return [*global_options, "formats", *options, "--", *values]


def cmd_formats(args: argparse.Namespace) -> int:
    from ampscope.analysis.formats import formats_report
    from ampscope.render.formats import render_formats

    report = formats_report(args.values)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_formats(report))


def cmd_policy(args: argparse.Namespace) -> int:
    from ampscope.analysis import policy as arrange
    from ampscope.capture.policy import quiz, read_policy
    from ampscope.records import dtype_name
    from ampscope.render.policy import compare_table, policy_table, quiz_table
    from ampscope.settings import DEVICES, DTYPES, default_autocast_dtype

    devices = tuple(args.compare) if args.compare else (args.device,)
    for device in devices:
        if device not in DEVICES:
            raise AmpscopeError(f"unknown device {device!r}; choose {', '.join(DEVICES)}")
    dtype = DTYPES[args.dtype] if args.dtype else default_autocast_dtype(devices[0])
    name = dtype_name(dtype)
    data: dict = {"schema": arrange.SCHEMA, "dtype": name}
    if args.quiz:
        answers = {d: quiz(d, dtype) for d in (devices if args.compare else ("cpu", "cuda", "mps"))}
        data["quiz"] = answers
        shown = quiz_table(answers, name)
    elif args.compare:
        a, b = (read_policy(d, dtype) for d in devices)
        rows = arrange.compare(a, b, args.op)
        data.update(devices=list(devices),
                    ops=[{"op": r.op, **dict(zip(devices, r.categories, strict=True))} for r in rows])
        shown = compare_table(rows, devices, name)
    else:
        policy = read_policy(args.device, dtype)
        rows = arrange.table(policy, args.op)
        if not rows and args.op:
            raise AmpscopeError(
                f"no op containing {args.op!r} is on {args.device}'s autocast list: it follows "
                f"its inputs there (try --compare cpu cuda --op {args.op})"
            )
        data.update(device=args.device, ops=[{"op": r.op, "category": r.categories[0]} for r in rows])
        shown = policy_table(rows, args.device, name, len(policy))
    return _show(args, lambda: json.dumps(data, indent=1), lambda: shown)


def cmd_train(args: argparse.Namespace) -> int:
    from ampscope.train.command import cmd_train as train

    return train(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from ampscope.train.command import cmd_bench as bench

    return bench(args)


def _load_trace(path: str):
    from ampscope.trace import Trace

    try:
        with open(path) as f:
            return Trace.from_dict(json.load(f))
    except OSError as e:
        raise AmpscopeError(f"cannot read {path}: {e.strerror}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise AmpscopeError(f"{path} is not an ampscope trace (write one with "
                            f"`ampscope trace MODEL --json FILE`): {e}") from e


def cmd_diff(args: argparse.Namespace) -> int:
    import os

    from ampscope.analysis.diff import diff_traces
    from ampscope.render.diff import render_diff

    files = [os.path.exists(x) or x.endswith(".json") for x in (args.a, args.b)]
    if all(files):
        a, b = _load_trace(args.a), _load_trace(args.b)
    elif any(files):
        raise AmpscopeError("give two trace files or two settings, not one of each")
    else:
        from ampscope.api import matrix

        options = _run_options(args)
        settings = _on_device([args.a, args.b], args.device)
        with _console(stderr=True).status(f"Tracing {args.model} under {args.a} and {args.b}…"):
            _, (a, b) = matrix(args.model, settings=settings, **options)
    result = diff_traces(a, b)
    return _show(args, lambda: json.dumps(result.to_dict(), indent=1),
                 lambda: render_diff(result, args.a, args.b, ops=args.ops))


def _show(args: argparse.Namespace, to_json: Callable[[], str], render: Callable[[], object]) -> int:
    """The end of every command: JSON to --json PATH when asked ('-': JSON only, on stdout),
    then the rendering for a person."""
    if args.json:
        _write_json(to_json(), args.json)
        if args.json == "-":
            return 0
    _console().print(render())
    return 0


def _write_json(text: str, path: str) -> None:
    """Write to PATH, or stdout for '-'; say where it went on stderr."""
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    try:
        with open(path, "w") as f:
            f.write(text + "\n")
    except OSError as e:
        raise AmpscopeError(f"cannot write {path}: {e.strerror}") from e
    print(f"Wrote {path}", file=sys.stderr)  # plain: a path must not be wrapped


def cmd_models(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ampscope.models import list_models

    infos = list_models()
    if args.json:
        document = {"schema": "ampscope.models/1", "models": [
            {"name": i.name, "family": i.family, "parameters": i.parameters,
             "description": i.description} for i in infos]}
        _write_json(json.dumps(document, indent=1), args.json)
        if args.json == "-":
            return 0
    table = Table(show_edge=False)
    table.add_column("model")
    table.add_column("family")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for info in infos:
        table.add_row(info.name, info.family, f"{info.parameters:,}", info.description)
    _console().print(table)
    _console().print("[dim]Also: hf:PATH (a config.json or checkpoint folder) and "
                     "package.module:factory (your own model).[/dim]")
    return 0


def run() -> None:
    """The console script: `main`, then exit without the interpreter's teardown.

    After a large trace, freeing its hundreds of thousands of records one by one takes about a
    second and serves nothing: output is flushed here and files were closed where written.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not [a for a in argv if a != "--debug"]:
        argv.append("trace")  # bare `ampscope` traces the built-in default model
    argv = _values_after_dashes(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args([*argv, "trace"])
    commands = {"trace": cmd_trace, "matrix": cmd_matrix, "diff": cmd_diff,
                "flops": cmd_flops, "memory": cmd_memory, "formats": cmd_formats, "report": cmd_report, "numerics": cmd_numerics,
                "policy": cmd_policy, "train": cmd_train, "bench": cmd_bench,
                "models": cmd_models}
    try:
        return commands[args.command](args)
    except DtypeMismatchError as e:
        if args.debug:
            raise
        # The diagnosis is the answer here: its lines follow the one-line error.
        print(f"ampscope: error while tracing {args.model}: {one_line(str(e))}", file=sys.stderr)
        for line in e.diagnosis.lines:
            print(f"  {line}", file=sys.stderr)
        return 2
    except AmpscopeError as e:
        if args.debug:
            raise
        print(f"ampscope: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ampscope: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the model (or ampscope) raised: one line unless --debug
        if args.debug:
            raise
        where = f" while tracing {args.model}" if getattr(args, "model", None) else ""
        print(f"ampscope: error{where}: {type(e).__name__}: {one_line(str(e))} "
              "(run with --debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
