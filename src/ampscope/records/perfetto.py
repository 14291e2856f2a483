"""The step as a timeline for ui.perfetto.dev and chrome://tracing (`Trace.to_perfetto()`,
`--perfetto PATH`), in the Trace Event JSON format both read.

- One track (thread) per phase: forward, backward, optimizer.
- On it, module spans nested as the module names nest ("transformer.h.0" around
  "transformer.h.0.attn" around "transformer.h.0.attn.c_q"), each a run of consecutive ops
  under that module; an op is a slice inside its innermost module, and its args carry its
  dtypes, shapes, autocast flag, source line and FLOPs.
- Counter tracks: the bytes live through each op by storage category (their sum at the peak op
  is `MemoryReport.peak.bytes`), and the FLOPs counted so far.

Timestamps are op order: op k spans [k, k+1) µs, for traces carry no per-op wall time (a
predicted step has none to carry). Module spans come from module names, not from the call
stack: a module called from outside its parent appears nested under its name's parent, and two
calls of one module with no op between them merge into one span.

The document is plain data built from the records alone, so it lives with them: `Trace`
(records/trace.py, which imports this module) hands over its records and names.
"""

from __future__ import annotations

from collections.abc import Sequence

from ampscope.records.tensors import (
    PHASES,
    STORAGE_CATEGORIES,
    FunctionCall,
    ModuleCall,
    OpCall,
    StorageRecord,
    TensorMeta,
    module_label,
)
from ampscope.records.timeline import live_bytes
from ampscope.wording import short_op

PID = 1
TIDS: dict[str, int] = {phase: i + 1 for i, phase in enumerate(PHASES)}


def _meta(name: str, tid: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": PID, "tid": tid, "args": args}


def _tensors(metas: Sequence[TensorMeta], names: Sequence[str | None] = ()) -> list[str]:
    """["float32[1, 64, 768]", ...], with the parameter's name where the op read one."""
    out = []
    for i, m in enumerate(metas):
        text = f"{m.dtype}{list(m.shape)}"
        name = names[i] if i < len(names) else None
        out.append(f"{text} {name}" if name else text)
    return out


def _op_event(op: OpCall, ts: int, autocast: str | None, call: str | None) -> dict:
    args = {"op": op.op, "module": module_label(op.module), "inputs": _tensors(op.inputs, op.input_names),
            "outputs": _tensors(op.outputs), "autocast_cast": op.autocast_cast,
            "autocast": autocast, "call": call, "source": op.source, "flops": op.flops}
    if op.grad_fn:
        args["grad_fn"] = op.grad_fn
    return {"ph": "X", "name": short_op(op.op), "cat": "op", "ts": ts, "dur": 1, "pid": PID,
            "tid": TIDS.get(op.phase, TIDS["forward"]), "args": args}


def _chain(module: str | None, called: set[str]) -> list[str]:
    """The called modules around `module`, outermost first: "" (the model), then each prefix
    of its dotted name that was called ("transformer.h" is a ModuleList: never called)."""
    if module is None:
        return []
    parts = module.split(".") if module else []
    chain = [""] if "" in called else []
    chain += [p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in called]
    return chain


def _module_spans(ops: Sequence[OpCall], modules: Sequence[ModuleCall]) -> list[dict]:
    """X events for the module spans of every phase: a stack opened and closed as consecutive
    ops enter and leave modules, so every span holds its ops and its children's spans."""
    called = {m.name for m in modules}
    types = {m.name: m.type for m in modules}
    events: list[dict] = []
    stack: list[tuple[str, int]] = []  # (module, first op index)
    phase: str | None = None

    def close(down_to: int, end: int) -> None:
        while len(stack) > down_to:
            assert phase is not None  # (a span opens once the first op has set the phase)
            name, start = stack.pop()
            events.append({"ph": "X", "name": module_label(name), "cat": "module", "ts": start,
                           "dur": end - start, "pid": PID, "tid": TIDS.get(phase, 1),
                           "args": {"module": module_label(name), "type": types.get(name)}})

    for k, op in enumerate(ops):
        chain = _chain(op.module, called)
        if op.phase != phase:
            close(0, k)
            phase = op.phase
        same = 0
        while same < len(stack) and same < len(chain) and stack[same][0] == chain[same]:
            same += 1
        close(same, k)
        stack.extend((name, k) for name in chain[same:])
    close(0, len(ops))
    return events


def _counters(ops: Sequence[OpCall], storages: Sequence[StorageRecord]) -> list[dict]:
    n = len(ops)
    events: list[dict] = []
    by_category = {}
    for category in STORAGE_CATEGORIES:
        of_category = [s for s in storages if s.category == category]
        if of_category:
            by_category[category] = live_bytes(of_category, n)[1]
    previous = None
    for k in range(n):
        values = {c: live[k] for c, live in by_category.items()}
        if values and values != previous:  # a counter holds its value until the next event
            events.append({"ph": "C", "name": "live bytes", "ts": k, "pid": PID,
                           "args": values})
            previous = values
    total = 0
    for k, op in enumerate(ops):
        if op.flops or k == 0:
            total += op.flops
            events.append({"ph": "C", "name": "FLOPs so far", "ts": k, "pid": PID,
                           "args": {"flops": total}})
    return events


def perfetto_trace(*, model: str, setting: str, workload: str, mode: str,
                   ops: Sequence[OpCall], calls: Sequence[FunctionCall],
                   modules: Sequence[ModuleCall], storages: Sequence[StorageRecord]) -> dict:
    """The Trace Event JSON document of one trace's records (`Trace.to_perfetto` gives them)."""
    by_index = {c.index: c for c in calls}
    events = [_meta("process_name", 0, {"name": f"{model} · {setting} · {workload}"})]
    for phase, tid in TIDS.items():
        events += [_meta("thread_name", tid, {"name": phase}),
                   _meta("thread_sort_index", tid, {"sort_index": tid})]
    slices = _module_spans(ops, modules)
    for k, op in enumerate(ops):
        call = by_index.get(op.caller) if op.caller is not None else None
        slices.append(_op_event(op, k, call.autocast if call else None,
                                call.func if call else None))
    # Parents before children: by start, then longest first (viewers nest on this order).
    slices.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"], e["cat"] != "module"))
    return {
        "traceEvents": events + slices + _counters(ops, storages),
        "displayTimeUnit": "ns",
        "otherData": {"model": model, "setting": setting, "workload": workload, "mode": mode,
                      "timestamps": "op order: op k spans [k, k+1) µs", "ops": len(ops)},
    }
