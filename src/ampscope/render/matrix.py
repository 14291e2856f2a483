"""The settings matrix as rich tables: cells that differ from the first setting stand out."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.compare import Cell, Matrix
from ampscope.render.style import dtype_text

DIFFERS = "reverse"  # a cell that differs from the first setting's
MARK = " *"  # the same, readable without colour (a pipe, a log file)


def _cell(cell: Cell, differs: bool) -> Text:
    if cell is None:
        return Text("not run", style="dim")
    ins, outs, matmul = cell
    text = Text()
    text.append_text(dtype_text(ins))
    text.append(" → ")
    text.append_text(dtype_text(outs))
    if matmul:
        text.append(f" [{matmul}]")
    if differs:
        text.stylize(DIFFERS)
        text.append(MARK)
    return text


def short_names(names_depths: list[tuple[str, int]]) -> list[str]:
    """Indented names relative to the enclosing row, as people write a module tree:
    "transformer.h.0–11" then "  attn", "    c_attn"."""
    parents: list[str] = []
    out = []
    for name, depth in names_depths:
        del parents[max(depth - 1, 0):]
        parent = parents[-1] if parents else ""
        shown = name[len(parent) + 1:] if parent and name.startswith(parent + ".") else name
        out.append("  " * depth + shown)
        parents.append(name)
    return out


def render_matrix(matrix: Matrix) -> RenderableType:
    names = matrix.names
    header = Text()
    header.append(matrix.model, style="bold")
    header.append(f"  workload {matrix.workload}  ")
    header.append(f"{len(names)} settings; ", style="dim")
    header.append("highlighted", style=DIFFERS)
    header.append(f" and *: differs from {names[0]}", style="dim")

    modules = Table(title="Modules, forward pass: in → out", title_justify="left",
                    show_edge=False)
    # Module names get room first; on a narrow terminal a cell wraps inside its column.
    modules.add_column("module", overflow="fold", min_width=14)
    modules.add_column("type", overflow="ellipsis", max_width=10)
    for name in names:
        modules.add_column(name)
    for name, _ in matrix.failures:  # a setting that failed: its column says so
        modules.add_column(name)
    labels = short_names([(row.name, row.depth) for row in matrix.rows])
    failed = [Text("fails (below)", style="bold red")] * len(matrix.failures)
    for i, (label, row) in enumerate(zip(labels, matrix.rows, strict=True)):
        modules.add_row(Text(label), row.kind,
                        *(_cell(c, d) for c, d in zip(row.cells, row.differs, strict=True)),
                        *(failed if i == 0 else [Text("")] * len(failed)))

    summary = Table(title="Whole run", title_justify="left", show_edge=False)
    summary.add_column("")
    for name in names:
        summary.add_column(name)
    for total in matrix.summary:
        summary.add_row(total.what, *(Text(v + MARK, style=DIFFERS) if d else Text(v)
                                      for v, d in zip(total.values, total.differs, strict=True)))
    parts: list[RenderableType] = [header, Text(), modules, Text(), summary]
    for name, why in matrix.failures:
        parts.append(Text.assemble((f"{name} fails: ", "bold red"), why))
    return Group(*parts)
