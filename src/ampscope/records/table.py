"""`Table`: rows of plain values, the one tabular form of a trace or a report.

A DataFrame (`to_dataframe`) and a CSV file (`to_csv`, `--csv PATH`) are both made from the
same `Table`, so they have the same columns and the same values. Cells are str, int, float,
bool or None: lists (dtypes, shapes) are joined into one string by `dtypes_cell` and
`shapes_cell`, so a CSV cell and a DataFrame cell read the same.

pandas is an optional extra (`pip install 'ampscope[pandas]'`), imported only by
`to_dataframe`; CSV uses the standard library.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampscope.errors import AmpscopeError
from ampscope.files import write_atomic
from ampscope.records.tensors import TensorMeta

Cell = str | int | float | bool | None

PANDAS_MISSING = "to_dataframe needs pandas: pip install 'ampscope[pandas]' (or pip install pandas)"


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"a row of {len(row)} cells for {len(self.columns)} columns")

    def records(self) -> list[dict[str, Cell]]:
        """The rows as dicts, column name → value."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def to_dataframe(self) -> Any:
        """A pandas DataFrame with these columns and rows, in order."""
        try:
            import pandas
        except ImportError as e:
            raise AmpscopeError(PANDAS_MISSING) from e
        return pandas.DataFrame(list(self.rows), columns=list(self.columns))

    def to_csv(self, path: str | Path | None = None) -> str:
        """The table as CSV text (a header row, then the rows; None is an empty cell),
        written atomically to `path` when given."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(self.columns)
        writer.writerows(["" if c is None else c for c in row] for row in self.rows)
        text = out.getvalue()
        if path is not None:
            write_atomic(path, text)
        return text


def table(columns: Sequence[str], rows: Iterable[Sequence[Cell]]) -> Table:
    return Table(tuple(columns), tuple(tuple(r) for r in rows))


def dtypes_cell(metas: Sequence[TensorMeta]) -> str:
    """"float32 bfloat16": the dtypes of several tensors, in order."""
    return " ".join(m.dtype for m in metas)


def shape_text(shape: Sequence[int]) -> str:
    """"1x64x768"; "scalar" for a 0-d tensor."""
    return "x".join(map(str, shape)) if shape else "scalar"


def shapes_cell(metas: Sequence[TensorMeta]) -> str:
    """"1x64x768 768x768": the shapes of several tensors, aligned with `dtypes_cell`."""
    return " ".join(shape_text(m.shape) for m in metas)
