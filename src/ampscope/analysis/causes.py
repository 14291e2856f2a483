"""Why a tensor changed dtype: every forward dtype change in a trace, with exactly one cause.

What counts as a dtype change, and the causes in the order they are tried, each with the
reason it is told apart (autocast never casts a call's result; secondary outputs are float32 by
the op's definition): docs/how-it-works.md, "Why a tensor changed dtype: causes".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from ampscope.records import EXPLICIT_CASTS, FunctionCall, OpCall, Trace
from ampscope.torchcompat.ops import TO_COPY_NAME

FLOATS = frozenset({"float64", "float32", "bfloat16", "float16"})
CAUSES = ("autocast-policy", "explicit-cast", "parameter-dtype", "buffer-dtype", "type-promotion",
          "op-defined")

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True)
class DtypeChange:
    """One forward op that changed dtype, and why."""

    op_index: int  # index into trace.ops
    op: str  # "aten._to_copy.default"
    module: str | None  # innermost module running, as in OpCall
    phase: str
    inputs: tuple[str, ...]  # dtypes of all tensor inputs, in order
    output: str  # the primary output's dtype
    cause: str  # one of CAUSES
    # autocast-policy: "lower-precision list" / "float32 list" / "promote list";
    # parameter-dtype, buffer-dtype: the parameter or buffer's name; op-defined: why.
    detail: str
    func: str | None  # the user-level call it ran under ("torch.nn.functional.linear")
    source: str | None  # "model.py:80"
    input_names: tuple[str | None, ...] = ()  # parameter/buffer names, aligned with inputs

    @property
    def function(self) -> str:
        """Short name of the user-level call: "linear", "add", "float"."""
        return short_name(self.func) if self.func else self.op.split(".")[1]


def short_name(func: str) -> str:
    """"torch.nn.functional.layer_norm" -> "layer_norm"; "Tensor.__add__" -> "add"."""
    return func.rsplit(".", 1)[-1].strip("_")


def _primary_output(op: OpCall) -> str | None:
    return next((m.dtype for m in op.outputs if m.dtype in FLOATS), None)


def _is_change(op: OpCall, out: str, explicit: bool) -> bool:
    if all(m.dtype == out for m in op.inputs):  # most ops: every input in the (float) output's
        return False
    floats = [m.dtype for m in op.inputs if m.dtype in FLOATS]
    if any(d != out for d in floats):
        return True
    activations = [m.dtype for m, n in zip(op.inputs, op.input_names, strict=False) if n is None]
    # Token ids become floating: through a floating parameter or buffer, or an explicit cast.
    return bool(activations) and not any(d in FLOATS for d in activations) and (
        explicit or len(floats) > 0)


def _round_trip_casts(ops: Iterable[OpCall], calls_out: dict[int, str | None]) -> dict[int, str]:
    """The casts a function makes to compute in another dtype and back: under one user call, a
    cast X → Y followed by a cast Y → X, where X is what the call returns. Op index -> Y."""
    by_caller: dict[int, list[OpCall]] = defaultdict(list)
    for o in ops:
        if o.op == TO_COPY_NAME and o.caller is not None and o.inputs and o.outputs:
            by_caller[o.caller].append(o)
    found: dict[int, str] = {}
    for caller, casts in by_caller.items():
        returns = calls_out.get(caller)
        for i, back in enumerate(casts):
            x, y = back.outputs[0].dtype, back.inputs[0].dtype
            if x != returns:
                continue
            up = next((c for c in casts[:i] if c.index not in found
                       and (c.inputs[0].dtype, c.outputs[0].dtype) == (x, y)), None)
            if up is not None:
                found[up.index] = found[back.index] = y
    return found


def dtype_changes(trace: Trace) -> list[DtypeChange]:
    """Every forward dtype change in `trace`, in op order, each with its one cause."""
    calls = {c.index: c for c in trace.calls}
    calls_out = {i: next((m.dtype for m in c.outputs if m.dtype in FLOATS), None)
                 for i, c in calls.items()}
    forward = [o for o in trace.ops if o.phase == "forward"]
    round_trips = _round_trip_casts(forward, calls_out)
    params = {p.name for p in trace.parameters} | {t for p in trace.parameters for t in p.tied_to}
    buffers = {b.name for b in trace.buffers}
    changes = []
    for o in forward:
        out = _primary_output(o)
        call = calls.get(o.caller) if o.caller is not None else None
        func = call.func if call else None
        explicit = func in EXPLICIT_CASTS
        if out is None or not _is_change(o, out, explicit):
            continue
        cause, detail = _cause(o, out, call, explicit, round_trips.get(o.index), params, buffers,
                               trace.setting.autocast_dtype)
        changes.append(DtypeChange(o.index, o.op, o.module, o.phase,
                                   tuple(m.dtype for m in o.inputs), out, cause, detail, func,
                                   o.source, o.input_names))
    return changes


def _cause(o: OpCall, out: str, call: FunctionCall | None, explicit: bool, round_trip: str | None,
           params: set[str], buffers: set[str], autocast: str | None) -> tuple[str, str]:
    func = short_name(call.func) if call else o.op
    if round_trip is not None:
        return "op-defined", f"{func} computes in {round_trip} and casts its result back"
    if o.autocast_cast:
        # A trace without the call (hand-built, or read from older JSON) falls back on the
        # setting's autocast dtype; without that too, a cast to anything but float32 is taken
        # to be to the autocast dtype (the float32 list is the only one that casts to float32).
        if call is not None:
            autocast = call.autocast
        if out == autocast or (autocast is None and out != "float32"):
            return "autocast-policy", "lower-precision list"
        return "autocast-policy", "float32 list" if out == "float32" else "promote list"
    if explicit:
        assert call is not None  # (explicit: the op ran under a call to a cast function)
        return "explicit-cast", call.func
    named = [(n, m.dtype) for m, n in zip(o.inputs, o.input_names, strict=False)
             if n is not None and m.dtype in FLOATS]
    activations = {m.dtype for m, n in zip(o.inputs, o.input_names, strict=False)
                   if n is None and m.dtype in FLOATS}
    deciding = [n for n, d in named if d == out]
    if deciding and out not in activations:
        name = deciding[0]
        kind = "buffer-dtype" if name in buffers and name not in params else "parameter-dtype"
        return kind, name
    if o.op.split(".")[1].endswith("_"):
        # An in-place op (copy_ into a KV cache, add_) writes into its first argument, which
        # keeps its dtype whatever the others are.
        return "op-defined", f"in-place {o.op.split('.')[1]} keeps its destination's dtype"
    floats = {m.dtype for m in o.inputs if m.dtype in FLOATS}
    if len(floats) > 1 and out in floats:
        promoted = [n for n, d in named if d != out]
        return "type-promotion", (f"{', '.join(promoted)} promoted to {out}" if promoted else "")
    # The function picks its output dtype itself (a dtype= argument, a cast inside a
    # composite function): nothing among the inputs explains it.
    return "op-defined", f"{func} returns {out}"


def group(items: Iterable[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """Items (changes, ops) grouped by `key`, groups in order of first appearance."""
    groups: dict[K, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def by_cause(changes: Iterable[DtypeChange], cause: str) -> list[DtypeChange]:
    return [c for c in changes if c.cause == cause]
