"""What every view shares: dtype names and colours, op names, byte counts, the tables' form."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TypedDict

from rich.table import Table
from rich.text import Text

# Worded below the views (and torch-free), where reports' notes word sizes too.
from ampscope.wording import format_bytes, short_op  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from rich.console import JustifyMethod, OverflowMethod

DTYPE_STYLES = {
    "float64": "blue", "float32": "green", "bfloat16": "cyan", "float16": "magenta",
    "float8_e4m3fn": "red", "float8_e5m2": "red",
}
# Tables use the short names people write ("bf16"); JSON keeps torch's names.
SHORT_DTYPES = {
    "float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
    "float8_e4m3fn": "fp8e4m3", "float8_e5m2": "fp8e5m2",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
}


class ColumnOptions(TypedDict, total=False):
    """The keyword arguments of rich's `Table.add_column` that tables give column by column."""

    justify: JustifyMethod
    overflow: OverflowMethod
    ratio: int
    style: str
    min_width: int
    max_width: int
    no_wrap: bool


def titled_table(title: str | None, *columns: str | tuple[str, ColumnOptions],
          right: Collection[str] = (), no_wrap: bool = False, **options: Any) -> Table:
    """A view's table: the title on the left, no outer edge (`options`: rich's other `Table`
    arguments), and its columns, each a name or a name and its options; those named in
    `right` justified right, every one kept on one line with `no_wrap`."""
    made = Table(title=title, title_justify="left", show_edge=False, **options)
    for column in columns:
        name, given = (column, ColumnOptions()) if isinstance(column, str) else column
        kw = ColumnOptions(justify="right" if name in right else "left", no_wrap=no_wrap)
        kw.update(given)
        made.add_column(name, **kw)
    return made


def dtype_text(dtypes: tuple[str, ...] | list[str], *, short: bool = True) -> Text:
    text = Text()
    for i, d in enumerate(dtypes):
        if i:
            text.append(" ")
        text.append(SHORT_DTYPES.get(d, d) if short else d, style=DTYPE_STYLES.get(d, "yellow"))
    return text or Text("—", style="dim")
