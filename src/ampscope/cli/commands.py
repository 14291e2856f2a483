"""The commands behind `ampscope …`: each parses nothing, calls the library, and renders
(the arguments are defined in cli/parser.py). A registered report's command without a
`cmd_NAME` here is `registered_command`. No analysis lives here."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from functools import partial

from ampscope.cli.check import cmd_check  # noqa: F401 - `ampscope check`, found here by name
from ampscope.cli.common import (
    _console,
    _on_device,
    _progress,
    _run_options,
    _run_progress,
    _show,
    check_regular,
    load_trace,
    one_line,
    show_report,
)
from ampscope.cli.exports import EXPORTS, write_exports
from ampscope.cli.fit import cmd_fit  # noqa: F401 - `ampscope fit`, found here by name
from ampscope.cli.train import cmd_bench, cmd_train  # noqa: F401 - likewise
from ampscope.errors import AmpscopeError
from ampscope.render.report_kinds import REPORTS, kind_of


def cmd_distributed(args: argparse.Namespace) -> int:
    from ampscope.api.gpu_time import predicted_step
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
    options, setting = _one_setting(args)
    nproc = args.nproc or 2
    parallel = Parallel(args.distributed, nproc, **parse_mp_policy(args.mp_policy))
    common = {"setting": setting, "batch": options.batch, "seq": options.seq,
              "optimizer": options.optimizer}
    with _console(stderr=True).status(
            f"{'Running' if args.predict is False else 'Predicting'} {args.model} under "
            f"{args.distributed.upper()} on {nproc} ranks…"):
        if args.predict is not False:  # predicted unless --real, as every other run
            # --gpu (`trace`'s; `memory` has none): the GPU the ranks' emulated cuda device
            # is, as well as the one priced
            report = predict(args.model, parallel, gpu=getattr(args, "accelerator", None),
                             **common)
        else:
            report = launch(args.model, parallel, timeout=args.timeout or 120.0, **common)
    trace = report.trace
    # `trace --distributed` shows rank 0's predicted step (`memory --distributed`: its bytes)
    step = None if trace is None or args.command != "trace" else \
        predicted_step(trace, args.accelerator)
    return _show(args, lambda: render_distributed(report, step), json=report.to_dict,
                 report=None if trace is None else lambda: _page(
                     [trace], _step_reports(trace), distributed=report))


def _one_setting(args: argparse.Namespace):
    """The run options and the one setting (--setting on --device) of `trace`, `memory`,
    `flops` and their --distributed runs."""
    options = _run_options(args)
    [setting] = _on_device([args.setting], args.device)
    return options, setting


def cmd_trace(args: argparse.Namespace) -> int:
    if args.distributed:
        return cmd_distributed(args)
    from ampscope.api import trace

    options, setting = _one_setting(args)
    with _run_progress(f"Tracing {args.model}: {args.workload} under {setting}…"):
        # --gpu: the GPU an emulated cuda setting's code sees, as well as the one it is priced on
        result = trace(args.model, setting=setting, gpu=args.accelerator, **options.as_kwargs())
    return _show_trace(args, result, page=lambda: _page([result], _step_reports(result)))


def _show_trace(args: argparse.Namespace, result, *, page, extra: list | None = None,
                document=None) -> int:
    """`trace` and `run`: the HTML `page`, the timeline, JSON (the trace's, or `document`'s),
    CSV and the rendering (with `extra` renderables after the trace's; the step predicted on
    --gpu in its header, for a cuda setting)."""
    from rich.console import Group

    from ampscope.analysis.summary import trace_summary
    from ampscope.api.gpu_time import predicted_step
    from ampscope.render.text import render_trace

    return _show(args, lambda: Group(render_trace(trace_summary(
        result, ops=args.ops, diagram=args.diagram),
        predicted=predicted_step(result, args.accelerator)), *(extra or [])), report=page,
        perfetto=result, json=document or result.to_dict,
        csv=lambda: result.table("ops" if args.ops else "modules"))


def cmd_run(args: argparse.Namespace) -> int:
    import io

    from ampscope.script import run_script
    from ampscope.script.ending import run_status

    script_args = args.script_args
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    args.model = args.target  # named in one-line errors
    if args.nproc is None and args.job_timeout is not None:
        raise AmpscopeError("--timeout only applies with --nproc N")
    if args.values and (args.predict or args.nproc is not None):
        raise AmpscopeError("--values needs one real run: not with --predict or --nproc")
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
                                max_forwards=args.max_forwards, in_process=True,
                                values=args.values, gpu=args.accelerator)
    if report is not None:  # --gpu's fit verdicts join the report before its JSON, page or view
        from ampscope.distributed.verdicts import verdicts

        report.notes += verdicts(report, args.accelerator)
    shown = {"memory": args.memory, "flops": args.flops or args.step_time is not None}
    reports = _step_reports(result, memory=shown["memory"] or bool(args.report),
                            flops=shown["flops"] or bool(args.report),
                            step_time=args.step_time, gpu=args.accelerator)
    page = partial(_page, [result], reports, distributed=report, same_as=same_as)
    extra = [kind_of(r).load("view")(r) for r in reports if shown[kind_of(r).name]]
    if report is not None:
        from ampscope.render.ranks import render_ranks
        from ampscope.script.ranks import report_dict

        extra.append(render_ranks(report, traces,
                                  predicted=_rank_steps(traces or [], args.accelerator)))
        return _show_trace(args, result, page=page, extra=extra,
                           document=lambda: (to_dict or report_dict)(report))
    # The trace shown, the command ends as the script did (its own sys.exit(n) or os._exit(n)).
    return _show_trace(args, result, page=page, extra=extra) or run_status(result)


def _rank_steps(traces: list, gpu) -> list:
    """Each rank's step predicted on `gpu` (None where it has none), computed once per trace:
    the ranks a predicted job did not run show the trace of the rank they are taken to be."""
    from ampscope.api.gpu_time import predicted_step

    done: dict[int, object] = {}
    for t in traces:
        if id(t) not in done:
            done[id(t)] = predicted_step(t, gpu)
    return [done[id(t)] for t in traces]


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
                       timeout=args.job_timeout or DEFAULT_TIMEOUT, gpu=args.accelerator)
    return ranks_report(traces, args.target), traces, None, None


def _predicted_ranks(args: argparse.Namespace, script_args: list[str]):
    """`run --nproc N --predict`: one rank of each role and rank N-1 (or every rank) predicted;
    the report, the traces indexed by rank (a rank not run shows the one it is taken to be),
    its JSON, and the run rank each other rank is taken to be (None: not known)."""
    from ampscope.script.predicted_ranks import DEFAULT_TIMEOUT, predict_ranks, predicted_dict
    from ampscope.script.ranks import report_dict

    report, by_rank, taken = predict_ranks(
        args.target, script_args, args.nproc, all_ranks=args.all_ranks, module=args.module,
        device=args.device, steps=args.steps, max_forwards=args.max_forwards,
        timeout=args.job_timeout or DEFAULT_TIMEOUT, gpu=args.accelerator)
    first = by_rank[min(by_rank)]
    traces = [by_rank.get(k) or by_rank.get(taken.get(k) or 0, first)
              for k in range(args.nproc)]
    return report, traces, lambda r: predicted_dict(r, taken, report_dict), taken


def _step_reports(result, *, memory: bool = True, flops: bool = True,
                  step_time: float | None = None, gpu=None) -> list:
    """The memory and FLOP reports of a finished trace, those asked for (the FLOPs with
    throughput and MFU for a step time)."""
    from ampscope.api.reports import flops as flop_count
    from ampscope.api.reports import memory as memory_of

    return (([memory_of(result)] if memory else []) +
            ([flop_count(result, step_time=step_time, gpu=gpu)] if flops else []))


def _page(traces: list, reports, *, matrix=None, **more) -> str:
    """The HTML report of `traces` with `reports`' sections (`more`: as for `report_html`)."""
    from ampscope.analysis.compare import build_matrix
    from ampscope.render.html import report_html

    return report_html(traces, matrix if matrix is not None else build_matrix(traces),
                       reports=reports, **more)


