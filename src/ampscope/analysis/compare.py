"""Settings side by side: one row per module (repeated blocks collapsed), one cell per setting,
then the whole-run facts and, where a setting's step was predicted on a GPU (api/gpu_time.py
decides which), its predicted step. How the traces align on their first step's module calls,
which rows there are and what is marked: docs/cli.md, "ampscope matrix". The first setting
asked for is the baseline even when it fails: then no cell is compared with anything
(`differs` is None), rather than with the second setting's as if that were the first."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ampscope.analysis.flops import predicted_dict
from ampscope.analysis.flow import collapse_blocks, dtypes, first_step
from ampscope.analysis.fp8 import fp8_module_notes
from ampscope.analysis.step_time import StepTime
from ampscope.records import SettingRecord, Trace, module_label
from ampscope.records.table import Table, table

# (in dtypes, out dtypes, matmul): what a module did under one setting; None: not run. `matmul`
# says where its matmul ran on float8 data that its higher-precision tensors wrap (torchao's
# float8 training: "matmul in fp8 e4m3 × e4m3"), which its dtypes alone do not show; else "".
Cell = tuple[tuple[str, ...], tuple[str, ...], str] | None

SCHEMA = "ampscope.matrix/1"


@dataclass(frozen=True)
class MatrixRow:
    name: str
    kind: str
    depth: int
    cells: tuple[Cell, ...]  # one per setting
    repeats: int = 1
    compared: bool = True  # False: the baseline (first setting asked for) failed

    @property
    def differs(self) -> tuple[bool | None, ...]:
        """Per setting: does its cell differ from the first setting's? None where the first
        setting failed: there is nothing to compare with."""
        if not self.compared:
            return (None,) * len(self.cells)
        return tuple(cell != self.cells[0] for cell in self.cells)


@dataclass(frozen=True)
class SummaryRow:
    what: str  # "inputs", "loss", "parameters", "gradients", "optimizer state", ...
    values: tuple[str, ...]  # one per setting
    compared: bool = True  # as MatrixRow.compared

    @property
    def differs(self) -> tuple[bool | None, ...]:
        if not self.compared:
            return (None,) * len(self.values)
        return tuple(v != self.values[0] for v in self.values)


@dataclass(frozen=True)
class Matrix:
    model: str
    workload: str
    settings: tuple[SettingRecord, ...]  # each trace's setting
    rows: tuple[MatrixRow, ...]
    summary: tuple[SummaryRow, ...]
    failures: tuple[tuple[str, str], ...] = ()  # (setting, why it failed): no trace, no cells
    # Every setting's name in the order asked, the failed ones included; empty: the traced
    # settings, then the failed ones.
    order: tuple[str, ...] = ()
    # Per setting that ran: its step predicted on a GPU, or None (a CPU setting, sampling).
    predicted: tuple[StepTime | None, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The settings that ran (one per cell of a row)."""
        return tuple(s.name for s in self.settings)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every setting, in the order asked: the views' columns."""
        return self.order or (*self.names, *(name for name, _ in self.failures))

    @property
    def baseline(self) -> str:
        """The setting the others are compared with: the first one asked for."""
        return self.columns[0]

    @property
    def baseline_failed(self) -> bool:
        return any(name == self.baseline for name, _ in self.failures)

    def to_dict(self) -> dict:
        def cell(c: Cell) -> dict | None:
            return None if c is None else {"in": list(c[0]), "out": list(c[1]),
                                           "matmul": c[2] or None}

        return {
            "schema": SCHEMA,
            "model": self.model,
            "workload": self.workload,
            "settings": [s.to_dict() for s in self.settings],
            "modules": [{"name": r.name, "type": r.kind, "depth": r.depth, "repeats": r.repeats,
                         "cells": [cell(c) for c in r.cells], "differs": list(r.differs)}
                        for r in self.rows],
            "summary": [{"what": s.what, "values": list(s.values), "differs": list(s.differs)}
                        for s in self.summary],
            "failures": [{"setting": name, "error": why} for name, why in self.failures],
            "baseline": {"setting": self.baseline, "failed": self.baseline_failed},
            "predicted": [predicted_dict(p) for p in self.predicted],
        }

    def table(self) -> Table:
        """The module rows as `ampscope matrix` prints them: per setting, the dtypes into and
        out of each module (space-separated; empty where the setting did not run it), and the
        dtypes its matmul ran in where they are not those (fp8 training)."""
        columns = ["module", "type", "depth", "repeats"]
        for name in self.names:
            columns += [f"{name} in", f"{name} out", f"{name} matmul"]
        rows = []
        for r in self.rows:
            cells: list = [r.name, r.kind, r.depth, r.repeats]
            for c in r.cells:
                cells += [None, None, None] if c is None else [" ".join(c[0]), " ".join(c[1]),
                                                               c[2] or None]
            rows.append(cells)
        return table(columns, rows)

    def to_dataframe(self):
        """`table()` as a pandas DataFrame (the optional extra `ampscope[pandas]`)."""
        return self.table().to_dataframe()


