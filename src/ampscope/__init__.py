"""ampscope: which precision every tensor of a PyTorch model really runs in, and why.

    import ampscope
    t = ampscope.trace("gpt2", setting="fp32+amp-bf16", workload="train")
    t.to_json("trace.json")

    with ampscope.capture(model) as t:   # around your own training step
        ...

The names below are imported on first use (PEP 562): `import ampscope` alone imports no torch,
so the command line answers `--help`, `--version` and argument errors in a fraction of the
second that importing torch takes.

The packages, in their layers (docs/architecture.md): `cli/` and `integrations/`; `api/` and
`script/`; `render/`; `analysis/`, `train/`, `distributed/`; `runs/` and `workloads.py`;
`precision/` and `models/`; `runtime/` (a run as on another device, or predicted); `records/`, `hardware/`, `schemas/`, `nested.py` (the tensors in
nested arguments) and `tricks.py` (the speed tricks and their one switch); at the bottom
`errors.py` (`AmpscopeError`), `files.py` (atomic writes), `defaults.py` (what `--help` shows),
`quiet.py` (other libraries' log lines held back), `patches.py` (every attribute a run replaces),
`wording.py` (byte counts and op names as every layer words them) and `torchcompat/` (every
private torch detail). `__main__.py`: `python -m ampscope`.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

# The library logs its decisions (predicted because…, emulated, fallbacks) to the "ampscope"
# logger at INFO and never configures handlers: that is the application's choice (`ampscope -v`).
logging.getLogger("ampscope").addHandler(logging.NullHandler())

# Public name -> the module that defines it.
_EXPORTS = {
    "capture": "ampscope.api", "findings": "ampscope.api", "fit": "ampscope.api",
    "flops": "ampscope.api", "matrix": "ampscope.api",
    "memory": "ampscope.api", "numerics": "ampscope.api", "policy": "ampscope.api",
    "trace": "ampscope.api", "watch": "ampscope.api", "AmpscopeError": "ampscope.errors",
    "LoadedModel": "ampscope.models.base", "Setting": "ampscope.precision",
    "parse_setting": "ampscope.precision", "Trace": "ampscope.records",
    "run_script": "ampscope.script", "RunOptions": "ampscope.workloads",
    "exact_path": "ampscope.tricks",
}

__all__ = ["AmpscopeError", "LoadedModel", "RunOptions", "Setting", "Trace", "capture",
           "exact_path", "findings", "fit", "flops",
           "matrix", "memory", "numerics", "parse_setting", "policy", "run_script", "trace", "watch"]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on demand: importlib.metadata costs 50 ms at start-up
        globals()[name] = _version()
        return globals()[name]
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ampscope' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if module != "ampscope.errors":
        # Jupyter's HTML views, given to the record and report classes here, explicitly (and
        # idempotently): they sit below render/ and cannot import it. Not at `import ampscope`,
        # for the views import torch.
        from ampscope.render import notebook

        notebook.register()
    globals()[name] = value  # the next access skips this function
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ampscope")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see: the names, eagerly
    from ampscope.api import (
        capture,
        findings,
        flops,
        matrix,
        memory,
        numerics,
        policy,
        trace,
    )

    # From their own modules: ampscope.api.fit and ampscope.api.watch are modules as well as
    # functions, and mypy reads the package's name as the module.
    from ampscope.api.fit import fit
    from ampscope.api.watch import watch
    from ampscope.errors import AmpscopeError
    from ampscope.models.base import LoadedModel
    from ampscope.precision import Setting, parse_setting
    from ampscope.records import Trace
    from ampscope.script import run_script
    from ampscope.workloads import RunOptions