@contextlib.contextmanager
def _runs(args: argparse.Namespace, total: int) -> Iterator[Callable[..., Callable]]:
    """A bar over `total` runs of the model; yields `on_run(start, label)`: the `on_setting`
    callback of the runs counted from `start`, each described as `label` and the setting."""
    progress = _progress()
    with progress:
        task = progress.add_task(f"Building {args.model}…", total=total)

        def on_run(start: int = 0, label: str = f"{args.workload} under ") -> Callable:
            return lambda i, name: progress.update(task, completed=start + i,
                                                   description=label + name)

        yield on_run


def _settings(args: argparse.Namespace, example: str) -> list[str]:
    """--settings, split, each on --device; refused when empty."""
    settings = _on_device([s.strip() for s in args.settings.split(",") if s.strip()], args.device)
    if not settings:
        raise AmpscopeError(f"--settings needs at least one setting, e.g. {example}")
    return settings


def _matrix(args: argparse.Namespace, numerics: bool = False):
    """`matrix` and `report`: the model under every --settings, with one bar over the runs;
    with `numerics`, then each setting's divergence from fp64. The matrix, its traces and
    the numerics report (or None)."""
    from ampscope.api import matrix
    from ampscope.api.reports import numerics as divergence

    options = _run_options(args)
    settings = _settings(args, "fp32,fp32+amp-bf16")
    with _runs(args, len(settings) + (len(settings) + 1 if numerics else 0)) as on_run:
        result, traces = matrix(args.model, settings=settings, on_setting=on_run(),
                                gpu=getattr(args, "accelerator", None),
                                **options.as_kwargs())
        values = divergence(args.model, settings=settings, workload=args.workload,
                            batch=args.batch, seq=args.seq, optimizer=args.optimizer,
                            on_setting=on_run(len(settings), "numerics: ")) if numerics else None
    return result, traces, values


