"""How large a step fits in a GPU's memory: the search over predicted runs and its report.

`ampscope fit` (api/fit.py) runs predicted steps; what is pure lives here: the search, which
decides the next batch to try from the probes so far, the byte sizes people write ("80GiB"),
what dominates the peak, and the report with its JSON (`ampscope.fit/1`).

The search brackets the largest fitting batch between a batch that fits and one that does
not, and only stops when they are neighbours, so its answer is two predicted runs, never an
extrapolation; how it guesses (live bytes affine in the batch) and why a CUDA setting holds the
reserved peak to the budget: docs/fit.md, "The search".

Namesakes, the same concern at another layer: `api/fit.py`, `cli/fit.py`, `render/fit.py`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ampscope.analysis.memory import MemoryReport
from ampscope.errors import AmpscopeError
from ampscope.records import STORAGE_CATEGORIES

SCHEMA = "ampscope.fit/1"

# What people call each storage category of the memory report.
CATEGORY_LABELS = {
    "parameter": "weights", "buffer": "buffers", "input": "inputs", "gradient": "gradients",
    "optimizer_state": "optimizer state", "output": "outputs",
    "autocast_cast": "autocast copies", "fp8_cast": "fp8 copies", "fp8_scale": "fp8 scales",
    "activation": "activations",
    "temporary": "temporaries",
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """"80GiB" (binary), "80GB" (decimal), "81920MiB" or a number of bytes, as bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise AmpscopeError(f"cannot read the memory size {text!r}; write it as e.g. 80GiB, "
                                "80GB or 24576MiB")
        size = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(size):  # "1e400": past any float, no size of memory
            raise AmpscopeError(f"the memory size {text!r} is too large to be a number of "
                                "bytes; write it as e.g. 80GiB")
        value = int(size)
    if value <= 0:
        raise AmpscopeError(f"the memory size must be more than 0 bytes, not {text!r}; write it "
                            "as e.g. 80GiB")
    return value


def allocated_peak(report: MemoryReport) -> int:
    """The allocated peak: in the CUDA allocator's blocks on a CUDA setting (what
    `torch.cuda.max_memory_allocated` would count), the exact bytes elsewhere."""
    return report.peak.rounded_bytes if report.peak.rounded_bytes is not None else report.peak.bytes


def compared_peak(report: MemoryReport) -> int:
    """The peak a step must fit under: the caching allocator's reserved peak where the report
    replayed it (a CUDA setting: what the GPU runs out of), the allocated peak elsewhere."""
    return report.reserved.reserved_peak if report.reserved is not None else allocated_peak(report)


def held_peak(report: MemoryReport) -> str:
    """Which peak `compared_peak` holds to the budget: "reserved" or "allocated"."""
    return "reserved" if report.reserved is not None else "allocated"


@dataclass(frozen=True)
class Probe:
    """One predicted run of the search."""

    variant: str  # "as given", or the variant that ran
    batch: int
    seq: int
    peak_bytes: int  # allocated_peak of its memory report
    fits: bool  # its compared_peak (the reserved peak on CUDA) is within the budget
    phase: str | None  # where the peak is: forward, backward, optimizer
    reserved_bytes: int | None = None  # the caching allocator's reserved peak (None off CUDA)


@dataclass(frozen=True)
class Share:
    """One category's bytes live at the peak."""

    category: str
    label: str
    bytes: int
    fraction: float  # of the peak


def dominant(report: MemoryReport) -> list[Share]:
    """What is live at the peak by category, the largest first. Temporaries at a peak in the
    optimizer step are the optimizer's (a foreach update's intermediates)."""
    by: dict[str, int] = {}
    for row in report.at_peak:
        by[row.category] = by.get(row.category, 0) + row.bytes
    total = sum(by.values()) or 1
    order: dict[str, int] = {c: i for i, c in enumerate(STORAGE_CATEGORIES)}
    labels = dict(CATEGORY_LABELS)
    if report.peak.phase == "optimizer":
        labels["temporary"] = "optimizer temporaries"
    return [Share(c, labels.get(c, c), b, b / total)
            for c, b in sorted(by.items(), key=lambda kv: (-kv[1], order.get(kv[0], 99)))]


