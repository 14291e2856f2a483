"""Predict mode at scale: a 70B training step traced on fake tensors, against a bare fake step
of the same model, in one process.

    python benchmarks/bench_predict.py                       # llama-3-70b, seq 4096, 3 rounds
    python benchmarks/bench_predict.py --model llama-3.2-1b --seq 1024

Each round runs, in this order (after one warm-up of each at seq 64: imports, PyTorch's
fake-tensor caches):

  bare fake step  plain PyTorch: the HF model built on the meta device, its parameters made
                  fake bf16 tensors, one forward with labels, backward and AdamW (foreach, as
                  on CUDA) step under FakeTensorMode; nothing recorded
  ampscope        `ampscope.trace(MODEL, setting="cuda:bf16", workload="train", seq=T,
                  predict=True)`: the model built from its name, the setting applied, the step
                  recorded, the findings derived; repeated blocks recorded twice and replayed
  every block     the same with `exact=True`: the exact path, every speed trick off and every
                  block dispatched

The table gives each variant's median wall time and its ratio over the bare step's. Then the
last round's two traces are compared: every record (modules, calls, ops with their FLOPs,
storages with their lifetimes, tensors, findings), the memory peak and where it falls, and the
FLOPs; the replay note is the one difference expected.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

import ampscope
from ampscope.analysis.flops import flop_report
from ampscope.analysis.memory import memory_report
from ampscope.models import hf
from ampscope.runtime.predict import gc_paused


def bare_step(name: str, seq: int) -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf.ZOO[name])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, gc_paused():
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


def traced(name: str, seq: int, exact: bool):
    return ampscope.trace(name, setting="cuda:bf16", workload="train", seq=seq, predict=True,
                          exact=exact)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def compare(replayed, full) -> list[str]:
    """What differs between the two traces, beyond the note that says blocks were replayed."""
    a, b = replayed.to_dict(), full.to_dict()
    a["notes"] = [n for n in a["notes"] if "identical blocks" not in n]
    diffs = [f"{key} differ" for key in a if a[key] != b[key]]
    ma, mb = memory_report(replayed), memory_report(full)
    if ma.peak != mb.peak:
        diffs.append(f"peak: {ma.peak} against {mb.peak}")
    if flop_report(replayed, tokens=1).total != flop_report(full, tokens=1).total:
        diffs.append("FLOPs differ")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    variants = {
        "bare fake step": lambda seq: bare_step(args.model, seq),
        "ampscope": lambda seq: traced(args.model, seq, exact=False),
        "every block": lambda seq: traced(args.model, seq, exact=True),
    }
    for run in variants.values():
        run(64)
    times: dict[str, list[float]] = {name: [] for name in variants}
    results: dict[str, object] = {}
    for _ in range(args.repeats):
        for name, run in variants.items():
            seconds, results[name] = timed(lambda run=run: run(args.seq))
            times[name].append(seconds)

    replayed, full = results["ampscope"], results["every block"]
    print(f"{args.model}, train step, seq {args.seq}, cuda:bf16 predicted; {len(full.ops):,} ops, "
          f"{len(full.modules):,} module calls; median of {args.repeats} rounds in one process")
    print(f"{'variant':<16} {'wall s':>7} {'min':>6} {'max':>6} {'× bare':>8}")
    bare = statistics.median(times["bare fake step"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<16} {median:7.2f} {min(values):6.2f} {max(values):6.2f} {median / bare:6.3f}×")
    note = next((n for n in replayed.notes if "identical blocks" in n), "no block replayed")
    print(f"\n{note}")
    diffs = compare(replayed, full)
    peak = memory_report(replayed).peak
    print(f"replayed trace equals the every-block trace: {'yes' if not diffs else 'NO'} "
          f"(peak {peak.bytes:,} bytes at op {peak.op} {peak.op_name} in {peak.module}, "
          f"{peak.phase}; {flop_report(replayed, tokens=1).total:,} FLOPs)")
    for d in diffs:
        print("  ", d)


if __name__ == "__main__":
    main()
