"""ampscope: which precision every tensor of a PyTorch model really runs in, and why.

    import ampscope
    t = ampscope.trace("gpt2", setting="fp32+amp-bf16", workload="train")
    t.to_json("trace.json")

    with ampscope.capture(model) as t:   # around your own training step
        ...
"""

from ampscope.api import capture, flops, matrix, memory, numerics, policy, trace
from ampscope.errors import AmpscopeError
from ampscope.models.base import LoadedModel
from ampscope.precision import Setting, parse_setting
from ampscope.records import Trace
from ampscope.render import notebook, perfetto
from ampscope.script import run_script
from ampscope.workloads import RunOptions

notebook.register()  # Jupyter shows traces and reports as HTML
perfetto.register()  # Trace.to_perfetto

__all__ = ["AmpscopeError", "LoadedModel", "RunOptions", "Setting", "Trace", "capture", "flops",
           "matrix", "memory", "numerics", "parse_setting", "policy", "run_script", "trace"]
__version__ = "0.1.0"
