"""Terminal rendering of a `TraceDiff` with rich. Reads the report; computes nothing of its own.

Namesakes, the same concern at another layer: `analysis/diff.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.diff import DiffSummary, Side, TraceDiff, tensor_groups
from ampscope.analysis.time_diff import TimeDiff
from ampscope.records import PHASES
from ampscope.render.predicted_step import duration
from ampscope.render.style import ColumnOptions, dtype_text, short_op, titled_table

WHICH_NAMES = 3  # names listed per group of tensor changes before "… N more"


def side_text(side: Side | None) -> Text:
    """"fp32 → bf16", or "absent" for a side that lacks the module or op."""
    if side is None:
        return Text("absent", style="dim")
    text = dtype_text(side.inputs)
    text.append(" → ")
    text.append_text(dtype_text(side.outputs))
    return text


def one_dtype(dtype: str | None) -> Text:
    return dtype_text([dtype]) if dtype is not None else Text("absent", style="dim")


def diff_header(d: TraceDiff, label_a: str, label_b: str) -> Text:
    text = Text.assemble(("A: ", "dim"), (label_a, "bold"), "  vs  ", ("B: ", "dim"),
                         (label_b, "bold"))
    models = {d.a.get("model"), d.b.get("model")}
    workloads = {d.a.get("workload"), d.b.get("workload")}
    if len(models) == 1 and len(workloads) == 1:
        text.append(f"  ({models.pop()}, {workloads.pop()})", style="dim")
    return text


def _table(title: str, columns: list[str], right: tuple[str, ...] = ()) -> Table:
    # Names matter most: keep them on one line and let the other columns wrap instead.
    return titled_table(title, *((col, ColumnOptions(no_wrap=col in ("module", "tensor"),
                                                     overflow="fold")) for col in columns),
                        right=right)


def module_table(d: TraceDiff, phase: str) -> Table | None:
    rows = [m for m in d.modules if m.phase == phase]
    if not rows:
        return None
    notes = any(m.note for m in rows)
    table = _table(f"Modules that changed dtype, {phase}",
                   ["module", "type", "A in → out", "B in → out"] + (["note"] if notes else []))
    for m in rows:
        table.add_row("  " * m.depth + m.name, m.type, side_text(m.a), side_text(m.b),
                      *([Text(m.note, style="dim")] if notes else []))
    return table


def op_table(d: TraceDiff, phase: str) -> Table | None:
    rows = [o for o in d.ops if o.phase == phase]
    if not rows:
        return None
    table = _table(f"Ops that changed dtype, {phase}", ["module", "op", "×", "A in → out",
                                                         "B in → out"], right=("×",))
    for o in rows:
        table.add_row(o.module, short_op(o.op), str(o.count), side_text(o.a), side_text(o.b))
    return table


def cast_table(d: TraceDiff) -> Table | None:
    if not d.casts:
        return None
    table = _table("Autocast casts that appeared or disappeared",
                   ["module", "tensor", "cast", "A", "B"], right=("A", "B"))
    for c in d.casts:
        cast = dtype_text([c.src])
        cast.append(" → ")
        cast.append_text(dtype_text([c.dst]))
        tensor = Text(c.tensor) if c.tensor else Text("(activation)", style="dim")
        phase = "" if c.phase == "forward" else f" ({c.phase})"
        table.add_row(c.module + phase, tensor, cast, str(c.a), str(c.b))
    return table


def tensor_table(d: TraceDiff) -> Table | None:
    if not d.tensors:
        return None
    table = _table("Tensors that changed dtype", ["category", "A", "B", "count", "which"],
                   right=("count",))
    for g in tensor_groups(d.tensors):
        which = ", ".join(g.names[:WHICH_NAMES])
        if len(g.names) > WHICH_NAMES:
            which += f", … {len(g.names) - WHICH_NAMES} more"
        table.add_row(g.category, one_dtype(g.a), one_dtype(g.b), str(len(g.names)), which)
    return table


def summary_text(s: DiffSummary) -> Text:
    parts = [
        f"{s.modules_changed} module calls changed dtype",
        f"{s.ops_changed} ops changed dtype",
        f"autocast casts {s.casts_a} → {s.casts_b} (+{s.casts_appeared} −{s.casts_disappeared})",
        f"{s.tensors_changed} tensors changed dtype",
    ]
    only = [(s.modules_only_a, s.modules_only_b, "module calls"), (s.ops_only_a, s.ops_only_b, "ops"),
            (s.tensors_only_a, s.tensors_only_b, "tensors")]
    parts += [f"{na} {what} only in A, {nb} only in B" for na, nb, what in only if na or nb]
    return Text("Summary: " + "; ".join(parts) + ".", style="italic")


def timing_section(t: TimeDiff, label_a: str, label_b: str) -> RenderableType:
    """"Why one is faster": both predicted steps, then the milliseconds moved by bound, by
    phase and in the modules that moved most."""
    faster, slower = (label_b, label_a) if t.b < t.a else (label_a, label_b)
    ratio = max(t.a, t.b) / min(t.a, t.b) if min(t.a, t.b) else 0.0
    head = Text("Why one is faster", style="italic")
    head.append(f" (predicted on {t.accelerator.upper()}): A {label_a} {duration(t.a)} "
                f"({t.tokens_per_second_a:,.0f} tokens/s), B {label_b} {duration(t.b)} "
                f"({t.tokens_per_second_b:,.0f} tokens/s)")
    if t.a != t.b:
        head.append(f"; {faster} is {ratio:.2f}× faster than {slower}", style="bold")
    numbers = ("A ms", "B ms", "moved")
    parts: list[RenderableType] = [head]
    for title, rows, first in (("By bound", t.by_bound, "bound"),
                               ("By phase", t.by_phase, "phase"),
                               ("Modules that moved most (own ops)", t.modules, "module")):
        table = titled_table(title, (first, {"overflow": "fold"}), *numbers, right=numbers)
        for m in rows:
            if m.a or m.b:
                table.add_row(m.name, f"{m.a * 1e3:,.2f}", f"{m.b * 1e3:,.2f}",
                              f"{m.delta * 1e3:+,.2f}")
        if table.rows:
            parts += [Text(), table]
    return Group(*parts)


def render_diff(d: TraceDiff, label_a: str, label_b: str, *, ops: bool = False) -> RenderableType:
    """Header, changed modules per phase, cast changes, tensor changes (and with `ops`, the
    ops per phase), then the counts and, where both steps were predicted on one GPU, why one
    is faster; when the traces agree in every dtype, a single line (and why one is faster)."""
    parts: list[RenderableType] = [diff_header(d, label_a, label_b), Text()]
    if d.identical:  # TF32 against fp32: the same dtypes, but not the same time
        parts.append(Text("no dtype differences", style="bold green"))
    else:
        tables = [module_table(d, phase) for phase in PHASES]
        tables += [cast_table(d), tensor_table(d)]
        if ops:
            tables += [op_table(d, phase) for phase in PHASES]
        for table in tables:
            if table is not None:
                parts += [table, Text()]
        parts.append(summary_text(d.summary))
    if d.timing is not None:
        parts += [Text(), timing_section(d.timing, label_a, label_b)]
    return Group(*parts)
