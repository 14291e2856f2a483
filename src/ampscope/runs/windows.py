"""A window: the records one recorded block call appended, and the storages it made and freed
— what runs/repeats.py replays for that block's identical twins, renamed to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast, overload

from ampscope.records import FUNCTION_ROW, OP_ROW, Phase
from ampscope.runs.memory import StorageTracker
from ampscope.runs.modules import ModuleTracker

if TYPE_CHECKING:  # the op recorder's module imports the replay engine's users
    from ampscope.runs.functions import FunctionRecorder
    from ampscope.runs.ops import OpRecorder

# The fields a window reads or changes in the rows it copies (records.OP_ROW, FUNCTION_ROW).
_INDEX, _MODULE, _CALLER, _NAMES = (OP_ROW.at(f) for f in ("index", "module", "caller",
                                                           "input_names"))
_PHASE = OP_ROW.at("phase")
_F_INDEX, _F_MODULE = FUNCTION_ROW.at("index"), FUNCTION_ROW.at("module")
# A row copied under another block's names (`append_renamed`), these fields changed.
_copy_op = OP_ROW.replacer("index", "module", "caller", "input_names")
_copy_call = FUNCTION_ROW.replacer("index", "module", "step")


class Recorders(Protocol):
    """The capture's recorders a window reads and appends to, through their public methods
    only."""

    tracker: ModuleTracker
    functions: FunctionRecorder
    ops: OpRecorder
    storages: StorageTracker


class Renamer(Protocol):
    """What `renamer` returns: a name's new name, a str for a str and None for None."""

    @overload
    def __call__(self, name: str, /) -> str: ...
    @overload
    def __call__(self, name: None, /) -> None: ...
    @overload
    def __call__(self, name: str | None, /) -> str | None: ...


def renamer(old: str, new: str) -> Renamer:
    """Names under `old` (a module, its submodules and parameters) as the same names under
    `new`; other names as they are. Each name is worked out once: a block's few hundred
    records name a dozen modules and parameters over and over."""
    dotted = old + "."
    done: dict[str | None, str | None] = {None: None, old: new}

    def rename(name: str | None) -> str | None:
        found = done.get(name, _MISSING)
        if found is _MISSING:
            assert name is not None  # None is in `done` from the start: only a str is missing
            found = done[name] = new + name[len(old):] if name.startswith(dotted) else name
        return found

    # A str's new name is a str (and None's None), which the one signature above cannot say.
    return cast(Renamer, rename)


_MISSING: Any = object()  # Any: a sentinel `done.get` returns in place of a `str | None`


