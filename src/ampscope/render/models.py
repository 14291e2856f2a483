"""`ampscope models`: the models this installation can build, as a table."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.models.catalog import ModelCatalog
from ampscope.render.style import titled_table


def render_models(catalog: ModelCatalog) -> RenderableType:
    table = titled_table(None, "model", "family", "parameters", "description",
                         right=("parameters",))
    for info in catalog.models:
        table.add_row(info.name, info.family, f"{info.parameters:,}", info.description)
    return Group(table, Text("Also: hf:PATH (a config.json or checkpoint folder) and "
                             "package.module:factory (your own model).", style="dim"))
