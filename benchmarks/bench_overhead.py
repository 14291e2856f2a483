"""Per-op cost of ampscope's recorders against PyTorch's DebugMode, on one real train step.

Times one training step (forward + loss, backward, AdamW step) on real tensors, in one process,
three ways:

  untraced   `with applied(setting, module): workloads.run(...)`
  DebugMode  the same inside `torch.utils._debug_mode.DebugMode()` with default options
  ampscope   the same inside a `Capture` (runs/session.py: the module tracker, the function
             and op recorders, the storage tracker), then `capture.finish(...)`: the records as
             `ampscope.trace` builds them (the garbage collector paused meanwhile, as there),
             without planning the run or deriving findings

Each variant runs once to warm up, then `--repeats` rounds run the three, the order rotating
from round to round. The overhead per op is (median − untraced median) / aten ops of the step
(the ops ampscope records; DebugMode sees the same list, tests/test_debugmode_agreement.py),
and the last column is ampscope's overhead over DebugMode's (goal: at most 0.5).

    python benchmarks/bench_overhead.py                    # gpt2-tiny, fp32, seq 64, 1 thread, 21 rounds
    python benchmarks/bench_overhead.py --profile          # cProfile of 20 traced steps instead
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._debug_mode import DebugMode

from ampscope import workloads
from ampscope.api import load
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import Setting, applied, parse_setting
from ampscope.runs.session import Capture, CaptureOptions
from ampscope.runtime.predict import gc_paused

OPTIONS = workloads.RunOptions("train", optimizer="adamw")


def untraced(lm: LoadedModel, batch: Batch, setting: Setting) -> int:
    with applied(setting, lm.module):
        workloads.run(lm, batch, setting, OPTIONS)
    return 0


def debug_mode(lm: LoadedModel, batch: Batch, setting: Setting) -> int:
    with applied(setting, lm.module), DebugMode() as mode:
        workloads.run(lm, batch, setting, OPTIONS)
    return len(mode.operators)


def ampscope_capture(lm: LoadedModel, batch: Batch, setting: Setting) -> int:
    with applied(setting, lm.module):
        capture = Capture(lm.module, CaptureOptions(model_name=lm.name,
                                                    setting=setting.record(), workload="train"))
        with capture.recording():
            outputs = workloads.run(lm, batch, setting, OPTIONS)
        with gc_paused():  # as `ampscope.trace` builds the records (api/tracing.py)
            return len(capture.finish(inputs=batch, outputs=outputs).ops)


VARIANTS: dict[str, Callable[[LoadedModel, Batch, Setting], int]] = {
    "untraced": untraced,
    "DebugMode": debug_mode,
    "ampscope": ampscope_capture,
}


def seconds(run: Callable[[LoadedModel, Batch, Setting], int], lm: LoadedModel, batch: Batch,
            setting: Setting) -> tuple[float, float]:
    """Wall time and this process's CPU time of one run: on a shared machine the CPU time
    leaves out the time other processes held the core (with one thread the two agree when
    the machine is idle)."""
    gc.collect()  # the previous run's garbage is not this run's cost
    wall, cpu = time.perf_counter(), time.process_time()
    run(lm, batch, setting)
    return time.perf_counter() - wall, time.process_time() - cpu


def report(times: dict[str, list[float]], n_ops: int, title: str) -> None:
    base = statistics.median(times["untraced"])
    per_op = {n: (statistics.median(t) - base) / n_ops * 1e6 for n, t in times.items()}
    print(title)
    print(f"{'variant':<10} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'µs/op over':>11} "
          f"{'÷ DebugMode':>12}")
    for name, samples in times.items():
        ratio = "" if name == "untraced" else f"{per_op[name] / per_op['DebugMode']:.2f}"
        print(f"{name:<10} {statistics.median(samples) * 1e3:>10.1f} {min(samples) * 1e3:>8.1f} "
              f"{max(samples) * 1e3:>8.1f} {per_op[name]:>11.1f} {ratio:>12}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--setting", default="fp32")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true",
                        help="profile 20 traced steps with cProfile instead of timing")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    setting = parse_setting(args.setting)
    lm = load(args.model, device=setting.device)  # built once, outside the timings
    batch = lm.make_batch(args.batch, args.seq, "train", torch.Generator().manual_seed(0),
                          device=setting.device)
    n_ops = ampscope_capture(lm, batch, setting)
    n_debug = debug_mode(lm, batch, setting)
    print(f"{lm.name}, train step with adamw, batch {args.batch}, seq {args.seq}, "
          f"{setting.name}, real tensors: {n_ops} aten ops recorded (DebugMode: {n_debug}); "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            ampscope_capture(lm, batch, setting)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return

    names = list(VARIANTS)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        seconds(VARIANTS[name], lm, batch, setting)  # warm-up
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            w, c = seconds(VARIANTS[name], lm, batch, setting)
            wall[name].append(w)
            cpu[name].append(c)
    report(wall, n_ops, f"wall time, median of {args.repeats} rounds")
    report(cpu, n_ops, f"CPU time of this process, median of {args.repeats} rounds")

if __name__ == "__main__":
    main()
