"""The command line's arguments: one parser, a function per command. Nothing here imports
torch: `--help`, `--version` and argument errors answer at once."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import NoReturn

from ampscope.cli.examples import add_examples
from ampscope.cli.exports import add_exports
from ampscope.cli.fit import add_fit_parser
from ampscope.cli.hardware import add_hardware_arguments
from ampscope.cli.train import add_bench_parser, add_train_parser
from ampscope.defaults import (
    DEFAULT_MATRIX_SETTINGS,
    DEFAULT_MODEL,
    DEFAULT_NUMERICS_SETTINGS,
    DEFAULT_SETTING,
    MAX_FORWARDS,
    MAX_FORWARDS_NO_OPTIMIZER,
)
from ampscope.hardware.device_types import DEVICE_TYPES
from ampscope.render.report_kinds import REPORTS


class _UsageError(Exception):
    """What argparse would print under its usage block before exiting."""


class _Parser(argparse.ArgumentParser):
    """argparse answers a bad command line with its whole usage block and an exit: here, one
    line that names the command's --help instead, and `main` returns 2 (subparsers are made of
    this class too)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


# A model made by the user's own factory keeps the parameter dtypes it chose (its own bf16
# embedding, say), as in the user's training script; the built-in models take the usual fp32.
_SETTING_DEFAULT = (f"default: {DEFAULT_SETTING}; native+amp-bf16, every parameter as the "
                    "model made it, for a package.module:factory")


def default_setting(model: str) -> str:
    """The setting a command runs `model` under when none is given."""
    factory = ":" in model and not model.startswith("hf:")
    return "native+amp-bf16" if factory else DEFAULT_SETTING


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ampscope",
        description="Which precision does every tensor of a PyTorch model really run in?",
    )
    parser.add_argument("--version", action=_Version,
                        help="show ampscope's version and exit (with -v: the torch build and "
                             "which speed tricks it allows)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command")
    _add_trace(sub)
    _add_run(sub)
    _add_check(sub)  # ampscope check: the precision mistakes of a run (cli/check.py runs it)
    _add_matrix(sub)
    _add_report(sub)
    _add_diff(sub)
    for kind in REPORTS.values():  # memory, flops, numerics, formats, policy: render/report_kinds.py
        command = sub.add_parser(kind.name, help=kind.help)
        if kind.arguments is not None:
            kind.load("arguments")(command)
        add_exports(command)  # those its arguments did not place
    add_train_parser(sub)  # ampscope train: the reference trainer (cli/train.py)
    add_bench_parser(sub)  # ampscope bench: the precision ladder
    add_fit_parser(sub)  # ampscope fit: the largest batch that fits a GPU (cli/fit.py)
    _add_models(sub)
    add_examples(parser, sub.choices)  # every command's --help ends with examples (examples.py)
    _add_global_flags(parser, sub.choices)
    return parser


# --gpu of the commands that show a predicted step and nothing else of a GPU.
_PREDICTED_GPU = ("the GPU a cuda setting's step is predicted on (time, tokens/s, MFU) and, "
                  "emulated, the device its code sees, e.g. a100, h100 (default: this "
                  "machine's GPU; h100 for emulated cuda)")


def _add_trace(sub) -> None:
    trace = sub.add_parser("trace", help="trace one workload of a model under one setting")
    _add_one_setting(trace, ", e.g. fp32, bf16, fp32+amp-bf16, native+amp-bf16, fp32+tf32")
    trace.add_argument("--ops", action="store_true", help="add the op-level listing")
    trace.add_argument("--diagram", action="store_true",
                       help="draw the dtype flow of one forward pass, one block drawn once")
    add_exports(trace, "report", "csv", "perfetto")
    _add_distributed_arguments(trace)
    add_hardware_arguments(trace, memory=False, gpu_help=_PREDICTED_GPU)


