"""The dtype flow through modules and ops, with identical repeated blocks collapsed.

A transformer's blocks (`transformer.h.0` … `transformer.h.11`) usually run in the same dtypes;
a table that lists each of them says nothing twelve times. Consecutive blocks of one container
whose rows are identical (relative names, types and dtypes) become one row per member named
`transformer.h.0–11.attn`. Consecutive identical steps (sampling calls the model once per token)
collapse the same way: "× 4 steps" where the workload steps (training, decoding), "× 4 passes"
where it never did (a script's evaluation loop, a sampler stopped before any optimizer step).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass, replace
from itertools import groupby
from typing import Any, ClassVar, Protocol, TypeVar, overload

from ampscope.records import ModuleCall, OpCall, TensorMeta, module_label
from ampscope.records.fp8 import is_fp8_cast, short_fp8

R = TypeVar("R")


class Collapsible(Protocol):
    """What `collapse_blocks` merges: a dataclass row with a name and a repeat count (FlowRow,
    a matrix row), so that it can `replace` both."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def name(self) -> str: ...

    @property
    def repeats(self) -> int: ...


Row = TypeVar("Row", bound=Collapsible)

# The first dotted segment that is a number splits a name into container, index and rest.
_BLOCK = re.compile(r"^(?P<container>(?:[^.]+\.)*?[^.]+)\.(?P<index>\d+)(?P<rest>(?:\..+)?)$")


@dataclass(frozen=True)
class FlowRow:
    name: str  # may be collapsed: "transformer.h.0–11.attn.c_attn"
    kind: str  # module type or op name
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    depth: int = 0
    repeats: int = 1  # how many blocks or steps this row stands for
    note: str = ""  # e.g. "autocast cast", a source location

    @property
    def changes_dtype(self) -> bool:
        """Floating activations leave in another dtype than they came in."""
        fin = {d for d in self.inputs if d.startswith(("float", "bfloat"))}
        fout = {d for d in self.outputs if d.startswith(("float", "bfloat"))}
        return bool(fin and fout and fin != fout)


def dtypes(metas: tuple[TensorMeta, ...]) -> tuple[str, ...]:
    return tuple(m.dtype for m in metas)


def split_block(name: str) -> tuple[str, int, str] | None:
    """"transformer.h.3.attn.c_attn" -> ("transformer.h", 3, ".attn.c_attn")."""
    m = _BLOCK.match(name)
    if not m:
        return None
    return m["container"], int(m["index"]), m["rest"]


def block_parts(name: str) -> tuple[str, int, str]:
    """`split_block` of a name known to be a block's, or a block member's."""
    parts = split_block(name)
    assert parts is not None, name
    return parts


def _steps(calls: Sequence[ModuleCall]) -> list[list[ModuleCall]]:
    """Split forward module calls into steps, one per call of the outermost module."""
    steps: list[list[ModuleCall]] = []
    for c in calls:
        if c.depth == 0 or not steps:
            steps.append([])
        steps[-1].append(c)
    return steps


def first_step(calls: Sequence[ModuleCall]) -> list[ModuleCall]:
    """Forward module calls of the first call of the outermost module (sampling calls the model
    once a token)."""
    steps = _steps([c for c in calls if c.phase == "forward"])
    return steps[0] if steps else []


# Workloads whose repeated forward passes are steps: a training run's (micro-)steps, generate's
# decode steps. Any other (a script that never reached an optimizer step: "forward", a custom
# callable) only ran passes of its model; "× 10000 steps" would claim steps that never ran.
STEPPING = ("train", "generate")


def repeat_unit(*workloads: str) -> str:
    """What a row standing for several identical forward passes counts: "steps" where every
    trace's workload steps, else "passes"."""
    return "steps" if workloads and all(w in STEPPING for w in workloads) else "passes"


def flow_key(row: FlowRow) -> tuple:
    """What must be equal for two rows of consecutive blocks to merge (all but the name)."""
    return (row.kind, row.inputs, row.outputs, row.note)


@overload
def collapse_blocks(rows: list[FlowRow]) -> list[FlowRow]: ...


@overload
def collapse_blocks(rows: list[Row], key: Callable[[Row], tuple]) -> list[Row]: ...


