"""`ampscope memory` against accelerate's memory estimate, on the same local config, in one
process.

    python benchmarks/bench_memory.py                    # llama-3-8b, cuda:bf16, 5 rounds

accelerate's `estimate-memory` command reads a model from the Hugging Face hub; nothing here
may, so its own steps run on the zoo's local config instead: the model built under
`accelerate.init_empty_weights()` with `AutoModelForCausalLM.from_config`, then
`calculate_maximum_sizes` (the weights' total and the largest layer) and
`estimate_training_usage` for bf16, whose largest component `estimate-memory` prints as the
training peak. ampscope's side is
`ampscope.memory(MODEL, setting="cuda:bf16", predict=True)`, as `ampscope memory MODEL -d cuda
-s bf16` runs it: the model built, the train step predicted on fake tensors, every storage's
lifetime followed to the peak. One warm-up of each comes first; then the two alternate for
`--repeats` rounds. The table gives the median wall time and each one's answer.

A second table times the same two as whole fresh processes (Python start-up and imports
included, as a user meets them): `accelerate_estimate.py`, which imports torch, transformers and
accelerate and nothing of ampscope, given the zoo entry's config as JSON, against the command
`ampscope memory MODEL -d cuda -s bf16` with its report sent to /dev/null.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import ampscope
from ampscope.models import catalog, hf
from ampscope.render.style import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accelerate_estimate  # a sibling script, found by the path above


def zoo_config(name: str) -> tuple[str, dict]:
    """The zoo entry's transformers config class and arguments, as ampscope builds it."""
    fields = {k: v for k, v in catalog.entry(name).config.items() if k != "model_type"}
    config_class = type(hf.ZOO[name]).__name__  # the class of its model_type
    return config_class, {**fields, "attn_implementation": hf.ATTN_IMPLEMENTATION}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    variants = {
        "accelerate": lambda: accelerate_estimate.estimate(*zoo_config(args.model)),
        "ampscope": lambda: ampscope.memory(args.model, setting="cuda:bf16", predict=True),
    }
    for run in variants.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    answers: dict[str, object] = {}
    for _ in range(args.repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            answers[name] = run()
            times[name].append(time.perf_counter() - start)

    total, largest, training = answers["accelerate"]
    report = answers["ampscope"]
    print(f"{args.model}, bf16; median of {args.repeats} rounds in one process")
    print(f"{'variant':<11} {'wall s':>7} {'min':>6} {'max':>6}  answer")
    rows = {
        "accelerate": f"weights {format_bytes(total)} (largest layer {format_bytes(largest)}); "
                      f"training estimate {format_bytes(training)}",
        "ampscope": f"train step peak {format_bytes(report.peak.bytes)} "
                    f"({report.peak.phase}, {report.peak.op_name})",
    }
    for name, values in times.items():
        print(f"{name:<11} {statistics.median(values):7.2f} {min(values):6.2f} "
              f"{max(values):6.2f}  {rows[name]}")
    ratio = statistics.median(times["ampscope"]) / statistics.median(times["accelerate"])
    print(f"ampscope / accelerate: {ratio:.2f}×")

    here = Path(__file__).resolve().parent
    commands = {
        "accelerate": [sys.executable, str(here / "accelerate_estimate.py"),
                       json.dumps(zoo_config(args.model))],
        "ampscope": [str(Path(sys.executable).parent / "ampscope"), "memory", args.model,
                     "-d", "cuda", "-s", "bf16"],
    }
    walls: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, argv in commands.items():
            start = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            walls[name].append(time.perf_counter() - start)
    print(f"\nas fresh processes, median of {args.repeats}")
    print(f"{'variant':<11} {'wall s':>7} {'min':>6} {'max':>6}")
    for name, values in walls.items():
        print(f"{name:<11} {statistics.median(values):7.2f} {min(values):6.2f} {max(values):6.2f}")
    ratio = statistics.median(walls["ampscope"]) / statistics.median(walls["accelerate"])
    print(f"ampscope / accelerate: {ratio:.2f}×")


if __name__ == "__main__":
    main()
