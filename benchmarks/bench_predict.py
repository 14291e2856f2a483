"""Predict mode at scale: tracing a model far larger than the machine, against a bare fake step.

Two commands, each in its own fresh process (so wall time includes Python start-up and imports,
and peak RSS is the process's own), on the same model, setting and sequence length:

  bare fake step  plain PyTorch: the HF model built on the meta device, its parameters as fake
                  bf16 tensors on the CPU, one forward with labels, backward and AdamW
                  (foreach, as on CUDA) step under FakeTensorMode; nothing recorded
  ampscope        `ampscope trace MODEL --device cuda --setting bf16 --workload train
                  --seq T --predict`, printing the whole report (to /dev/null)

    python benchmarks/bench_predict.py                       # llama-3-70b, seq 4096, 3 repeats
    python benchmarks/bench_predict.py --model llama-3.2-1b --seq 1024

The medians of `--repeats` rounds are reported with the ratio over the bare step. Goal (issue
"Other devices"): the 70B command under 10 s wall and 1 GB peak RSS on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

BIN = Path(sys.executable).parent

BARE = textwrap.dedent("""
    import sys, torch, transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ampscope.models import hf
    name, seq = sys.argv[1], int(sys.argv[2])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf.zoo_config(name))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[key] = torch.nn.Parameter(
                        torch.empty_strided(p.shape, p.stride(), dtype=torch.bfloat16))
            for key, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[key] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype)
        ids = torch.randint(0, model.config.vocab_size, (1, seq))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.optim.AdamW(model.parameters(), foreach=True).step()
""")


def run(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of one fresh process (wait4 gives that child's own)."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = child.stderr.read() if child.stderr else ""
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"{' '.join(argv[:3])}… failed:\n{stderr}")
    return wall, usage.ru_maxrss / 1e6  # Linux reports kB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    commands = {
        "bare fake step": [sys.executable, "-c", BARE, args.model, str(args.seq)],
        "ampscope": [str(BIN / "ampscope"), "trace", args.model, "--device", "cuda", "--setting",
                     "bf16", "--workload", "train", "--seq", str(args.seq), "--predict"],
    }
    walls: dict[str, list[float]] = {name: [] for name in commands}
    peaks: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):  # alternate, so that a disturbed minute hits both
        for name, argv in commands.items():
            wall, peak = run(argv)
            walls[name].append(wall)
            peaks[name].append(peak)

    print(f"{args.model}, train step, seq {args.seq}, cuda:bf16 predicted; "
          f"median of {args.repeats} fresh processes")
    print(f"{'variant':<16} {'wall s':>7} {'min':>6} {'max':>6} {'× bare':>7} {'peak RSS GB':>12}")
    bare = statistics.median(walls["bare fake step"])
    for name, times in walls.items():
        median = statistics.median(times)
        print(f"{name:<16} {median:7.2f} {min(times):6.2f} {max(times):6.2f} "
              f"{median / bare:6.2f}× {max(peaks[name]):12.2f}")


if __name__ == "__main__":
    main()
