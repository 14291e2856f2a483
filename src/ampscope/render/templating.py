"""The jinja2 environment of the HTML views (render/html.py, render/flowgraph.py): the templates
in render/templates/, shipped with the package, rendered with autoescaping on."""

from __future__ import annotations

import functools

from jinja2 import Environment, PackageLoader, StrictUndefined

from ampscope.records import module_label
from ampscope.render.diagnostics import tally
from ampscope.render.flops import human, share
from ampscope.render.plots import dtype_color
from ampscope.render.style import SHORT_DTYPES, format_bytes, short_op


@functools.cache
def environment() -> Environment:
    env = Environment(loader=PackageLoader("ampscope.render", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(
        dtype_color=dtype_color, short_dtype=lambda d: SHORT_DTYPES.get(d, d), human=human,
        bytes=format_bytes, short_op=short_op, module_label=module_label,
        thousands=lambda n: f"{n:,}", zip=lambda a, b: zip(a, b, strict=True), tally=tally)
    env.globals.update(share=share)
    return env


def macros(name: str):
    """The macros of template `name`, callable from Python; each returns Markup."""
    return environment().get_template(name).module
