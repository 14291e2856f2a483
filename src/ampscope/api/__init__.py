"""The Python API: `trace()` runs a workload under a setting; `capture()` records user code.

- `preparation.py`: what a run needs before it runs: the setting resolved, the model, its
  batch, real or predicted;
- `tracing.py`: `trace`, `matrix`, `capture`;
- `reports.py`: `memory`, `flops`, `findings`, `numerics`, `policy` (each registered report's
  function is public here and at the package root by its registration, render/report_kinds.py);
- `measure.py`: an untraced step's wall time and allocator peak (CUDA or CPU);
- `gpu_time.py`: which GPU a report's step is predicted on, and the predicted step itself;
- `fit.py`: `fit`, the largest batch whose predicted step fits a GPU;
- `parallel_plans.py`: `plans`, the parallel plans of a model on N GPUs (`fit --gpus N`);
- `watch.py`: `watch`, one optimizer step of the user's own training loop, traced as it runs.
"""

from typing import Any

from ampscope.api.fit import fit
from ampscope.api.measure import measure_peak_memory, measure_step, peak_to_measure
from ampscope.api.reports import findings, tokens_of
from ampscope.api.tracing import capture, matrix, trace, trace_run
from ampscope.api.watch import Watch, watch
from ampscope.defaults import DEFAULT_MATRIX_SETTINGS, DEFAULT_NUMERICS_SETTINGS
from ampscope.models.loading import load
from ampscope.render import notebook
from ampscope.render.report_kinds import public_functions

# Jupyter shows traces and reports as HTML, also for `from ampscope.api import trace` (the
# package root registers the views only when one of its names is first used).
notebook.register()


def __getattr__(name: str) -> Any:
    """A registered report's function by the report's name (`memory`, `flops`, `numerics`,
    `policy`): public by its registration, render/report_kinds.py."""
    kind = public_functions().get(name)
    if kind is None:
        raise AttributeError(f"module 'ampscope.api' has no attribute {name!r}")
    return kind.load("api")


__all__ = [
    "DEFAULT_MATRIX_SETTINGS", "DEFAULT_NUMERICS_SETTINGS", "capture", "peak_to_measure",
    "findings", "fit", "load", "matrix", "measure_peak_memory", "measure_step", "tokens_of",
    "trace", "trace_run", "Watch", "watch", *public_functions(),
]