def _add_script_arguments(parser: argparse.ArgumentParser) -> None:
    """What `run` and `check` both take to run a script: the device it sees, when it stops,
    and whether its weights are fake."""
    parser.add_argument("--device", "-d", choices=list(DEVICE_TYPES),
                     help="the device the script should see; one this machine lacks is virtual "
                          "(default: this machine's)")
    parser.add_argument("--steps", type=int, default=1,
                     help="stop after this many optimizer steps (default: %(default)s)")
    parser.add_argument("--max-forwards", type=int, metavar="N",
                     help="stop a script that runs N forward passes of its model without an "
                          "optimizer step (a sampler, a loop that never steps); 0: no bound "
                          f"(default: {MAX_FORWARDS_NO_OPTIMIZER} while it has made no "
                          f"optimizer, {MAX_FORWARDS} once it has)")
    parser.add_argument("--predict", action="store_true",
                     help="every weight becomes a fake tensor as the model registers it: any "
                          "size, no memory (the data stays real)")


def _add_run(sub) -> None:
    run = sub.add_parser(
        "run", help="run your own script, unmodified, and trace its model (on a device this "
                    "machine lacks, a virtual one)",
        description="Run a training or sampling script as `python SCRIPT ARGS` would, stop it\n"
                    "after --steps optimizer steps, and trace the model it runs.")
    _add_script_arguments(run)
    run.add_argument("--exact", action="store_true",
                     help="with --predict: every speed trick off (same result, slower)")
    run.add_argument("-m", dest="module", action="store_true",
                     help="TARGET is a module name, run as `python -m TARGET`")
    run.add_argument("--nproc", type=int, metavar="N",
                     help="run a torchrun-style script as N real ranks on this machine (1-8; "
                          "gloo, whatever backend it names) and add each rank's collectives; "
                          "with --predict: N up to 4096, predicted on PyTorch's fake process "
                          "group: rank 0, the first rank of each role (ranks whose shards have "
                          "the same shapes) and rank N-1")
    run.add_argument("--all-ranks", action="store_true",
                     help="with --nproc N --predict: predict every rank, not one of each role "
                          "(to check that the others are the same)")
    run.add_argument("--timeout", dest="job_timeout", type=float, metavar="SECONDS",
                     help="with --nproc: seconds the whole job may take (default: 300)")
    run.add_argument("--values", action="store_true",
                     help="also check what the values say (inf/NaN, activations near the "
                          "format's limit, 16-bit updates that round away; not with --predict)")
    run.add_argument("--quiet", "-q", action="store_true", help="hide the script's own output")
    run.add_argument("--ops", action="store_true", help="add the op-level listing")
    run.add_argument("--diagram", action="store_true",
                     help="draw the dtype flow of one forward pass")
    add_exports(run, "json")
    run.add_argument("--memory", action="store_true",
                     help="add the memory report of the captured steps")
    run.add_argument("--flops", action="store_true",
                     help="add the FLOP count of the captured steps")
    run.add_argument("--step-time", type=float, metavar="SECONDS",
                     help="measured wall time of the captured steps, for throughput and MFU "
                          "(implies --flops)")
    add_hardware_arguments(run, memory=False,
                           gpu_help="the GPU a cuda run's step is predicted on, the device "
                                    "an emulated run's script sees, and with --step-time the "
                                    "one whose peak FLOP/s MFU uses, e.g. h100 (default: this "
                                    "machine's GPU; h100 for emulated cuda); "
                                    "with --nproc also the GPU whose memory each rank's peak "
                                    "is held against")
    add_exports(run, "report", "csv", "perfetto")
    run.add_argument("target", metavar="TARGET", help="the script (or, with -m, the module)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                     help="the script's own arguments ('--' first if they could be read as "
                          "ampscope's)")


def _add_check(sub) -> None:
    check = sub.add_parser(
        "check", help="run your script (or read a saved trace) and name the precision "
                      "mistakes in it: id, severity, evidence and fix",
        description="Run a training script as `ampscope run` does (or read a trace written "
                    "with --json) and\nreport what the checks find. Exits 1 when an error is "
                    "found (with --strict: a warning too).")
    _add_script_arguments(check)
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


def _add_matrix(sub) -> None:
    matrix = sub.add_parser("matrix", help="one workload under several settings, side by side")
    _add_settings(matrix, DEFAULT_MATRIX_SETTINGS)
    _add_run_arguments(matrix)
    add_exports(matrix, "csv")
    add_hardware_arguments(matrix, memory=False, gpu_help=_PREDICTED_GPU)


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="one self-contained HTML page: findings, dtype flow, "
                                           "settings matrix, memory and FLOPs")
    _add_settings(report, DEFAULT_MATRIX_SETTINGS)
    _add_run_arguments(report)
    report.add_argument("--numerics", action="store_true",
                        help="add each setting's divergence from an fp64 run, layer by layer "
                             "(real runs of the forward or train workload)")
    report.add_argument("--output", "-o", default="report.html", metavar="PATH",
                        help="the HTML file to write (default: %(default)s)")