class Window:
    """One recorded block call in one phase: where its records start and end, the storages it
    made (their fates) and the storages from outside it that it freed."""

    def __init__(self, replay: Recorders, prefix: str) -> None:
        self.prefix = prefix
        self.r0 = len(replay.ops.rows)
        self.f0 = len(replay.functions.rows)
        self.c0 = replay.tracker.call_count()
        self.s0 = replay.storages.created_count()
        self.log0 = replay.storages.start_log()
        self.r1 = self.f1 = self.c1 = self.s1 = self.log1 = 0

    def close(self, replay: Recorders) -> None:
        self.r1 = len(replay.ops.rows)
        self.f1 = len(replay.functions.rows)
        self.c1 = replay.tracker.call_count()
        self.s1 = replay.storages.created_count()
        self.log1 = replay.storages.stop_log()
        # The calls of its modules; not its own (opened by the module tracker's hooks, which
        # may run before or after the window's) nor the next block's backward, opened by the
        # same gradient that closes this one.
        children = self.prefix + "."
        self.calls = [c for c in replay.tracker.calls_between(self.c0, self.c1)
                      if c.name.startswith(children)]

    def created(self, replay: Recorders) -> list:
        return replay.storages.created_between(self.s0, self.s1)

    def external_frees(self, replay: Recorders) -> list:
        """Storages made before the window and freed in it, with the op index they were
        freed at."""
        mine = {id(e) for e in self.created(replay)}
        return [e for e in replay.storages.log[self.log0:self.log1] if id(e) not in mine]

    def in_window(self, index: int | None) -> bool:
        return index is not None and self.r0 - 1 <= index < self.r1

    def fates(self, replay: Recorders, named: dict[int, tuple]) -> list:
        """Per storage the window made: what `named` (by its entry's id) calls it — ("out", k),
        ("grad_in", k) — else ("freed", offset) where the window freed it, else "kept"."""
        fates: list = []
        for e in self.created(replay):
            if id(e) in named:
                fates.append(named[id(e)])
            elif self.in_window(e.freed):
                fates.append(("freed", e.freed - self.r0))
            else:
                fates.append("kept")
        return fates

    def is_own(self, replay: Recorders, *, forward: bool) -> bool:
        """Whether every op record in the window is its block's (or its modules'); in forward
        also every module call, and every op's user-level caller in the window."""
        rows = replay.ops.rows[self.r0:self.r1]
        rename = renamer(self.prefix, "@")
        if any(not (rename(r[_MODULE]) or "").startswith("@") for r in rows):
            return False
        if not forward:
            return True
        return all(r[_CALLER] is None or self.f0 <= r[_CALLER] < self.f1 for r in rows) and \
            len(self.calls) == self.c1 - self.c0

    def normalized(self, replay: Recorders, fates: list) -> tuple:
        """The window's records with its block's names and its indices made relative: two
        windows of identical blocks that did the same thing compare equal."""
        rel = renamer(self.prefix, "")
        rows = tuple(
            OP_ROW.replace(r, index=None, module=rel(r[_MODULE]),
                           caller=None if r[_CALLER] is None else r[_CALLER] - self.f0,
                           input_names=tuple(map(rel, r[_NAMES])))
            for r in replay.ops.rows[self.r0:self.r1])
        functions = tuple(FUNCTION_ROW.replace(r, index=None, module=rel(r[_F_MODULE]), step=None)
                          for r in replay.functions.rows[self.f0:self.f1])
        calls = tuple((rel(c.name), c.type, c.phase, c.depth, c.inputs, c.outputs)
                      for c in self.calls)
        storages = tuple((e.nbytes, e.meta, e.created - self.r0) for e in self.created(replay))
        return rows, functions, calls, storages, tuple(fates)

    def append_renamed(self, replay: Recorders, prefix: str, fates: list, *, real: dict,
                       pins: list) -> list:
        """Append a window's records renamed to `prefix`, its storages made again (as entries
        that follow their twins, or as the `real` tensors given for its outputs and
        gradients), and date the frees in `pins` ((entry, offset) pairs). Returns the entries
        made, one per storage the window made."""
        ops, functions = replay.ops, replay.functions
        tracker, storages = replay.tracker, replay.storages
        rename = renamer(self.prefix, prefix)
        r_start, f_start = len(ops.rows), len(functions.rows)
        shift_f = f_start - self.f0
        step = functions.step
        for r in functions.rows[self.f0:self.f1]:
            functions.rows.append(_copy_call(r, r[_F_INDEX] + shift_f, rename(r[_F_MODULE]), step))
        for c in self.calls:
            tracker.add_call(rename(c.name), c.type, c.phase, c.depth, c.inputs, c.outputs)
        rows = ops.rows
        shift = r_start - self.r0
        for r in rows[self.r0:self.r1]:
            caller, names = r[_CALLER], r[_NAMES]
            rows.append(_copy_op(r, r[_INDEX] + shift, rename(r[_MODULE]),
                                 None if caller is None else caller + shift_f,
                                 tuple(map(rename, names)) if any(names) else names))
        functions.ops_seen += self.r1 - self.r0
        made = []
        for e, fate in zip(self.created(replay), fates, strict=True):
            created = e.created + shift
            if isinstance(fate, tuple) and fate[0] != "freed":
                tensor = real.get(fate)
                made.append(storages.made_by_replay(tensor, created, e)
                            if tensor is not None else None)
            else:
                freed = fate[1] + r_start if isinstance(fate, tuple) else None
                made.append(storages.replayed(e, created, freed))
        for entry, offset in pins:
            if entry is not None:
                storages.date_free(entry, r_start + offset)
        ops.report_progress(len(rows), rows[-1][_PHASE] if rows else Phase.FORWARD)
        return made
