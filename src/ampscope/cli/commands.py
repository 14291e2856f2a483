"""The commands behind `ampscope …`: each parses nothing, calls the library, and renders
(the arguments are defined in cli/__init__.py). No analysis lives here."""

from __future__ import annotations

import argparse
import json
import sys

from ampscope.cli.common import _console, _on_device, _progress, _run_options, _show, _write_json
from ampscope.errors import AmpscopeError
from ampscope.records import SettingRecord


def cmd_distributed(args: argparse.Namespace) -> int:
    from ampscope.distributed import Parallel, launch, parse_mp_policy, predict
    from ampscope.render.distributed import render_distributed

    if args.workload != "train":
        raise AmpscopeError("--distributed runs the train workload")
    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    parallel = Parallel(args.distributed, args.nproc, **parse_mp_policy(args.mp_policy))
    common = {"setting": setting, "batch": options.batch, "seq": options.seq,
              "optimizer": options.optimizer}
    with _console(stderr=True).status(
            f"{'Predicting' if args.predict else 'Running'} {args.model} under "
            f"{args.distributed.upper()} on {args.nproc} ranks…"):
        if args.predict:
            report = predict(args.model, parallel, **common)
        else:
            report = launch(args.model, parallel, timeout=args.timeout, **common)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_distributed(report))


def cmd_trace(args: argparse.Namespace) -> int:
    if args.distributed:
        return cmd_distributed(args)
    from ampscope.api import trace
    from ampscope.render.text import render_trace

    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    status = _console(stderr=True)
    with status.status(f"Tracing {args.model}: {args.workload} under {setting}…"):
        result = trace(args.model, setting=setting, **options.as_kwargs())
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

        result, _ = matrix(args.model, settings=settings, on_setting=on_setting, **options.as_kwargs())
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

        result, traces = matrix(args.model, settings=settings, on_setting=on_setting, **options.as_kwargs())
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
        from ampscope.api import cuda_to_measure

        cuda_to_measure(setting)  # refuse before tracing
    with _console(stderr=True).status(f"Tracing the memory of {args.model} under {setting}…"):
        report = memory(args.model, setting=setting, **options.as_kwargs())
    measured = None
    if args.measure:
        timed = {k: v for k, v in options.as_kwargs().items() if k != "predict"}
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
        report = flops(args.model, setting=setting, **options.as_kwargs())
    seconds = args.step_time
    if args.measure:
        timed = {k: v for k, v in options.as_kwargs().items() if k != "predict"}
        with _console(stderr=True).status(f"Timing the {args.workload} step of {args.model}…"):
            seconds = measure_step(args.model, setting=setting, **timed)
    used = None
    if seconds is not None:
        used = utilization(report, seconds, _accelerator(args.gpu, report.setting),
                           report.setting.matmul_precision)
    data = report.to_dict() | {"utilization": asdict(used) if used else None}
    return _show(args, lambda: json.dumps(data, indent=1), lambda: render_flops(report, used))


def _accelerator(name: str | None, setting: SettingRecord):
    """The accelerator whose peaks MFU is held to: the one named, this machine's GPU, or the
    H100 an emulated CUDA run stands for; None when unknown (MFU n/a)."""
    from ampscope import hardware

    if name:
        return hardware.by_name(name)
    if setting.device != "cuda":
        return None
    if setting.emulated:
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


def cmd_formats(args: argparse.Namespace) -> int:
    from ampscope.analysis.formats import formats_report
    from ampscope.render.formats import render_formats

    report = formats_report(args.values)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_formats(report))


def cmd_policy(args: argparse.Namespace) -> int:
    from ampscope.analysis import autocast as arrange
    from ampscope.precision import DEVICES, DTYPES, default_autocast_dtype
    from ampscope.precision.autocast_policy import read_policy
    from ampscope.precision.quiz import quiz
    from ampscope.records import dtype_name
    from ampscope.render.autocast import compare_table, policy_table, quiz_table

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
    from ampscope.cli.train import cmd_train as train

    return train(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from ampscope.cli.train import cmd_bench as bench

    return bench(args)


def _load_trace(path: str):
    from ampscope.records import Trace

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
            _, (a, b) = matrix(args.model, settings=settings, **options.as_kwargs())
    result = diff_traces(a, b)
    return _show(args, lambda: json.dumps(result.to_dict(), indent=1),
                 lambda: render_diff(result, args.a, args.b, ops=args.ops))


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

