"""A trace's records as tables: one row per op, per module call or per tensor
(`Trace.table(kind)`, `Trace.to_dataframe(kind)`, `ampscope trace --csv`). Each function takes
the record lists it reads, so this module needs no `Trace`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ampscope.records.table import Table, dtypes_cell, shape_text, shapes_cell, table
from ampscope.records.tensors import (
    BufferRecord,
    FunctionCall,
    InputRecord,
    ModuleCall,
    OpCall,
    OptimizerStateRecord,
    ParameterRecord,
    module_label,
)

KINDS = ("ops", "modules", "tensors")

OP_COLUMNS = ("index", "phase", "module", "op", "in_dtypes", "in_shapes", "out_dtypes",
              "out_shapes", "in_names", "autocast_cast", "autocast", "call", "source", "grad_fn",
              "flops", "flops_causal")
MODULE_COLUMNS = ("index", "phase", "module", "type", "depth", "in_dtypes", "in_shapes",
                  "out_dtypes", "out_shapes")
TENSOR_COLUMNS = ("role", "name", "dtype", "shape", "elements", "bytes", "detail")


def ops_table(ops: Sequence[OpCall], calls: Sequence[FunctionCall]) -> Table:
    by_index = {c.index: c for c in calls}
    rows = []
    for o in ops:
        call = by_index.get(o.caller) if o.caller is not None else None
        rows.append((o.index, o.phase, module_label(o.module), o.op, dtypes_cell(o.inputs),
                     shapes_cell(o.inputs), dtypes_cell(o.outputs), shapes_cell(o.outputs),
                     " ".join(n or "-" for n in o.input_names), o.autocast_cast,
                     # the autocast dtype in force for the user-level call the op ran under
                     call.autocast if call else None, call.func if call else None,
                     o.source, o.grad_fn, o.flops, o.flops_causal))
    return table(OP_COLUMNS, rows)


def modules_table(modules: Sequence[ModuleCall]) -> Table:
    return table(MODULE_COLUMNS, (
        (m.index, m.phase, module_label(m.name), m.type, m.depth, dtypes_cell(m.inputs),
         shapes_cell(m.inputs), dtypes_cell(m.outputs), shapes_cell(m.outputs))
        for m in modules))


def _row(role: str, name: str, dtype: str, shape: tuple[int, ...], detail: str | None) -> tuple:
    elements = math.prod(shape)
    return (role, name, dtype, shape_text(shape), elements,
            elements * getattr(torch, dtype).itemsize, detail)


def tensors_table(parameters: Sequence[ParameterRecord], buffers: Sequence[BufferRecord],
                  optimizer_state: Sequence[OptimizerStateRecord],
                  inputs: Sequence[InputRecord]) -> Table:
    """Every tensor the step holds by name: parameters, their gradients, buffers, optimizer
    state, inputs and outputs (activations are in the ops table)."""
    rows = []
    for p in parameters:
        rows.append(_row("parameter", p.name, p.dtype, p.shape,
                         "tied to " + ", ".join(p.tied_to) if p.tied_to else None))
    for p in parameters:
        if p.grad_dtype is not None:
            rows.append(_row("gradient", p.name + ".grad", p.grad_dtype, p.shape, None))
    for b in buffers:
        rows.append(_row("buffer", b.name, b.dtype, b.shape,
                         None if b.persistent else "not persistent"))
    for s in optimizer_state:
        rows.append(_row("optimizer_state", f"{s.param}:{s.key}", s.dtype, s.shape, s.key))
    for i in inputs:
        rows.append(_row(i.role, i.name, i.dtype, i.shape, None))
    return table(TENSOR_COLUMNS, rows)
