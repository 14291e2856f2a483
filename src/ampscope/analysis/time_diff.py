"""Why one of two traces is faster: their predicted steps (analysis/step_time.py) side by side,
the time moved between bounds (compute, memory, launch, communication) and phases, and the
modules whose time moved most. `ampscope diff` shows it as "Why one is faster" and writes it
as the diff's `timing` (schema `ampscope.diff/1`)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ampscope.analysis.flops import PHASES
from ampscope.analysis.op_time import BOUNDS
from ampscope.analysis.step_time import StepTime
from ampscope.records import module_label

TOP_MOVED = 5  # modules listed, those whose time moved most
_INDEX = re.compile(r"\.(\d+)(?=\.|$)")  # the first numeric part of a module path: its block


@dataclass(frozen=True)
class Moved:
    """One bound, phase or module: its seconds in A and in B."""

    name: str
    a: float
    b: float

    @property
    def delta(self) -> float:
        return self.b - self.a


@dataclass(frozen=True)
class TimeDiff:
    """The predicted steps of A and B on one accelerator, and where their time differs."""

    accelerator: str
    a: float  # seconds of A's step
    b: float
    tokens_per_second_a: float
    tokens_per_second_b: float
    by_bound: tuple[Moved, ...]
    by_phase: tuple[Moved, ...]
    modules: tuple[Moved, ...]  # the TOP_MOVED modules whose time moved most, most first

    @property
    def speedup(self) -> float:
        """How many times faster B's step is than A's (below 1: slower)."""
        return self.a / self.b if self.b else 0.0

    def to_dict(self) -> dict:
        """Every field in declaration order; the tuples of `Moved` as lists of dicts."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def block_modules(predicted: StepTime) -> dict[str, float]:
    """Seconds of each module's own ops over the step, a repeated stack's blocks summed under
    one name (`transformer.h.0–11.attn`) so that a change every block makes reads as one row."""
    seconds: dict[str, float] = {}
    indices: dict[str, list[int]] = {}
    for op in predicted.ops:
        if not op.seconds:
            continue
        label = module_label(op.module)
        match = _INDEX.search(label)
        key = label if match is None else label[:match.start(1)] + "#" + label[match.end(1):]
        seconds[key] = seconds.get(key, 0.0) + op.seconds
        if match is not None:
            indices.setdefault(key, []).append(int(match.group(1)))
    out: dict[str, float] = {}
    for key, value in seconds.items():
        found = indices.get(key)
        if found:
            low, high = min(found), max(found)
            key = key.replace("#", str(low) if low == high else f"{low}–{high}", 1)
        out[key] = out.get(key, 0.0) + value
    return out


def time_diff(a: StepTime, b: StepTime) -> TimeDiff:
    """A's and B's predicted steps compared (both on one accelerator: the caller's choice)."""
    mods_a, mods_b = block_modules(a), block_modules(b)
    names = list(dict.fromkeys([*mods_a, *mods_b]))
    modules = sorted((Moved(n, mods_a.get(n, 0.0), mods_b.get(n, 0.0)) for n in names),
                     key=lambda m: -abs(m.delta))
    return TimeDiff(
        accelerator=a.accelerator, a=a.seconds, b=b.seconds,
        tokens_per_second_a=a.tokens_per_second, tokens_per_second_b=b.tokens_per_second,
        by_bound=tuple(Moved(k, a.by_bound.get(k, 0.0), b.by_bound.get(k, 0.0))
                       for k in BOUNDS),
        by_phase=tuple(Moved(k, a.by_phase.get(k, 0.0), b.by_phase.get(k, 0.0))
                       for k in PHASES),
        modules=tuple(m for m in modules[:TOP_MOVED] if m.delta))
