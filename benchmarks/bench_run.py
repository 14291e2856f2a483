"""The cost of `ampscope run` against the plain `python` run of the same script, one step.

Both run examples/gpt/train.py as whole processes on this machine's CPU, for one optimizer
step: `python train.py --max_iters=1 ...` and `ampscope run --steps 1 train.py ...` (which
stops the script after its first step). Rounds alternate the two; the table gives each one's
median wall time and the ratio of the medians. Process start-up (importing torch) is in both.

    .venv/bin/python benchmarks/bench_run.py             # 5 rounds, the default size below
    .venv/bin/python benchmarks/bench_run.py --rounds 3 --n_layer 2 --n_embd 64
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "gpt" / "train.py"
AMPSCOPE = Path(sys.executable).parent / "ampscope"


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        settings = [f"--data_dir={data}", f"--n_layer={args.n_layer}", f"--n_embd={args.n_embd}",
                    f"--block_size={args.block_size}", f"--batch_size={args.batch_size}",
                    "--device=cpu"]
        plain = [sys.executable, str(SCRIPT), "--max_iters=1", *settings]
        traced = [str(AMPSCOPE), "run", "--steps", "1", str(SCRIPT), *settings]
        timed(plain)  # warm-up: writes the data file, warms the page cache
        timed(traced)
        times: dict[str, list[float]] = {"python": [], "ampscope run": []}
        for i in range(args.rounds):
            order = [("python", plain), ("ampscope run", traced)]
            for name, command in order if i % 2 == 0 else reversed(order):
                times[name].append(timed(command))
    base = statistics.median(times["python"])
    print(f"examples/gpt/train.py, 1 step: n_layer {args.n_layer}, n_embd {args.n_embd}, "
          f"block {args.block_size}, batch {args.batch_size}, cpu; {args.rounds} rounds")
    print(f"{'command':<14} {'median s':>9} {'min s':>7} {'max s':>7} {'× python':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<14} {median:>9.2f} {min(values):>7.2f} {max(values):>7.2f} "
              f"{median / base:>8.2f}×")


if __name__ == "__main__":
    main()
