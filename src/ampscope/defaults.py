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
# `ampscope run --max-forwards` and `run_script(max_forwards=)`: forward passes of a script's
# model without an optimizer step after which the run is stopped. A sampler's whole run fits
# (10 samples of 500 tokens take 5,000 passes); a script that never steps
# does not run forever.
MAX_FORWARDS = 10_000
