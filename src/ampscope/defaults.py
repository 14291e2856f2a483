"""Defaults shared by the API and the command line, in a module that imports nothing.

The command line builds its `--help` from these without importing torch (a second of start-up
for a usage line), so they live here rather than beside the functions that use them.
"""

from __future__ import annotations

DEFAULT_MODEL = "gpt2"
DEFAULT_SETTING = "fp32+amp-bf16"
# `ampscope matrix` / `report` and `ampscope.matrix()`: the four settings people compare first.
DEFAULT_MATRIX_SETTINGS = ("fp32", "bf16", "fp32+amp-bf16", "bf16+amp-bf16")
# `ampscope numerics` and `ampscope.numerics()`: each compared with an fp64 reference.
DEFAULT_NUMERICS_SETTINGS = ("fp32", "fp32+amp-bf16", "bf16")
# `ampscope run --max-forwards` and `run_script(max_forwards=)` when not given: forward passes of
# a script's model without an optimizer step after which the run is stopped. A script that has
# made no optimizer has nothing to step with (an evaluation, a sampler): it is stopped after
# MAX_FORWARDS_NO_OPTIMIZER passes. One that has made one may be evaluating before its first
# step (nanoGPT: 2 splits × 200 batches, 400 passes) or between steps: MAX_FORWARDS. Each traced
# pass costs about 12 ms of CPU on a model of 3 modules and 100-170 ms on examples/gpt's
# two-layer GPT (docs/cli.md, "How a run ends", has the figures): 100 passes take seconds; the
# old single bound of 10,000 took 107 s on the 3-module model, and would take some 25 minutes
# on the GPT (estimated, not run). A count, not a time: a slow evaluation before a first step
# still reaches that step, and the trace is the same on every machine.
MAX_FORWARDS_NO_OPTIMIZER = 100
MAX_FORWARDS = 1_000