@dataclass(frozen=True)
class Variant:
    """A change that would buy room, each figure from its own predicted runs; every peak is
    the one held to the budget (`compared_peak`: the reserved peak on CUDA)."""

    name: str  # "bf16 weights", "activation checkpointing", "fused optimizer"
    change: str  # how to ask for it: the setting or the run option
    peak_at_limit: int  # its peak at the batch found for the step as given
    saved_bytes: int  # the step as given's peak there, less this one's
    batch: int | None  # the largest batch that fits with it (None: not even 1)
    peak_bytes: int | None  # its peak at that batch


@dataclass
class FitReport:
    model: str
    accelerator: str | None  # the --gpu name, None with only --memory
    memory_bytes: int  # the budget
    memory_source: str  # "hardware.py: NVIDIA H100 SXM5 80GB" or "--memory"
    setting: str
    optimizer: str
    seq: int
    seq_auto: bool  # the sequence was searched too (--seq auto)
    batch: int  # the largest micro-batch that fits
    peak_bytes: int  # its predicted allocated peak (allocated_peak)
    peak_phase: str | None
    at_limit: list[Share]
    probes: list[Probe]
    variants: list[Variant]
    notes: list[str] = field(default_factory=list)
    # The largest batch the search probes (api/fit.py: `_batch_limit`); a `batch` equal to it
    # means every batch up to it fits, and no larger one was tried. None: no limit applied.
    batch_limit: int | None = None
    # The step at `batch` on the accelerator (analysis/step_time; None with only --memory).
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    bound: str | None = None  # what bounds most of the step's time
    # The CUDA caching allocator's reserved peak at `batch`, replayed over its storages (None
    # off CUDA).
    reserved_bytes: int | None = None
    # Which peak the search held to the budget ("reserved" on CUDA, else "allocated"), and the
    # budget less that peak at `batch`.
    held: str = "allocated"
    margin_bytes: int = 0

    @property
    def at_batch_limit(self) -> bool:
        """Did the search stop at its limit (so `batch` is a lower bound, not the answer)?"""
        return self.batch_limit is not None and self.batch == self.batch_limit

    def to_dict(self) -> dict:
        """Every field in declaration order, after the schema; the lists as lists of dicts."""
        return {"schema": SCHEMA, **asdict(self)}


