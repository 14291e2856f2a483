"""A trace's records as tables: one row per op, per module call or per tensor
(`Trace.table(kind)`, `Trace.to_dataframe(kind)`, `ampscope trace --csv`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ampscope.records.table import Table, dtypes_cell, shape_text, shapes_cell, table
from ampscope.records.tensors import module_label

if TYPE_CHECKING:
    from ampscope.records.trace import Trace

KINDS = ("ops", "modules", "tensors")

OP_COLUMNS = ("index", "phase", "module", "op", "in_dtypes", "in_shapes", "out_dtypes",
              "out_shapes", "in_names", "autocast_cast", "autocast", "call", "source", "grad_fn",
              "flops", "flops_causal")
MODULE_COLUMNS = ("index", "phase", "module", "type", "depth", "in_dtypes", "in_shapes",
                  "out_dtypes", "out_shapes")
TENSOR_COLUMNS = ("role", "name", "dtype", "shape", "elements", "bytes", "detail")


def trace_table(trace: Trace, kind: str) -> Table:
    if kind == "ops":
        return _ops(trace)
    if kind == "modules":
        return _modules(trace)
    if kind == "tensors":
        return _tensors(trace)
    raise ValueError(f"no table {kind!r}: give one of {', '.join(KINDS)}")


def _ops(trace: Trace) -> Table:
    calls = {c.index: c for c in trace.calls}
    rows = []
    for o in trace.ops:
        call = calls.get(o.caller) if o.caller is not None else None
        rows.append((o.index, o.phase, module_label(o.module), o.op, dtypes_cell(o.inputs),
                     shapes_cell(o.inputs), dtypes_cell(o.outputs), shapes_cell(o.outputs),
                     " ".join(n or "-" for n in o.input_names), o.autocast_cast,
                     # the autocast dtype in force for the user-level call the op ran under
                     call.autocast if call else None, call.func if call else None,
                     o.source, o.grad_fn, o.flops, o.flops_causal))
    return table(OP_COLUMNS, rows)


def _modules(trace: Trace) -> Table:
    return table(MODULE_COLUMNS, (
        (m.index, m.phase, module_label(m.name), m.type, m.depth, dtypes_cell(m.inputs),
         shapes_cell(m.inputs), dtypes_cell(m.outputs), shapes_cell(m.outputs))
        for m in trace.modules))


def _row(role: str, name: str, dtype: str, shape: tuple[int, ...], detail: str | None) -> tuple:
    elements = 1
    for s in shape:
        elements *= s
    return (role, name, dtype, shape_text(shape), elements,
            elements * getattr(torch, dtype).itemsize, detail)


def _tensors(trace: Trace) -> Table:
    """Every tensor the step holds by name: parameters, their gradients, buffers, optimizer
    state, inputs and outputs (activations are in the ops table)."""
    rows = []
    for p in trace.parameters:
        rows.append(_row("parameter", p.name, p.dtype, p.shape,
                         "tied to " + ", ".join(p.tied_to) if p.tied_to else None))
    for p in trace.parameters:
        if p.grad_dtype is not None:
            rows.append(_row("gradient", p.name + ".grad", p.grad_dtype, p.shape, None))
    for b in trace.buffers:
        rows.append(_row("buffer", b.name, b.dtype, b.shape,
                         None if b.persistent else "not persistent"))
    for s in trace.optimizer_state:
        rows.append(_row("optimizer_state", f"{s.param}:{s.key}", s.dtype, s.shape, s.key))
    for i in (*trace.inputs, *trace.outputs):
        rows.append(_row(i.role, i.name, i.dtype, i.shape, None))
    return table(TENSOR_COLUMNS, rows)
