"""The settings matrix as rich tables: cells that differ from the first setting stand out."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.analysis.compare import Cell, Matrix
from ampscope.render.style import dtype_text, titled_table

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
    header.append(f"{len(matrix.columns)} settings; ", style="dim")
    if matrix.baseline_failed:  # the first setting stays the baseline: nothing to compare with
        header.append(f"{matrix.baseline} failed: no cell is compared", style="dim")
    else:
        header.append("highlighted", style=DIFFERS)
        header.append(f" and *: differs from {matrix.baseline}", style="dim")

    # Module names get room first; on a narrow terminal a cell wraps inside its column. The
    # settings in the order asked; a setting that failed says so.
    modules = titled_table("Modules, forward pass: in → out",
                           ("module", {"overflow": "fold", "min_width": 14}),
                           ("type", {"overflow": "ellipsis", "max_width": 10}), *matrix.columns)
    ran = {name: i for i, name in enumerate(names)}
    labels = short_names([(row.name, row.depth) for row in matrix.rows])
    for i, (label, row) in enumerate(zip(labels, matrix.rows, strict=True)):
        cells = [_cell(row.cells[ran[name]], bool(row.differs[ran[name]])) if name in ran
                 else Text("fails (below)", style="bold red") if i == 0 else Text("")
                 for name in matrix.columns]
        modules.add_row(Text(label), row.kind, *cells)

    summary = titled_table("Whole run", "", *matrix.columns)
    for total in matrix.summary:
        summary.add_row(total.what, *(
            (Text(total.values[ran[name]] + MARK, style=DIFFERS) if total.differs[ran[name]]
             else Text(total.values[ran[name]])) if name in ran else Text("—", style="dim")
            for name in matrix.columns))
    parts: list[RenderableType] = [header, Text(), modules, Text(), summary]
    for name, why in matrix.failures:
        parts.append(Text.assemble((f"{name} fails: ", "bold red"), why))
    return Group(*parts)
