"""What every view shares: dtype names and colours, op names, byte counts."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

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


def dtype_text(dtypes: tuple[str, ...] | list[str], *, short: bool = True) -> Text:
    text = Text()
    for i, d in enumerate(dtypes):
        if i:
            text.append(" ")
        text.append(SHORT_DTYPES.get(d, d) if short else d, style=DTYPE_STYLES.get(d, "yellow"))
    return text or Text("—", style="dim")