def _add_diff(sub) -> None:
    diff = sub.add_parser("diff", help="what changed dtype between two traces or two settings")
    diff.add_argument("a", help="a trace JSON file (from --json), or a setting")
    diff.add_argument("b", help="a trace JSON file, or a setting")
    diff.add_argument("--model", "-m", default=DEFAULT_MODEL,
                      help="model to trace when A and B are settings (default: %(default)s)")
    _add_run_arguments(diff)
    diff.add_argument("--ops", action="store_true", help="add the ops that changed dtype")
    add_hardware_arguments(diff, memory=False, gpu_help=_PREDICTED_GPU)


def memory_arguments(memory: argparse.ArgumentParser) -> None:
    _add_one_setting(memory)
    memory.add_argument("--measure", action="store_true",
                        help="also run the step untraced and show its measured peak beside "
                             "the prediction (a real CUDA device or the CPU)")
    add_exports(memory, "csv")
    _add_distributed_arguments(memory)


def flops_arguments(flops: argparse.ArgumentParser) -> None:
    _add_one_setting(flops)
    timing = flops.add_mutually_exclusive_group()
    timing.add_argument("--step-time", type=float, metavar="SECONDS",
                        help="measured wall time of one step, for throughput and MFU")
    timing.add_argument("--measure", action="store_true",
                        help="time the untraced step on this machine (a real device only)")
    add_hardware_arguments(flops, memory=False,
                           gpu_help="the GPU a cuda setting's step is predicted on, whose "
                                    "peak FLOP/s MFU uses and, emulated, the device its code "
                                    "sees, e.g. h100, a100 (default: this machine's GPU; h100 "
                                    "for emulated cuda)")


def numerics_arguments(numerics: argparse.ArgumentParser) -> None:
    _add_settings(numerics, DEFAULT_NUMERICS_SETTINGS)
    numerics.add_argument("--reference", default="fp64", choices=["fp64", "fp32"],
                          help="the setting every other is compared with (default: %(default)s)")
    numerics.add_argument("--workload", "-w", default="forward", choices=["forward", "train"],
                          help="train adds the loss's and the gradients' divergence "
                               "(default: %(default)s)")
    numerics.add_argument("--batch", "-b", type=int, default=1, help="default: %(default)s")
    numerics.add_argument("--seq", "-t", type=int, default=64, help="default: %(default)s")
    numerics.add_argument("--device", "-d", choices=list(DEVICE_TYPES),
                          help="device of every setting without a DEVICE: prefix (emulated "
                               "when absent: CUDA's dtypes, the CPU's kernels)")
    numerics.add_argument("--all", action="store_true", help="every module, not only blocks")


def formats_arguments(formats: argparse.ArgumentParser) -> None:
    formats.add_argument("values", nargs="*", metavar="VALUE",
                         help="decimal values to store in every format, e.g. 1e-8 65504 0.1 nan "
                              "-inf")


def policy_arguments(policy: argparse.ArgumentParser) -> None:
    policy.add_argument("--device", "-d", choices=list(DEVICE_TYPES), default="cpu",
                        help="device whose policy to show (default: %(default)s)")
    policy.add_argument("--dtype", choices=["bf16", "fp16"],
                        help="autocast dtype (default: the device's own default)")
    policy.add_argument("--op", metavar="NAME", help="only ops whose name contains NAME")
    policy.add_argument("--compare", nargs=2, metavar=("DEV1", "DEV2"),
                        help="only the ops where two devices' policies differ")
    policy.add_argument("--quiz", action="store_true",
                        help="what x.sum(), x.mean(), softmax, ... return on cpu, cuda and mps")
    policy.add_argument("--history", action="store_true",
                        help="how the device's policy changed in earlier PyTorch releases, for "
                             "the ops GPT-style models call (with the pull request of each)")


def _add_models(sub) -> None:
    add_exports(sub.add_parser("models", help="list the built-in models and the HF zoo"))