# (The default key is for FlowRows, as the first overload says; other rows pass their own.)
def collapse_blocks(rows: list[Row], key: Callable[[Any], tuple] = flow_key) -> list[Row]:
    """Merge runs of consecutive, identical blocks of one container into ranged rows.

    Rows are any dataclass with `name` and `repeats` (FlowRow, a matrix row); `key` gives
    what must be equal, besides the name within the block, for blocks to merge.
    """
    out: list[Row] = []
    # Runs of rows of one container (None: a row outside any block), then its blocks' rows.
    for container, run in groupby(rows, key=lambda r: (split_block(r.name) or (None,))[0]):
        if container is None:
            out.extend(run)
            continue
        blocks = [(index, list(members))
                  for index, members in groupby(run, key=lambda r: block_parts(r.name)[1])]
        out.extend(_merge_identical(container, blocks, key))
    return out


def _merge_identical(container: str, blocks: list[tuple[int, list[Row]]],
                     key: Callable[[Row], tuple]) -> list[Row]:
    def signature(block: list[Row]) -> tuple:
        return tuple((block_parts(r.name)[2], key(r)) for r in block)

    out: list[Row] = []
    k = 0
    while k < len(blocks):
        first, rows = blocks[k]
        sig = signature(rows)
        last = k
        step = 0  # +1 in forward order, -1 in backward order
        while last + 1 < len(blocks):
            delta = blocks[last + 1][0] - blocks[last][0]
            if delta not in (1, -1) or (step and delta != step):
                break
            if signature(blocks[last + 1][1]) != sig:
                break
            step, last = delta, last + 1
        count = last - k + 1
        low, high = sorted((first, blocks[last][0]))
        label = f"{low}–{high}" if count > 1 else str(first)
        for r in rows:
            rest = block_parts(r.name)[2]
            out.append(replace(r, name=f"{container}.{label}{rest}", repeats=r.repeats * count))
        k = last + 1
    return out


def collapse_steps(steps: list[list[R]], key: Callable[[R], tuple]) -> list[tuple[int, list[R]]]:
    """Consecutive steps with identical keys -> (count, first step)."""
    out: list[tuple[int, list[R]]] = []
    for _, run in groupby(steps, key=lambda step: [key(r) for r in step]):
        same = list(run)
        out.append((len(same), same[0]))
    return out


def module_flow(calls: Sequence[ModuleCall], notes: Mapping[str, str] | None = None,
                unit: str = "steps") -> list[FlowRow]:
    """Rows of module input → output dtypes in forward, blocks and steps collapsed; `notes`
    (module name → note) for modules whose dtypes outside do not say it all (an fp8 matmul);
    `unit` names what collapsed forward passes are ("× 4 steps"; `repeat_unit`)."""
    notes = notes or {}
    steps = _steps([c for c in calls if c.phase == "forward"])
    rows: list[FlowRow] = []
    for count, step in collapse_steps(steps, key=lambda c: (c.name, dtypes(c.inputs), dtypes(c.outputs))):
        note = f"× {count} {unit}" if count > 1 else ""
        step_rows = [FlowRow(module_label(c.name), c.type, dtypes(c.inputs), dtypes(c.outputs),
                             c.depth, 1, note if c.depth == 0 else notes.get(c.name, ""))
                     for c in step]
        rows.extend(collapse_blocks(step_rows))
    return rows


def dtype_changes(rows: list[FlowRow]) -> list[FlowRow]:
    """The innermost rows where floating activations change dtype (a parent that only passes
    on its child's change is left out)."""
    return [
        r for i, r in enumerate(rows)
        if r.changes_dtype and not (i + 1 < len(rows) and rows[i + 1].depth > r.depth)
    ]


def op_flow(ops: Sequence[OpCall], phase: str) -> list[FlowRow]:
    """Rows of aten ops (module, op, dtypes) of one phase, repeated blocks collapsed."""
    rows = [
        FlowRow(module_label(o.module), o.op, dtypes(o.inputs), dtypes(o.outputs), 0, 1,
                _op_note(o))
        for o in ops if o.phase == phase
    ]
    return collapse_blocks(rows)


def _op_note(o: OpCall) -> str:
    """"autocast cast", "fp8 cast", the fp8 data of an fp8 training tensor's operands (which
    show their outer dtype), else the user-code line."""
    if o.autocast_cast:
        return "autocast cast"
    if is_fp8_cast(o):
        return "fp8 cast"
    if o.input_data:
        return "fp8 data " + " × ".join(
            short_fp8(d) if d else m.dtype
            for d, m in zip(o.input_data, o.inputs, strict=False))
    return o.source or ""
