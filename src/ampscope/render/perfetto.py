"""The step as a timeline for ui.perfetto.dev and chrome://tracing (`--perfetto PATH`,
`Trace.to_perfetto()`), in the Trace Event JSON format both read.

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
"""

from __future__ import annotations

import json
from pathlib import Path

from ampscope.analysis.memory import live_bytes
from ampscope.files import write_atomic
from ampscope.records import PHASES, STORAGE_CATEGORIES, OpCall, Trace, module_label
from ampscope.render.style import short_op

PID = 1
TIDS: dict[str, int] = {phase: i + 1 for i, phase in enumerate(PHASES)}


def _meta(name: str, tid: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": PID, "tid": tid, "args": args}


def _tensors(metas, names=None) -> list[str]:
    """["float32[1, 64, 768]", ...], with the parameter's name where the op read one."""
    out = []
    for i, m in enumerate(metas):
        text = f"{m.dtype}{list(m.shape)}"
        name = names[i] if names and i < len(names) else None
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


def module_spans(trace: Trace) -> list[dict]:
    """X events for the module spans of every phase: a stack opened and closed as consecutive
    ops enter and leave modules, so every span holds its ops and its children's spans."""
    called = {m.name for m in trace.modules}
    types = {m.name: m.type for m in trace.modules}
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

    for k, op in enumerate(trace.ops):
        chain = _chain(op.module, called)
        if op.phase != phase:
            close(0, k)
            phase = op.phase
        same = 0
        while same < len(stack) and same < len(chain) and stack[same][0] == chain[same]:
            same += 1
        close(same, k)
        stack.extend((name, k) for name in chain[same:])
    close(0, len(trace.ops))
    return events


def _counters(trace: Trace) -> list[dict]:
    n = len(trace.ops)
    events: list[dict] = []
    by_category = {}
    for category in STORAGE_CATEGORIES:
        storages = [s for s in trace.storages if s.category == category]
        if storages:
            by_category[category] = live_bytes(storages, n)[1]
    previous = None
    for k in range(n):
        values = {c: live[k] for c, live in by_category.items()}
        if values and values != previous:  # a counter holds its value until the next event
            events.append({"ph": "C", "name": "live bytes", "ts": k, "pid": PID,
                           "args": values})
            previous = values
    total = 0
    for k, op in enumerate(trace.ops):
        if op.flops or k == 0:
            total += op.flops
            events.append({"ph": "C", "name": "FLOPs so far", "ts": k, "pid": PID,
                           "args": {"flops": total}})
    return events


def perfetto_trace(trace: Trace) -> dict:
    """The Trace Event JSON document of one trace."""
    calls = {c.index: c for c in trace.calls}
    events = [_meta("process_name", 0, {"name": f"{trace.model.name} · {trace.setting.name} · "
                                                f"{trace.workload}"})]
    for phase, tid in TIDS.items():
        events += [_meta("thread_name", tid, {"name": phase}),
                   _meta("thread_sort_index", tid, {"sort_index": tid})]
    slices = module_spans(trace)
    for k, op in enumerate(trace.ops):
        call = calls.get(op.caller) if op.caller is not None else None
        slices.append(_op_event(op, k, call.autocast if call else None,
                                call.func if call else None))
    # Parents before children: by start, then longest first (viewers nest on this order).
    slices.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"], e["cat"] != "module"))
    return {
        "traceEvents": events + slices + _counters(trace),
        "displayTimeUnit": "ns",
        "otherData": {"model": trace.model.name, "setting": trace.setting.name,
                      "workload": trace.workload, "mode": trace.mode,
                      "timestamps": "op order: op k spans [k, k+1) µs",
                      "ops": len(trace.ops)},
    }


def to_perfetto(trace: Trace, path: str | Path | None = None) -> dict:
    """The timeline of `trace` as a Trace Event JSON document, written atomically to `path`
    when given (open it in ui.perfetto.dev or chrome://tracing)."""
    document = perfetto_trace(trace)
    if path is not None:
        write_atomic(path, json.dumps(document, separators=(",", ":")) + "\n")
    return document


def register() -> None:
    """Give `Trace` its `to_perfetto` method: records sit below this layer and must not import
    it (`import ampscope` calls this once, as it attaches the notebook views)."""
    Trace.to_perfetto = to_perfetto  # type: ignore[attr-defined]
