"""The commands behind `ampscope …`: each parses nothing, calls the library, and renders
(the arguments are defined in cli/__init__.py). No analysis lives here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ampscope.cli.common import (
    _console,
    _on_device,
    _progress,
    _run_options,
    _run_progress,
    _show,
    _write_json,
)
from ampscope.errors import AmpscopeError
from ampscope.files import write_atomic


def cmd_distributed(args: argparse.Namespace) -> int:
    from ampscope.distributed import Parallel, launch, parse_mp_policy, predict
    from ampscope.render.distributed import render_distributed

    if args.workload != "train":
        raise AmpscopeError("--distributed runs the train workload")
    if args.checkpoint or args.optimizer_impl:
        raise AmpscopeError("--checkpoint and --optimizer-impl do not apply to --distributed "
                            "runs yet; leave them out")
    for flag in ("csv", "perfetto"):
        if getattr(args, flag, None):
            raise AmpscopeError(f"--{flag} is not available with --distributed; use --json PATH")
    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    nproc = args.nproc or 2
    parallel = Parallel(args.distributed, nproc, **parse_mp_policy(args.mp_policy))
    common = {"setting": setting, "batch": options.batch, "seq": options.seq,
              "optimizer": options.optimizer}
    with _console(stderr=True).status(
            f"{'Running' if args.predict is False else 'Predicting'} {args.model} under "
            f"{args.distributed.upper()} on {nproc} ranks…"):
        if args.predict is not False:  # predicted unless --real, as every other run
            report = predict(args.model, parallel, **common)
        else:
            report = launch(args.model, parallel, timeout=args.timeout or 120.0, **common)
    if getattr(args, "report", None) and report.trace is not None:  # `memory` has no --report
        memory, flops = _step_reports(report.trace, memory=True, flops=True)
        _write_report(args.report, [report.trace], memory=memory, flops=flops,
                      distributed=report)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_distributed(report))


def cmd_trace(args: argparse.Namespace) -> int:
    if args.distributed:
        return cmd_distributed(args)
    from ampscope.api import trace

    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    with _run_progress(f"Tracing {args.model}: {args.workload} under {setting}…"):
        result = trace(args.model, setting=setting, **options.as_kwargs())
    if args.report:
        memory, flops = _step_reports(result, memory=True, flops=True)
        _write_report(args.report, [result], memory=memory, flops=flops)
    return _show_trace(args, result)


def _show_trace(args: argparse.Namespace, result, extra: list | None = None,
                to_json=None) -> int:
    """`trace` and `run`: the timeline to --perfetto PATH, then JSON (the trace's, or
    `to_json`'s), CSV and the rendering (with `extra` renderables after the trace's)."""
    from rich.console import Group

    from ampscope.analysis.summary import trace_summary
    from ampscope.render.text import render_trace

    if args.perfetto:
        try:
            result.to_perfetto(args.perfetto)
        except OSError as e:
            raise AmpscopeError(f"cannot write {args.perfetto}: {e.strerror}") from e
        print(f"Wrote {args.perfetto}", file=sys.stderr)  # plain: a path must not be wrapped
    return _show(args, to_json or result.to_json,
                 lambda: Group(render_trace(trace_summary(result, ops=args.ops,
                                                          diagram=args.diagram)), *(extra or [])),
                 table=lambda: result.table("ops" if args.ops else "modules"))


def cmd_run(args: argparse.Namespace) -> int:
    import contextlib
    import io

    from ampscope.script import run_script

    script_args = args.script_args
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    args.model = args.target  # named in one-line errors
    if args.nproc is None and args.job_timeout is not None:
        raise AmpscopeError("--timeout only applies with --nproc N")
    if args.nproc is None and args.all_ranks:
        raise AmpscopeError("--all-ranks only applies with --nproc N --predict")
    # --quiet hides the script's prints (with --json -, main() already sends them to stderr).
    quiet = contextlib.redirect_stdout(io.StringIO()) if args.quiet else contextlib.nullcontext()
    report = traces = to_dict = same_as = None
    with quiet:
        if args.nproc is not None:
            report, traces, to_dict, same_as = _run_ranks(args, script_args)
            result = traces[0]
        else:
            # In this process: the command line's process is the script's own, as under
            # `python`.
            result = run_script(args.target, script_args, module=args.module,
                                device=args.device, steps=args.steps, predict=args.predict,
                                max_forwards=args.max_forwards, in_process=True)
    if report is not None:  # --gpu's fit verdicts join the report before its JSON, page or view
        from ampscope.distributed.verdicts import verdicts

        report.notes += verdicts(report, args.accelerator)
    timed = args.step_time is not None
    memory, flops = _step_reports(result, memory=args.memory or bool(args.report),
                                  flops=args.flops or timed or bool(args.report),
                                  step_time=args.step_time, gpu=args.accelerator)
    if args.report:
        _write_report(args.report, [result], memory=memory, flops=flops, distributed=report,
                      same_as=same_as)
    extra = []
    if args.memory:
        from ampscope.render.memory import render_memory
        extra += [render_memory(r) for r in memory]
    if args.flops or timed:
        from ampscope.render.flops import render_flops
        extra += [render_flops(r) for r in flops]
    if report is not None:
        from ampscope.render.ranks import render_ranks
        from ampscope.script.ranks import report_dict

        extra.append(render_ranks(report, traces))
        return _show_trace(args, result, extra=extra, to_json=lambda: json.dumps(
            (to_dict or report_dict)(report), indent=1))
    return _show_trace(args, result, extra=extra)


def _run_ranks(args: argparse.Namespace, script_args: list[str]):
    """`run --nproc N`: the script as N real ranks, each traced; their report."""
    from ampscope.script.ranks import DEFAULT_TIMEOUT, ranks_report, run_ranks

    if args.job_timeout is not None and not args.job_timeout > 0:
        raise AmpscopeError("--timeout must be a positive number of seconds")
    if args.predict:
        return _predicted_ranks(args, script_args)
    if args.all_ranks:
        raise AmpscopeError("--all-ranks only applies with --nproc N --predict (without "
                            "--predict every rank runs)")
    traces = run_ranks(args.target, script_args, args.nproc, module=args.module,
                       device=args.device, steps=args.steps, max_forwards=args.max_forwards,
                       timeout=args.job_timeout or DEFAULT_TIMEOUT)
    return ranks_report(traces, args.target), traces, None, None


def _predicted_ranks(args: argparse.Namespace, script_args: list[str]):
    """`run --nproc N --predict`: one rank of each role and rank N-1 (or every rank) predicted;
    the report, the
    traces indexed by rank (a rank not run shows the one it is taken to be), its JSON, and the
    run rank each other rank is taken to be (None: not known)."""
    from ampscope.script.predicted_ranks import DEFAULT_TIMEOUT, predict_ranks, predicted_dict
    from ampscope.script.ranks import report_dict

    report, by_rank, taken = predict_ranks(
        args.target, script_args, args.nproc, all_ranks=args.all_ranks, module=args.module,
        device=args.device, steps=args.steps, max_forwards=args.max_forwards,
        timeout=args.job_timeout or DEFAULT_TIMEOUT)
    first = by_rank[min(by_rank)]
    traces = [by_rank.get(k) or by_rank.get(taken.get(k) or 0, first)
              for k in range(args.nproc)]
    return report, traces, lambda r: predicted_dict(r, taken, report_dict), taken


def _step_reports(result, *, memory: bool, flops: bool, step_time: float | None = None,
                  gpu=None) -> tuple[list, list]:
    """The memory and FLOP reports of a finished trace, those asked for (the FLOPs with
    throughput and MFU for a step time)."""
    from ampscope.api import flops as flop_count
    from ampscope.api import memory as memory_of

    return (([memory_of(result)] if memory else []),
            ([flop_count(result, step_time=step_time, gpu=gpu)] if flops else []))


def _write_report(path: str, traces: list, *, memory: list, flops: list, matrix=None,
                  numerics=None, distributed=None, same_as=None) -> None:
    """The HTML report, written atomically; one line on stderr says where. `distributed` (a
    DistributedReport) adds its ranks, `same_as` the run rank each other rank is taken to be."""
    from ampscope.analysis.compare import build_matrix
    from ampscope.render.html import report_html

    page = report_html(traces, matrix if matrix is not None else build_matrix(traces),
                       memory=memory, flops=flops, numerics=numerics, distributed=distributed,
                       same_as=same_as)
    try:
        write_atomic(path, page)
    except OSError as e:
        raise AmpscopeError(f"cannot write {path}: {e.strerror}") from e
    print(f"Wrote {path}", file=sys.stderr)  # plain: a path must not be wrapped


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
                 lambda: render_matrix(result), table=result.table)


def cmd_report(args: argparse.Namespace) -> int:
    from ampscope.analysis.flops import flop_report
    from ampscope.analysis.memory import memory_report
    from ampscope.analysis.summary import tokens_of
    from ampscope.api import matrix, numerics

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
    if args.json:
        _write_json(json.dumps(result.to_dict(), indent=1), args.json)
    _write_report(args.output, traces, matrix=result,
                  memory=[memory_report(t) for t in traces],
                  flops=[flop_report(t, tokens=tokens_of(t)) for t in traces], numerics=values)
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    if args.distributed:
        return cmd_distributed(args)
    from ampscope.api import memory
    from ampscope.render.memory import render_memory

    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    doing = "Tracing and measuring" if args.measure else "Tracing"
    with _run_progress(f"{doing} the memory of {args.model} under {setting}…"):
        report = memory(args.model, setting=setting, measure=args.measure, **options.as_kwargs())
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_memory(report), table=report.table)


def cmd_flops(args: argparse.Namespace) -> int:
    from ampscope.api import flops
    from ampscope.render.flops import render_flops

    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    doing = "Counting and timing" if args.measure else "Counting"
    with _run_progress(f"{doing} the FLOPs of {args.model} under {setting}…"):
        report = flops(args.model, setting=setting, step_time=args.step_time,
                       measure=args.measure, gpu=args.accelerator, **options.as_kwargs())
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_flops(report), table=report.table)


def cmd_numerics(args: argparse.Namespace) -> int:
    from ampscope.api import numerics
    from ampscope.render.numerics import render_numerics

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
    from ampscope.analysis.format_table import measured_report
    from ampscope.render.formats import render_formats

    # Without values, the facts as measured on this torch build answer without importing torch.
    report = None if args.values else measured_report()
    if report is None:
        from ampscope.analysis.formats import formats_report

        report = formats_report(args.values)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_formats(report))


def cmd_policy(args: argparse.Namespace) -> int:
    from ampscope.api import policy
    from ampscope.render.autocast import render_policy

    report = policy(args.device, args.dtype, op=args.op, compare=args.compare, quiz=args.quiz,
                    history=args.history)
    return _show(args, lambda: json.dumps(report.to_dict(), indent=1),
                 lambda: render_policy(report))


def cmd_train(args: argparse.Namespace) -> int:
    from ampscope.cli.train import cmd_train as train

    return train(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from ampscope.cli.train import cmd_bench as bench

    return bench(args)


def cmd_fit(args: argparse.Namespace) -> int:
    from ampscope.cli.fit import cmd_fit as fit

    return fit(args)


def _check_regular(path: str) -> None:
    if not Path(path).is_file():  # a folder, a FIFO (which would block), a missing file
        raise AmpscopeError(f"cannot read {path}: not a regular file; give a trace written "
                            "with `ampscope trace MODEL --json FILE`")


def _load_trace(path: str):
    from ampscope.records import Trace

    _check_regular(path)
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        return Trace.from_dict(data)
    except OSError as e:
        raise AmpscopeError(f"cannot read {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise AmpscopeError(f"{path} is not a text file; give a trace written with "
                            "`ampscope trace MODEL --json FILE`") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AmpscopeError(f"{path} is not an ampscope trace (write one with "
                            f"`ampscope trace MODEL --json FILE`): {e}") from e


def cmd_diff(args: argparse.Namespace) -> int:
    import os

    from ampscope.analysis.diff import diff_traces
    from ampscope.render.diff import render_diff

    files = [os.path.exists(x) or x.endswith(".json") for x in (args.a, args.b)]
    if all(files):
        for path in (args.a, args.b):
            _check_regular(path)
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
    from ampscope.models.catalog import catalog
    from ampscope.render.models import render_models

    models = catalog()
    return _show(args, lambda: json.dumps(models.to_dict(), indent=1),
                 lambda: render_models(models))