def cmd_matrix(args: argparse.Namespace) -> int:
    from ampscope.render.matrix import render_matrix

    result, _, _ = _matrix(args)
    _show(args, lambda: render_matrix(result), json=result.to_dict, csv=result.table)
    return _matrix_status(result)


def _matrix_status(result) -> int:
    """0, or 2 where a setting of `result` (a matrix: `matrix`'s, `report`'s) failed. The table
    (or the page, --json, --csv) says it too, but a script or CI job reads the status and
    stderr: a setting that failed is a failed command, named in one line, as any error is."""
    if not result.failures:
        return 0
    print(f"ampscope: error: {one_line(_failed_settings(result.failures, len(result.columns)))}",
          file=sys.stderr)
    return 2


def _failed_settings(failures: tuple[tuple[str, str], ...], asked: int) -> str:
    """The settings of a matrix that failed, and why, in one line: their names first, so that
    a long reason cut at the line's end never hides which."""
    names = ", ".join(name for name, _ in failures)
    return (f"{len(failures)} of {asked} settings failed ({names}): "
            + "; ".join(f"{name}: {why}" for name, why in failures))


def cmd_report(args: argparse.Namespace) -> int:
    if args.numerics and args.workload not in ("forward", "train"):
        raise AmpscopeError("--numerics compares the forward or train workload, not "
                            f"{args.workload}")
    result, traces, values = _matrix(args, numerics=args.numerics)
    write_exports(args, json=result.to_dict)
    reports = [r for t in traces for r in _step_reports(t)]
    reports += [values] if values is not None else []
    EXPORTS["report"].write(lambda: _page(traces, reports, matrix=result), args.output)
    return _matrix_status(result)


def cmd_memory(args: argparse.Namespace) -> int:
    if args.distributed:
        return cmd_distributed(args)
    return _traced_report(args, "Tracing and measuring" if args.measure else "Tracing", "memory")


def cmd_flops(args: argparse.Namespace) -> int:
    return _traced_report(args, "Counting and timing" if args.measure else "Counting", "FLOPs",
                          step_time=args.step_time, gpu=args.accelerator)


def _traced_report(args: argparse.Namespace, doing: str, what: str, **more) -> int:
    """`memory`, `flops`: the report of one traced step, by the function registered for it."""
    options, setting = _one_setting(args)
    with _run_progress(f"{doing} the {what} of {args.model} under {setting}…"):
        report = REPORTS[args.command].load("api")(args.model, setting=setting,
                                                   measure=args.measure, **more,
                                                   **options.as_kwargs())
    return show_report(args, report)


def cmd_numerics(args: argparse.Namespace) -> int:
    from ampscope.api.reports import numerics

    settings = _settings(args, "fp32+amp-bf16,bf16")
    with _runs(args, len(settings) + 1) as on_run:
        report = numerics(args.model, settings=settings, reference=args.reference,
                          workload=args.workload, batch=args.batch, seq=args.seq,
                          on_setting=on_run())
    return show_report(args, report, all_modules=args.all)


def cmd_formats(args: argparse.Namespace) -> int:
    from ampscope.analysis.format_table import measured_report

    # Without values, the facts as measured on this torch build answer without importing torch.
    report = None if args.values else measured_report()
    return show_report(args, report or REPORTS["formats"].load("api")(args.values))


def registered_command(args: argparse.Namespace) -> int:
    """A registered report's command without a `cmd_NAME` of its own (`policy`): its function,
    called with the command's arguments of the same names, then shown."""
    make = REPORTS[args.command].load("api")
    names = [n for n in inspect.signature(make).parameters if hasattr(args, n)]
    return show_report(args, make(**{n: getattr(args, n) for n in names}))


def cmd_diff(args: argparse.Namespace) -> int:
    import os

    from ampscope.analysis.diff import diff_traces
    from ampscope.api.gpu_time import predicted_step
    from ampscope.render.diff import render_diff

    files = [os.path.exists(x) or x.endswith(".json") for x in (args.a, args.b)]
    if all(files):
        for path in (args.a, args.b):
            check_regular(path)
        a, b = load_trace(args.a), load_trace(args.b)
        predicted = (predicted_step(a, args.accelerator), predicted_step(b, args.accelerator))
    elif any(files):
        raise AmpscopeError("give two trace files or two settings, not one of each")
    else:
        from ampscope.api import matrix

        options = _run_options(args)
        settings = _on_device([args.a, args.b], args.device)
        with _console(stderr=True).status(f"Tracing {args.model} under {args.a} and {args.b}…"):
            both, (a, b) = matrix(args.model, settings=settings, gpu=args.accelerator,
                                  **options.as_kwargs())
        predicted = (both.predicted[0], both.predicted[1])
    result = diff_traces(a, b, predicted)
    return _show(args, lambda: render_diff(result, args.a, args.b, ops=args.ops),
                 json=result.to_dict)


def cmd_models(args: argparse.Namespace) -> int:
    from ampscope.models.catalog import catalog
    from ampscope.render.models import render_models

    models = catalog()
    return _show(args, lambda: render_models(models), json=models.to_dict)