class _Version(argparse.Action):
    """--version, with the version read only when asked (importlib.metadata is slow to load)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import ampscope

        print(f"{parser.prog} {ampscope.__version__}")
        parser.exit()


_GLOBAL_FLAGS = ("--debug", "-v", "--verbose")  # taken before or after the command


def _add_global_flags(parser: argparse.ArgumentParser,
                      commands: Mapping[str, argparse.ArgumentParser]) -> None:
    """-v/--verbose and --debug on the top level and on every command: either place (SUPPRESS:
    a command's own default keeps the top level's value)."""
    help_text = "show the decisions ampscope makes (predicted or real, emulated, fallbacks)"
    parser.add_argument("-v", "--verbose", action="store_true", help=help_text)
    for command in commands.values():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=argparse.SUPPRESS)
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help=help_text)


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="model spec: a name from `ampscope models`, hf:PATH, or "
                             "package.module:factory (default: %(default)s)")


def _add_one_setting(parser: argparse.ArgumentParser, examples: str = "") -> None:
    """`trace`, `memory`, `flops`: the model, its one --setting and the run's arguments."""
    _add_model_argument(parser)
    parser.add_argument("--setting", "-s",
                        help=f"precision setting{examples} ({_SETTING_DEFAULT})")
    _add_run_arguments(parser)


def _add_settings(parser: argparse.ArgumentParser, default: tuple[str, ...]) -> None:
    """`matrix`, `report`, `numerics`: the model and the --settings it runs under."""
    _add_model_argument(parser)
    parser.add_argument("--settings", default=",".join(default),
                        help="comma-separated settings (default: %(default)s)")


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
    parser.add_argument("--checkpoint", action="store_true",
                        help="train: recompute each block's activations in backward "
                             "(torch.utils.checkpoint around every repeated block)")
    parser.add_argument("--optimizer-impl", choices=["for-loop", "foreach", "fused"],
                        help="how the optimizer updates its parameters (default: PyTorch's "
                             "choice on the device: foreach on cuda)")
    parser.add_argument("--device", "-d", choices=list(DEVICE_TYPES),
                        help="device of every setting without a DEVICE: prefix; a device this "
                             "machine lacks is emulated on the CPU")
    parser.add_argument("--predict", action=argparse.BooleanOptionalAction, default=None,
                        help="run on fake tensors: no memory, any model size (the default, "
                             "unless the model reads a tensor's value)")
    parser.add_argument("--real", dest="predict", action="store_false",
                        help="run the step on real tensors (as --no-predict)")
    parser.add_argument("--exact", "--every-block", dest="exact", action="store_true",
                        help="predicted: take the exact path, every speed trick off: dispatch "
                             "every repeated block, foreach entry and op instead of replaying "
                             "identical ones and answering known ones (same result, slower)")
    add_exports(parser, "json")


def _add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--distributed", choices=["ddp", "fsdp"],
                        help="run the train step under DDP or FSDP2 on --nproc ranks (real "
                             "processes; with --predict, rank 0 of N on a fake process group)")
    parser.add_argument("--nproc", type=int, help="ranks (default: 2)")
    parser.add_argument("--mp-policy", metavar="POLICY",
                        help="FSDP2 MixedPrecisionPolicy, e.g. param=bf16,reduce=fp32 "
                             "(DDP: reduce= only, a compress hook)")
    parser.add_argument("--timeout", type=float,
                        help="seconds a real distributed run may take (default: 120)")


def _values_after_dashes(argv: list[str]) -> list[str]:
    """`ampscope formats -inf -1e-8`: argparse reads "-inf" and "-1e-8" as unknown options (it
    only knows plain negative numbers like -2), so move the values behind a "--"."""
    leading = ([a for a in argv[:argv.index("formats")] if a in _GLOBAL_FLAGS]
               if "formats" in argv else [])
    if argv[len(leading):len(leading) + 1] != ["formats"] or "--" in argv:
        return argv
    options, values, rest = [*leading], [], iter(argv[len(leading) + 1:])
    for arg in rest:
        if arg == "--json":
            options += [arg, next(rest, "")]
        elif arg.startswith("--") or arg in ("-h", "-v"):
            options.append(arg)
        else:
            values.append(arg)
    global_options = [o for o in options if o in leading]
    options = options[len(global_options):]
    return [*global_options, "formats", *options, "--", *values]