# -- the search -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """What the search keeps of a probe: its batch, whether it fit, and per op the live bytes
    through it, its name and its phase; `gap`: how far the peak held to the budget (the
    reserved one on CUDA, in allocator blocks) is above the highest live bytes."""

    batch: int
    fits: bool
    live: list[int]
    ops: list[str]
    phases: list[str]
    gap: int = 0


def extrapolated(a: Point, b: Point, budget: int) -> int | None:
    """The largest batch whose live bytes stay within `budget`, extrapolated along the line
    through probes `a` and `b` (a.batch < b.batch); None when nothing grows with the batch.

    Each op the two runs share has its live bytes extrapolated (exact when every storage is
    affine in the batch); a model may run a few more ops at one batch than at another (an
    `expand` from batch 2 on), which are left out. When the runs cannot be lined up that way,
    each phase's highest live bytes are extrapolated instead: the peak of a phase is the
    maximum of affine lines, so its line through two batches runs below it further on, and
    the guess is at or above the answer."""
    if a.batch >= b.batch or not a.live or not b.live:
        return None
    pairs = _aligned(a, b)
    if pairs is None:
        top_a, top_b = _phase_peaks(a), _phase_peaks(b)
        pairs = [(top_a[p], top_b[p]) for p in top_a.keys() & top_b.keys()]
    step = b.batch - a.batch
    best: int | None = None
    for x, y in pairs:
        if y > x:
            # x + (n - a) (y - x) / step <= budget
            n = a.batch + (budget - x) * step // (y - x)
            best = n if best is None else min(best, n)
    return best


def _aligned(a: Point, b: Point) -> list[tuple[int, int]] | None:
    """(live bytes in a, in b) of the ops both ran, when one run is the other with ops
    inserted (at most 1% more); None otherwise. One pass: at a mismatch the longer run's op is
    the inserted one."""
    if len(a.ops) == len(b.ops):
        return list(zip(a.live, b.live, strict=True)) if a.ops == b.ops else None
    short, long = (a, b) if len(a.ops) < len(b.ops) else (b, a)
    surplus = len(long.ops) - len(short.ops)
    if surplus > len(short.ops) // 100 + 2:
        return None
    pairs, j = [], 0
    for i, op in enumerate(short.ops):
        while j < len(long.ops) and long.ops[j] != op and surplus:
            j += 1
            surplus -= 1
        if j == len(long.ops) or long.ops[j] != op:
            return None
        pairs.append((short.live[i], long.live[j]) if short is a else (long.live[j], short.live[i]))
        j += 1
    return pairs


def _phase_peaks(point: Point) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for live, phase in zip(point.live, point.phases, strict=True):
        peaks[phase] = max(peaks.get(phase, 0), live)
    return peaks


def largest(probe: Callable[[int], Point], budget: int, *, start: int = 1,
            max_probes: int = 16, limit: int | None = None) -> tuple[int | None, bool]:
    """The largest batch `probe` says fits, starting at `start`: doubling until one does not
    fit, guided by `extrapolated`, then bisecting. No batch above `limit` is probed: when
    `limit` fits, it is the answer (the caller says so). Returns (batch or None when even 1
    does not fit, whether the bracket closed, or the limit was reached, within `max_probes`)."""
    points: dict[int, Point] = {}
    lo, hi = 0, None  # the largest batch known to fit (0: none), the smallest known not to
    guesses = 0
    candidate = start if limit is None else min(start, limit)
    while True:
        point = points[candidate] = probe(candidate)
        if point.fits:
            lo = candidate
        else:
            hi = candidate
        if hi is not None and hi - lo <= 1:
            return (lo or None), True
        if lo == limit:  # nothing above it is probed
            return lo, True
        if len(points) >= max_probes:
            return (lo or None), False
        # Three guesses: the guess, the batch after it, and a third for a held peak that is
        # not a line in the batch (the reserved one on CUDA: its gap to the live bytes grows,
        # and a guess just over the budget re-extrapolated with the larger gap lands below).
        candidate, guessed = _next(points, lo, hi, budget, guess=guesses < 3)
        if limit is not None:
            # Never probed yet: a limit probed either fit (returned above) or bounds `hi`, and
            # every candidate is below `hi`.
            candidate = min(candidate, limit)
        guesses += guessed


def _next(points: dict[int, Point], lo: int, hi: int | None, budget: int, *,
          guess: bool) -> tuple[int, bool]:
    """The next batch to probe, and whether it is an extrapolated guess."""
    fitting = sorted(n for n, p in points.items() if p.fits)
    if guess and len(fitting) >= 2:
        # Live bytes are extrapolated, not the held peak: the budget they get is less the
        # largest gap (the reserved peak's, on CUDA) any probe showed, since the gap grows with
        # the batch; the guess is probed anyway.
        gap = max(0, *(p.gap for p in points.values()))
        g = extrapolated(points[fitting[-2]], points[fitting[-1]], budget - gap)
        if g is not None:
            # Probe the guess when it is above what fits, else the batch after it (expected
            # not to fit, which closes the bracket).
            g = max(g, lo + 1)
            if hi is not None:
                g = min(g, hi - 1)
            if g not in points:
                return g, True
    if lo == 0:
        assert hi is not None
        return max(1, hi // 2), False
    if hi is None and len(points) == 1:
        return lo + 1, False  # a second point to guess from, and the first question: one more?
    return (lo * 2 if hi is None else (lo + hi) // 2), False
