"""What the GPU model costs a predicted llama-3-70b step: the step-time model
(analysis/step_time) and the caching-allocator replay (the memory report's reserved peak),
each as CPU seconds beside the trace's own, measured in one process.

    .venv/bin/python benchmarks/bench_gpu_model.py
"""

from __future__ import annotations

import time

import ampscope
from ampscope import hardware
from ampscope.analysis.memory import memory_report
from ampscope.analysis.step_time import step_time


def main() -> None:
    acc = hardware.by_name("h100")
    for _ in range(2):
        start = time.process_time()
        trace = ampscope.trace("llama-3-70b", setting="cuda:bf16", predict=True, seq=512)
        traced = time.process_time() - start
        start = time.process_time()
        step_time(trace, acc)
        timed = time.process_time() - start
        start = time.process_time()
        memory_report(trace)
        replayed = time.process_time() - start
        print(f"trace {traced:.2f} s CPU; step_time {timed:.3f} s ({timed / traced:.1%}); "
              f"memory report with the replay {replayed:.3f} s ({replayed / traced:.1%}); "
              f"{len(trace.ops):,} ops, {len(trace.storages):,} storages")


if __name__ == "__main__":
    main()
