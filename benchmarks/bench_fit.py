"""`ampscope fit` against one predicted `ampscope memory` run of the same step, in one process.

    python benchmarks/bench_fit.py                                # llama-3-8b, h100, bf16, seq 4096
    python benchmarks/bench_fit.py --model gpt2 --gpu rtx4090 --seq 1024 --repeats 3

In each round, in this order: one predicted memory run at batch 1 (`ampscope.memory(MODEL,
predict=True)`, the model built from its name as the command builds it), `ampscope.fit` with
`variants=False` (the search alone) and `ampscope.fit` with its variants. One warm-up memory run
comes first (imports, PyTorch's fake-tensor caches). The table gives the median wall time of
each, its ratio over the memory run, and the predicted runs each fit made; a last line times
the whole command, `ampscope fit ...`, as a fresh process (Python start-up and imports
included), against the goal of 10 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--setting", default="bf16")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    import ampscope

    setting = f"cuda:{args.setting}" if ":" not in args.setting else args.setting

    def memory_run() -> int:
        ampscope.memory(args.model, setting=setting, seq=args.seq, predict=True)
        return 1

    def fit(variants: bool):
        def run() -> int:
            report = ampscope.fit(args.model, gpu=args.gpu, setting=setting, seq=args.seq,
                                  variants=variants)
            return len(report.probes)
        return run

    variants = {"one predicted memory run": memory_run, "fit, the search alone": fit(False),
                "fit, with its variants": fit(True)}
    memory_run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    runs: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, call in variants.items():
            start = time.perf_counter()
            runs[name] = call()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["one predicted memory run"])
    print(f"{args.model}, --gpu {args.gpu}, -s {args.setting}, --seq {args.seq}; "
          f"{args.repeats} round(s), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print()
    print("| what | median s | min s | max s | predicted runs | × one memory run |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in times.items():
        median = statistics.median(t)
        print(f"| {name} | {median:.1f} | {min(t):.1f} | {max(t):.1f} | {runs[name]} | "
              f"{median / base:.2f}× |")
    command = [str(BIN / "ampscope"), "fit", args.model, "--gpu", args.gpu, "-s", args.setting,
               "--seq", str(args.seq)]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    print()
    print(f"`{' '.join(['ampscope', *command[1:]])}` as a fresh process: "
          f"{time.perf_counter() - start:.1f} s wall (goal: 10 s)")


if __name__ == "__main__":
    main()
