"""What changed in dtype between two traces: modules, ops, autocast casts and tensors.

`diff_traces(a, b)` compares two traces of one model — two settings, two devices, or two saved
JSON files read back with `Trace.from_dict` — and returns a `TraceDiff`. It is pure: records in,
report out. How module calls (by phase, name and occurrence), ops (what both ran alike cancels
out), autocast's casts (counted apart, per module and tensor cast) and tensors (by name) are
matched: docs/cli.md, "ampscope diff"; the JSON (`TraceDiff.to_dict()`, schema
`ampscope.diff/1`), every field with examples: docs/json-schema.md.

`timing` (None unless both steps were predicted on one GPU: `diff_traces(..., predicted=)`)
says why one is faster (analysis/time_diff.py).

Namesakes, the same concern at another layer: `render/diff.py`."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ampscope.analysis.causes import group
from ampscope.analysis.flow import FlowRow, collapse_blocks, collapse_steps, dtypes, repeat_unit
from ampscope.analysis.step_time import StepTime
from ampscope.analysis.time_diff import TimeDiff, time_diff
from ampscope.records import PHASES, ModuleCall, OpCall, Trace, module_label

SCHEMA = "ampscope.diff/1"

Dtypes = tuple[str, ...]
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Side:
    """The input and output dtypes of a module call or op in one trace."""

    inputs: Dtypes
    outputs: Dtypes

    def to_dict(self) -> dict:
        return {"in": list(self.inputs), "out": list(self.outputs)}


@dataclass(frozen=True)
class ModuleChange:
    phase: str
    name: str  # may be collapsed: "transformer.h.0–11.attn.c_attn"
    type: str
    a: Side | None  # None: this call is not in trace A
    b: Side | None
    depth: int = 0
    repeats: int = 1  # calls this row stands for
    note: str = ""  # "× 4 steps" ("× 4 passes" where a trace never stepped: flow.repeat_unit)


@dataclass(frozen=True)
class OpChange:
    phase: str
    module: str  # module label, may be collapsed
    op: str
    a: Side | None  # None: ran in B only
    b: Side | None  # None: ran in A only
    count: int = 1  # ops this row stands for


@dataclass(frozen=True)
class CastChange:
    """Autocast casts of one tensor in one module whose number differs between A and B."""

    phase: str
    module: str
    tensor: str | None  # the parameter or buffer cast (may be collapsed); None: an activation
    src: str
    dst: str
    a: int
    b: int


@dataclass(frozen=True)
class TensorChange:
    category: str  # "parameter", "gradient", "buffer", "optimizer state", "input", ...
    name: str
    a: str | None  # dtype in A; None: absent (for a gradient: none was produced)
    b: str | None


@dataclass(frozen=True)
class DiffSummary:
    modules_changed: int = 0
    modules_only_a: int = 0
    modules_only_b: int = 0
    ops_changed: int = 0
    ops_only_a: int = 0
    ops_only_b: int = 0
    casts_a: int = 0
    casts_b: int = 0
    casts_appeared: int = 0
    casts_disappeared: int = 0
    tensors_changed: int = 0
    tensors_only_a: int = 0
    tensors_only_b: int = 0

    @property
    def identical(self) -> bool:
        # Every count but casts_a and casts_b, which count each trace's casts, not differences.
        return not any(n for name, n in vars(self).items() if name not in ("casts_a", "casts_b"))


@dataclass(frozen=True)
class TraceDiff:
    a: dict  # {"model", "setting", "workload"} of each trace
    b: dict
    modules: tuple[ModuleChange, ...] = ()
    ops: tuple[OpChange, ...] = ()
    casts: tuple[CastChange, ...] = ()
    tensors: tuple[TensorChange, ...] = ()
    summary: DiffSummary = field(default_factory=DiffSummary)
    timing: TimeDiff | None = None  # both steps predicted on one GPU: why one is faster

    @property
    def identical(self) -> bool:
        return self.summary.identical

    def to_dict(self) -> dict:
        def side(s: Side | None) -> dict | None:
            return s.to_dict() if s is not None else None

        return {
            "schema": SCHEMA,
            "a": self.a,
            "b": self.b,
            "summary": {"identical": self.identical, **vars(self.summary)},
            "modules": [{"phase": m.phase, "name": m.name, "type": m.type, "depth": m.depth,
                         "repeats": m.repeats, "note": m.note, "a": side(m.a), "b": side(m.b)}
                        for m in self.modules],
            "ops": [{"phase": o.phase, "module": o.module, "op": o.op, "count": o.count,
                     "a": side(o.a), "b": side(o.b)} for o in self.ops],
            "casts": [{"phase": c.phase, "module": c.module, "tensor": c.tensor, "from": c.src,
                       "to": c.dst, "a": c.a, "b": c.b} for c in self.casts],
            "tensors": [{"category": t.category, "name": t.name, "a": t.a, "b": t.b}
                        for t in self.tensors],
            "timing": self.timing.to_dict() if self.timing is not None else None,
        }


def diff_traces(a: Trace, b: Trace,
                predicted: tuple[StepTime | None, StepTime | None] = (None, None)) -> TraceDiff:
    """Every dtype difference between trace `a` and trace `b`; with both steps `predicted` on
    one accelerator, why one is faster (`timing`)."""
    modules = _module_changes(a.modules, b.modules, repeat_unit(a.workload, b.workload))
    ops = _op_changes(a.ops, b.ops)
    casts = _cast_changes(a.ops, b.ops)
    tensors = _tensor_changes(a, b)
    summary = DiffSummary(
        modules_changed=sum(m.repeats for m in modules if m.a and m.b),
        modules_only_a=sum(m.repeats for m in modules if not m.b),
        modules_only_b=sum(m.repeats for m in modules if not m.a),
        ops_changed=sum(o.count for o in ops if o.a and o.b),
        ops_only_a=sum(o.count for o in ops if not o.b),
        ops_only_b=sum(o.count for o in ops if not o.a),
        casts_a=sum(o.autocast_cast for o in a.ops),
        casts_b=sum(o.autocast_cast for o in b.ops),
        casts_appeared=sum(max(c.b - c.a, 0) for c in casts),
        casts_disappeared=sum(max(c.a - c.b, 0) for c in casts),
        tensors_changed=sum(1 for t in tensors if t.a and t.b),
        tensors_only_a=sum(1 for t in tensors if not t.b),
        tensors_only_b=sum(1 for t in tensors if not t.a),
    )
    step_a, step_b = predicted
    timing = (time_diff(step_a, step_b) if step_a is not None and step_b is not None
              and step_a.accelerator == step_b.accelerator else None)
    return TraceDiff(_about(a), _about(b), modules, ops, casts, tensors, summary, timing)


def _about(t: Trace) -> dict:
    return {"model": t.model.name, "setting": t.setting.name, "workload": t.workload}


# --- collapsing pairs of rows -------------------------------------------------------------
# `flow.collapse_blocks` merges rows whose (relative name, kind, inputs, outputs, note) agree.
# A difference has two sides, so each side is packed into one tuple of strings; "→" (never a
# dtype name) separates inputs from outputs and "absent" marks a side that lacks the thing.

_ARROW, _ABSENT = "→", ("absent",)


def _pack(side: Side | None) -> Dtypes:
    return _ABSENT if side is None else (*side.inputs, _ARROW, *side.outputs)


def _unpack(packed: Dtypes) -> Side | None:
    if packed == _ABSENT:
        return None
    cut = packed.index(_ARROW)
    return Side(packed[:cut], packed[cut + 1:])


def _merge_keys(a: Sequence[K], b: Sequence[K]) -> list[K]:
    """A's keys in order, each of B's own keys placed after the key B had before it."""
    in_a = set(a)
    after: dict[K | None, list[K]] = defaultdict(list)
    previous: K | None = None
    for key in b:
        if key in in_a:
            previous = key
        else:
            after[previous].append(key)
    merged = list(after[None])
    for key in a:
        merged.append(key)
        merged.extend(after[key])
    return merged


def _keyed(calls: Sequence[ModuleCall], phase: str) -> dict[tuple[str, int], ModuleCall]:
    seen: Counter[str] = Counter()
    out: dict[tuple[str, int], ModuleCall] = {}
    for c in calls:
        if c.phase == phase:
            out[(c.name, seen[c.name])] = c
            seen[c.name] += 1
    return out


def _side(c: ModuleCall | OpCall | None) -> Side | None:
    return None if c is None else Side(dtypes(c.inputs), dtypes(c.outputs))


def _module_changes(a: Sequence[ModuleCall], b: Sequence[ModuleCall],
                    unit: str = "steps") -> tuple[ModuleChange, ...]:
    out: list[ModuleChange] = []
    for phase in PHASES:
        ka, kb = _keyed(a, phase), _keyed(b, phase)
        # Steps as in flow.module_flow: in forward, each call of the outermost module starts one.
        steps: list[list[FlowRow]] = []
        for key in _merge_keys(list(ka), list(kb)):
            ca, cb = ka.get(key), kb.get(key)
            call = ca or cb
            assert call is not None  # (a merged key is a key of one side or both)
            if not steps or (phase == "forward" and call.depth == 0):
                steps.append([])
            sa, sb = _side(ca), _side(cb)
            if sa != sb:
                steps[-1].append(FlowRow(module_label(call.name), call.type, _pack(sa), _pack(sb),
                                         call.depth))
        for count, rows in collapse_steps(steps, key=lambda r: (r.name, r.inputs, r.outputs)):
            note = f"× {count} {unit}" if count > 1 else ""
            out.extend(ModuleChange(phase, r.name, r.kind, _unpack(r.inputs), _unpack(r.outputs),
                                    r.depth, r.repeats * count, note)
                       for r in collapse_blocks(rows))
    return tuple(out)


def _op_changes(a: Sequence[OpCall], b: Sequence[OpCall]) -> tuple[OpChange, ...]:
    """Per (phase, module), the ops left over once what both ran alike cancels out."""
    def where(o: OpCall) -> tuple[str, str | None]:
        return o.phase, o.module

    ga = group([o for o in a if not o.autocast_cast], where)
    gb = group([o for o in b if not o.autocast_cast], where)
    rows: list[FlowRow] = []  # name: module, kind: op, inputs/outputs: packed sides, note: phase
    for phase, module in _merge_keys(list(ga), list(gb)):
        left_a = _leftover(ga.get((phase, module), []), gb.get((phase, module), []))
        left_b = _leftover(gb.get((phase, module), []), ga.get((phase, module), []))
        for op in dict.fromkeys([o.op for o in left_a + left_b]):
            sides_a = [_side(o) for o in left_a if o.op == op]
            sides_b = [_side(o) for o in left_b if o.op == op]
            for i in range(max(len(sides_a), len(sides_b))):  # pair them in call order
                sa = sides_a[i] if i < len(sides_a) else None
                sb = sides_b[i] if i < len(sides_b) else None
                rows.append(FlowRow(module_label(module), op, _pack(sa), _pack(sb), note=phase))
    return tuple(OpChange(phase, module, op, sa, sb, count)
                 for (phase, module, op, sa, sb), count in _counted(rows).items())


def _leftover(mine: list[OpCall], theirs: list[OpCall]) -> list[OpCall]:
    """`mine` less those that `theirs` matches one for one, in call order."""
    unmatched = Counter((o.op, _side(o)) for o in theirs)
    out = []
    for o in mine:
        k = (o.op, _side(o))
        if unmatched[k]:
            unmatched[k] -= 1
        else:
            out.append(o)
    return out


def _counted(rows: list[FlowRow]) -> dict[tuple, int]:
    """Collapse blocks, then count identical rows (phase, module, op, a, b) in first-seen order."""
    counts: dict[tuple, int] = {}
    for r in collapse_blocks(rows):
        key = (r.note, r.name, r.kind, _unpack(r.inputs), _unpack(r.outputs))
        counts[key] = counts.get(key, 0) + r.repeats
    return counts


def _cast_changes(a: Sequence[OpCall], b: Sequence[OpCall]) -> tuple[CastChange, ...]:
    def key(o: OpCall) -> tuple:
        tensor = next((n for n in o.input_names if n), None)
        return (o.phase, o.module, tensor, o.inputs[0].dtype if o.inputs else "?",
                o.outputs[0].dtype if o.outputs else "?")

    ca = Counter(key(o) for o in a if o.autocast_cast)
    cb = Counter(key(o) for o in b if o.autocast_cast)
    # Rows to collapse: name = module, kind = the tensor relative to the module when it lives
    # there (so "h.3.fc" casting "h.3.fc.weight" collapses with h.4), note = the counts.
    rows: list[FlowRow] = []
    for k in _merge_keys(list(ca), list(cb)):
        if ca[k] == cb[k]:
            continue
        phase, module, tensor, src, dst = k
        label = module_label(module)
        prefix = f"{module}." if module else ""
        if tensor is None:
            kind = ""
        elif prefix and tensor.startswith(prefix):
            kind = "." + tensor.removeprefix(prefix)
        else:
            kind = tensor
        rows.append(FlowRow(label, kind, (phase, src, dst), (), note=f"{ca[k]}/{cb[k]}"))
    out = []
    for r in collapse_blocks(rows):
        phase, src, dst = r.inputs
        na, nb = (int(n) * r.repeats for n in r.note.split("/"))
        tensor = (r.name + r.kind if r.kind.startswith(".") else r.kind) or None
        out.append(CastChange(phase, r.name, tensor, src, dst, na, nb))
    return tuple(out)


def _tensor_changes(a: Trace, b: Trace) -> tuple[TensorChange, ...]:
    def tables(t: Trace) -> list[tuple[str, dict[str, str | None]]]:
        return [
            ("parameter", {p.name: p.dtype for p in t.parameters}),
            ("gradient", {p.name: p.grad_dtype for p in t.parameters}),
            ("buffer", {x.name: x.dtype for x in t.buffers}),
            ("optimizer state", {f"{s.param}:{s.key}": s.dtype for s in t.optimizer_state}),
            ("input", {i.name: i.dtype for i in t.inputs if i.role != "target"}),
            ("target", {i.name: i.dtype for i in t.inputs if i.role == "target"}),
            ("output", {o.name: o.dtype for o in t.outputs}),
        ]

    out: list[TensorChange] = []
    for (category, ta), (_, tb) in zip(tables(a), tables(b), strict=True):
        if category == "gradient":  # a parameter in one trace only is reported once, as such
            shared = ta.keys() & tb.keys()
            ta = {k: v for k, v in ta.items() if k in shared}
            tb = {k: v for k, v in tb.items() if k in shared}
        for name in _merge_keys(list(ta), list(tb)):
            da, db = ta.get(name), tb.get(name)
            if da != db:
                out.append(TensorChange(category, name, da, db))
    return tuple(out)


@dataclass(frozen=True)
class TensorGroup:
    """Tensor changes with one category and one pair of dtypes, for a short listing."""

    category: str
    a: str | None
    b: str | None
    names: tuple[str, ...]


def tensor_groups(changes: Sequence[TensorChange]) -> list[TensorGroup]:
    """Changes grouped by (category, A dtype, B dtype), in first-seen order."""
    return [TensorGroup(*k, tuple(t.name for t in ts))
            for k, ts in group(changes, lambda t: (t.category, t.a, t.b)).items()]