def _module_rows(traces: list[Trace]) -> list[MatrixRow]:
    """Rows in the first trace's call order; modules only some settings ran are appended."""
    per_trace: list[dict[tuple[str, int], Cell]] = []
    order: list[tuple[tuple[str, int], str, int]] = []
    seen: set[tuple[str, int]] = set()
    for trace in traces:
        cells: dict[tuple[str, int], Cell] = {}
        occurrences: Counter = Counter()
        fp8 = fp8_module_notes(trace)
        for c in first_step(trace.modules):
            key = (c.name, occurrences[c.name])  # a module called twice has two rows
            occurrences[c.name] += 1
            cells[key] = (dtypes(c.inputs), dtypes(c.outputs), fp8.get(c.name, ""))
            if key not in seen:
                seen.add(key)
                order.append((key, c.type, c.depth))
        per_trace.append(cells)
    rows = [MatrixRow(module_label(key[0]), kind, depth, tuple(t.get(key) for t in per_trace))
            for key, kind, depth in order]
    return collapse_blocks(rows, key=lambda r: (r.kind, r.cells))


def _dtype_counts(values: list[str]) -> str:
    """"float32" when all agree, else "float32 ×146, bfloat16 ×2"."""
    if not values:
        return "—"
    counts = Counter(values)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{d} ×{n}" for d, n in counts.most_common())


def _summary(traces: list[Trace]) -> list[SummaryRow]:
    def row(what: str, value) -> SummaryRow:
        return SummaryRow(what, tuple(value(t) for t in traces))

    rows = [
        row("inputs", lambda t: ", ".join(f"{i.name} {i.dtype}" for i in t.inputs) or "—"),
        row("outputs", lambda t: ", ".join(f"{o.name} {o.dtype}" for o in t.outputs) or "—"),
        row("parameters", lambda t: _dtype_counts([p.dtype for p in t.parameters])),
        row("buffers", lambda t: _dtype_counts([b.dtype for b in t.buffers])),
        row("gradients", lambda t: _dtype_counts([p.grad_dtype for p in t.parameters
                                                  if p.grad_dtype])),
    ]
    keys = list(dict.fromkeys(s.key for t in traces for s in t.optimizer_state))
    for key in keys:
        rows.append(row(f"optimizer {key}", lambda t, key=key: _dtype_counts(
            [s.dtype for s in t.optimizer_state if s.key == key])))
    rows.append(row("autocast casts", lambda t: str(sum(
        1 for o in t.ops if o.autocast_cast and o.phase == "forward"))))
    return [r for r in rows if any(v != "—" for v in r.values)]


def _predicted_rows(predicted: Sequence[StepTime | None]) -> list[SummaryRow]:
    """The whole-run rows of the predicted steps: time, bound shares, tokens/s, MFU; "—" for a
    setting without one. The GPU is named in the row when every prediction is on the same."""
    known = [p for p in predicted if p is not None]
    if not known:
        return []
    gpus = {p.accelerator for p in known}
    on = f" on {next(iter(gpus)).upper()}" if len(gpus) == 1 else ""

    def row(what: str, value) -> SummaryRow:
        return SummaryRow(what, tuple("—" if p is None else value(p) for p in predicted))

    def shares(p: StepTime) -> str:
        parts = sorted(((b, t) for b, t in p.by_bound.items() if t > 0), key=lambda kv: -kv[1])
        return ", ".join(f"{b} {100 * t / p.seconds:.0f}%" for b, t in parts)

    return [
        row(f"step{on} (predicted)", lambda p: f"{p.seconds * 1e3:,.1f} ms"
            + ("" if on else f" on {p.accelerator.upper()}")),
        row("bound (predicted)", shares),
        row("tokens/s (predicted)", lambda p: f"{p.tokens_per_second:,.0f}"),
        row("MFU (predicted)", lambda p: "n/a" if p.mfu is None else f"{100 * p.mfu:.2g}%"),
    ]


def build_matrix(traces: list[Trace], failures: tuple[tuple[str, str], ...] = (),
                 order: tuple[str, ...] = (),
                 predicted: Sequence[StepTime | None] = ()) -> Matrix:
    """The side-by-side view of traces of one model and workload under several settings.
    `order`: every setting's name in the order asked (its first is the baseline, also when it
    is among the `failures`); empty: the traces' order. `predicted`: each trace's predicted
    step (or None), shown as whole-run rows; empty: none."""
    if not traces:
        raise ValueError("build_matrix needs at least one trace")
    first = traces[0]
    failed = {name for name, _ in failures}
    compared = not order or order[0] not in failed
    return Matrix(
        model=first.model.name,
        workload=first.workload,
        settings=tuple(t.setting for t in traces),
        rows=tuple(replace(r, compared=compared) for r in _module_rows(traces)),
        summary=tuple(replace(r, compared=compared)
                      for r in _summary(traces) + _predicted_rows(predicted)),
        failures=tuple(failures),
        order=tuple(order),
        predicted=tuple(predicted) or (None,) * len(traces),
    )
