"""How much slower is a train step when ampscope traces it? Compared with PyTorch's DebugMode.

Times one training step (forward + loss under the setting's autocast, backward, optimizer step)
three ways, on one model built once:

  untraced   `with applied(setting, module): workloads.run(...)`
  DebugMode  the same, inside `torch.utils._debug_mode.DebugMode()` with default options
  ampscope   the whole `ampscope.trace(lm, batch, setting=..., workload="train")` call

All three go through `applied()` (working copies of every parameter and buffer, restored
afterwards) and `workloads.run` (a fresh optimizer each step), so the only difference is the
observer. Each variant runs once to warm up, then `--repeats` rounds run the three in turn (the
order rotates from round to round so no variant always follows another); the median wall time
is reported, with its ratio over the untraced median.

    python benchmarks/bench_trace.py                       # gpt2, batch 1, seq 256, fp32+amp-bf16
    python benchmarks/bench_trace.py --model gpt2-tiny --seq 64 --repeats 3

Wall times on a shared machine are only as good as its quietest minutes: with two cores and two
intra-op threads, one other busy process can make a step several times slower (the OpenMP
threads wait for each other). Look at the per-round lines: rounds far above the others were
disturbed. `--threads 1` is less sensitive to one competing process.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._debug_mode import DebugMode

import ampscope
from ampscope import workloads
from ampscope.api import load
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import Setting, applied, parse_setting

WORKLOAD = "train"
OPTIMIZER = "adamw"
OPTIONS = workloads.RunOptions(WORKLOAD, optimizer=OPTIMIZER)


def untraced(lm: LoadedModel, batch: Batch, setting: Setting) -> None:
    with applied(setting, lm.module):
        workloads.run(lm, batch, setting, OPTIONS)


def debug_mode(lm: LoadedModel, batch: Batch, setting: Setting) -> None:
    with applied(setting, lm.module), DebugMode():
        workloads.run(lm, batch, setting, OPTIONS)


def traced(lm: LoadedModel, batch: Batch, setting: Setting) -> None:
    ampscope.trace(lm, batch, setting=setting, workload=WORKLOAD, optimizer=OPTIMIZER)


VARIANTS: dict[str, Callable[[LoadedModel, Batch, Setting], None]] = {
    "untraced": untraced,
    "DebugMode": debug_mode,
    "ampscope": traced,
}


def seconds(run: Callable[[LoadedModel, Batch, Setting], None], lm: LoadedModel, batch: Batch,
            setting: Setting) -> float:
    gc.collect()  # the previous run's garbage is not this run's cost
    start = time.perf_counter()
    run(lm, batch, setting)
    return time.perf_counter() - start


def measure(lm: LoadedModel, batch: Batch, setting: Setting, repeats: int,
            log: Callable[[str], None]) -> dict[str, list[float]]:
    names = list(VARIANTS)
    for name in names:
        log(f"warm-up {name}: {seconds(VARIANTS[name], lm, batch, setting) * 1e3:.0f} ms")
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(seconds(VARIANTS[name], lm, batch, setting))
        log(f"round {r + 1}/{repeats}: " + ", ".join(
            f"{n} {times[n][-1] * 1e3:.0f} ms" for n in names))
    return times


def table(times: dict[str, list[float]], title: str):
    from rich.table import Table

    base = statistics.median(times["untraced"])
    t = Table(title=title)
    for column in ("variant", "median ms/step", "min ms", "max ms", "× untraced"):
        t.add_column(column, justify="left" if column == "variant" else "right")
    for name, samples in times.items():
        median = statistics.median(samples)
        t.add_row(name, f"{median * 1e3:.0f}", f"{min(samples) * 1e3:.0f}",
                  f"{max(samples) * 1e3:.0f}", f"{median / base:.2f}×")
    return t


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--setting", default="fp32+amp-bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own, one per core)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from rich.console import Console

    console = Console()
    setting = parse_setting(args.setting)
    lm = load(args.model, device=setting.device)  # built once, outside the timings
    batch = lm.make_batch(args.batch, args.seq, WORKLOAD, torch.Generator().manual_seed(0),
                          device=setting.device)
    n_ops = len(ampscope.trace(lm, batch, setting=setting, workload=WORKLOAD).ops)
    console.print(
        f"{lm.name} ({lm.num_parameters / 1e6:.1f}M parameters), {WORKLOAD} step with "
        f"{OPTIMIZER}, batch {args.batch}, seq {args.seq}, {setting.name}: {n_ops} aten ops; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    times = measure(lm, batch, setting, args.repeats, console.print)
    console.print(table(times, f"{lm.name} train step, median of {args.repeats}"))


if __name__ == "__main__":
    main()
