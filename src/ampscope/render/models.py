"""`ampscope models`: the models this installation can build, as a table."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.models.catalog import ModelCatalog


def render_models(catalog: ModelCatalog) -> RenderableType:
    table = Table(show_edge=False)
    table.add_column("model")
    table.add_column("family")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for info in catalog.models:
        table.add_row(info.name, info.family, f"{info.parameters:,}", info.description)
    return Group(table, Text("Also: hf:PATH (a config.json or checkpoint folder) and "
                             "package.module:factory (your own model).", style="dim"))
