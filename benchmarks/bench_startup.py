"""Start-up: the answers that need no model, against importing torch, in one run.

Each command runs in its own fresh process (wall time includes Python's start-up and imports),
alternating in each round after one warm-up of each:

  import torch         `python -c "import torch"`: what every command paid before the CLI
                       stopped importing torch for these answers
  ampscope --help      the top-level help
  ampscope trace -h    one command's help
  ampscope --version
  ampscope models      the model table (read from data, nothing built)
  ampscope formats     the number formats (the facts measured on this torch build)
  argument error       `ampscope trace --batch x`: the one-line usage error

    python benchmarks/bench_startup.py               # 11 rounds
    python benchmarks/bench_startup.py --repeats 21

The table gives median, min and max wall seconds and the median's ratio over `import torch`.
Goal (issue "Answers in seconds"): `ampscope --help` ≤ 0.3 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
AMPSCOPE = str(BIN / "ampscope")
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "ampscope --help": [AMPSCOPE, "--help"],
    "ampscope trace -h": [AMPSCOPE, "trace", "-h"],
    "ampscope --version": [AMPSCOPE, "--version"],
    "ampscope models": [AMPSCOPE, "models"],
    "ampscope formats": [AMPSCOPE, "formats"],
    "argument error": [AMPSCOPE, "trace", "--batch", "x"],
}


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    for argv in COMMANDS.values():  # warm the file cache
        wall(argv)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            times[name].append(wall(argv))
    base = statistics.median(times["import torch"])
    print("| command            | median s | min s | max s | × import torch |")
    print("|--------------------|---------:|------:|------:|---------------:|")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"| {name:<18} | {median:8.3f} | {min(ts):5.3f} | {max(ts):5.3f} | "
              f"{median / base:13.2f}× |")


if __name__ == "__main__":
    main()
