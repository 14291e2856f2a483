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

# Public name -> the module that defines it. The reports' functions are public by their
# registration (render/report_kinds.py: `ampscope.memory`, `ampscope.flops`, ...), read when one
# is first asked for: the registry costs no torch, but the milliseconds of `dataclasses`.
_EXPORTS = {
    "capture": "ampscope.api", "findings": "ampscope.api", "fit": "ampscope.api",
    "matrix": "ampscope.api", "trace": "ampscope.api", "watch": "ampscope.api",
    "AmpscopeError": "ampscope.errors", "LoadedModel": "ampscope.models.base",
    "Setting": "ampscope.precision", "parse_setting": "ampscope.precision",
    "Trace": "ampscope.records", "run_script": "ampscope.script",
    "RunOptions": "ampscope.workloads", "exact_path": "ampscope.tricks",
}


def _reports() -> dict[str, Any]:
    """The registered reports whose function is public as `ampscope.NAME`."""
    from ampscope.render.report_kinds import public_functions

    return public_functions()


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on demand: importlib.metadata costs 50 ms at start-up
        globals()[name] = _version()
        return globals()[name]
    if name == "__all__":  # every public name, the reports registered by now included
        return sorted({*_EXPORTS, *_reports()})
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name.startswith("_") or (kind := _reports().get(name)) is None:
        raise AttributeError(f"module 'ampscope' has no attribute {name!r}")
    else:
        value = kind.load("api")
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
    return sorted({*globals(), *__getattr__("__all__")})


if TYPE_CHECKING:  # what type checkers and IDEs see: the names, eagerly (a report's function
    # listed here gets its signature checked; one that is not is still public, typed Any)
    from ampscope.api import capture as capture
    from ampscope.api import findings as findings
    from ampscope.api import matrix as matrix
    from ampscope.api import trace as trace

    # From their own modules: ampscope.api.fit and ampscope.api.watch are modules as well as
    # functions, and mypy reads the package's name as the module.
    from ampscope.api.fit import fit as fit
    from ampscope.api.reports import flops as flops
    from ampscope.api.reports import memory as memory
    from ampscope.api.reports import numerics as numerics
    from ampscope.api.reports import policy as policy
    from ampscope.api.watch import watch as watch
    from ampscope.errors import AmpscopeError as AmpscopeError
    from ampscope.models.base import LoadedModel as LoadedModel
    from ampscope.precision import Setting as Setting
    from ampscope.precision import parse_setting as parse_setting
    from ampscope.records import Trace as Trace
    from ampscope.script import run_script as run_script
    from ampscope.workloads import RunOptions as RunOptions
