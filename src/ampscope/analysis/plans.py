"""Parallel plans for N GPUs: each plan's per-rank peak, derived from a few traced ranks.

`ampscope fit --gpus N` (api/parallel_plans.py) traces rank 0 of a plan — FSDP2 over `dp` ranks,
tensor parallelism over `tp`, activation checkpointing or not — on fake tensors and PyTorch's
fake process group, at a reduced depth (the model's first 2 and 3 repeated blocks) and
micro-batches 2 and 3 (1 on its own). What is pure lives here: the rules that take those
probes to the full depth and any micro-batch, the search over micro-batches, and the report
with its JSON (`ampscope.plans/1`).

The rules:

- **Micro-batch, per storage.** At one depth the step runs the same ops and makes the same
  storages at every micro-batch, only larger: each storage's size is affine in the batch
  (batch × sequence × width, or none of it), so two probes give every storage's size at any
  batch, and with them the live bytes at every op, in CUDA's 512-byte blocks too. The probes'
  storages must pair up (the same count, each made and freed at the same op) or the plan is
  not derived.
- **Depth, per phase and place.** At each place of the step (within each phase: before the
  blocks, the first block, the last, after them, between them) the live bytes are affine in
  the depth L, fixed by the probes at 2 and 3 blocks. The middle blocks' peak lies in the one
  next to the first or the last block, which grow as those do: the 3-block probe's middle
  block, plus per block the larger growth. It can be above both (mixture-of-experts blocks
  under checkpointing: tests/test_plans_moe.py). The phase's peak is the largest place's.
  Where the blocks' forwards differ (distributed/block_forward.py), the plan is traced at
  the model's full depth and only the micro-batch rule applies. Why: docs/fit.md.

tests/test_plans.py traces plans at their full depth and other micro-batches and compares, to
the byte.

**Step time, the same way.** Each probe's ops are timed where it is traced (analysis/step_time:
every op of the step, collectives with their group's size, on the link its ranks cross), and
only what the rules need comes back (`ProbeTime`): per phase, the seconds by bound of the ops
outside FSDP2's overlapped collectives, those collectives' exposed ends and the rest, and the
matmul FLOPs by dtype. Each figure is taken affine in the micro-batch (from the two batches)
and in the depth (a block's time = t(3 blocks) − t(2 blocks)), and the overlap rule is applied
at the plan's own depth and batch (`derived_time`). Depth is exact (each block adds the same
ops); the micro-batch is an approximation: a matmul's tile and wave quantization is a step
function of its rows, and an op crossing from launch-bound to compute- or memory-bound bends
its line, so the derived time is not exact between or past the probes
(tests/test_plans_time.py holds it to a tolerance it justifies).

Namesakes, the same concern at another layer: `render/plans.py`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ampscope import hardware
from ampscope.analysis.allocator import AllocatorConfig, replay_storages
from ampscope.analysis.flops import PHASES, matmul_dtype
from ampscope.analysis.memory import cuda_block_size
from ampscope.analysis.op_time import BOUNDS
from ampscope.analysis.step_time import OVERLAPPED, StepTime, step_ops
from ampscope.errors import AmpscopeError
from ampscope.hardware.known import Accelerator
from ampscope.records import StorageRecord, Trace
from ampscope.records.timeline import lives_bytes

SCHEMA = "ampscope.plans/1"
# The probes of a plan family: depths (repeated blocks kept) and micro-batches.
# At least 2: the first and the last block are different blocks, as in the full model.
PROBE_DEPTHS = (2, 3)
# Not 1: at micro-batch 1 a dimension of size 1 lets some ops return views where larger
# batches copy (an expand, a clone), so batch 1's storages do not pair with the others'. It
# is traced on its own when batch 2 does not fit.
PROBE_BATCHES = (2, 3)


@dataclass(frozen=True)
class Probe:
    """One traced rank: its storages and the phase of each of its ops."""

    depth: int
    batch: int
    storages: Sequence[StorageRecord]
    phases: Sequence[str]
    places: Sequence[str]  # of each op, as `places` names them
    time: ProbeTime | None = None  # its step timed on the target GPU (None: no --gpu)


# A probe's time as the rules need it, by flat key (`ProbeTime`).
Figures = dict[tuple[str, ...], float]


@dataclass(frozen=True)
class ProbeTime:
    """One probe's predicted step, reduced to what the time rules need (module docstring):
    `figures` by key — ("other", phase, bound): seconds of the phase's ops outside its overlapped
    collectives; ("ends", phase): its first overlapped collective (and backward's last), exposed
    in full; ("rest", phase): the others; ("flops", dtype): matmul FLOPs, for MFU."""

    figures: Figures


def probe_time(st: StepTime, flops_by_dtype: dict[str, float]) -> ProbeTime:
    """`st` (one probe's step_time) as the rules need it. FSDP's collectives over the `dp`
    group are timed on the link the group crosses where they were recorded: the probe is
    traced on the plan's own (dp, tp) mesh, so a dp group, its ranks tp apart, records the
    nodes it spans (op_time's link rule)."""
    figures: Figures = {("flops", d): float(f) for d, f in flops_by_dtype.items() if f}
    for phase in PHASES:
        ops = [t for t in st.ops if t.phase == phase]
        overlapped = [t for t in ops if t.collective in OVERLAPPED.get(phase, ())]
        seconds = [t.seconds for t in overlapped]
        for t in ops:
            if t.collective in OVERLAPPED.get(phase, ()) or t.bound == "none":
                continue
            key = ("other", phase, t.bound)
            figures[key] = figures.get(key, 0.0) + t.seconds
        ends = seconds[:1] + (seconds[-1:] if phase == "backward" and len(seconds) > 1 else [])
        figures["ends", phase] = sum(ends)
        figures["rest", phase] = sum(seconds) - sum(ends)
    return ProbeTime(figures)


def matmul_flops(trace: Trace) -> dict[str, float]:
    """The step's FLOPs by the dtype each ran in (`flops.matmul_dtype`), as MFU weighs them."""
    flops: dict[str, float] = {}
    for o in step_ops(trace):
        if o.flops:
            flops[matmul_dtype(o)] = flops.get(matmul_dtype(o), 0.0) + o.flops
    return flops


@dataclass(frozen=True)
class PlanTime:
    """A plan's derived step on the target GPU: seconds, by phase and by bound (as
    `StepTime`'s), and the matmul FLOPs by dtype."""

    seconds: float
    by_phase: dict[str, float]
    by_bound: dict[str, float]
    flops: dict[str, float]

    def of(self, plan: Plan, acc: Accelerator, matmul_precision: str) -> Plan:
        """`plan` with this step time: seconds, tokens/s, MFU and what bounds most of it."""
        timed = self.seconds > 0
        return dataclasses.replace(
            plan, step_seconds=self.seconds,
            tokens_per_second=plan.tokens / self.seconds if timed else None,
            mfu=hardware.mfu(self.flops, self.seconds, acc, matmul_precision) if timed else None,
            bound=max(self.by_bound, key=self.by_bound.__getitem__))


def derived_time(probes: Sequence[Probe], depth: int, batch: int) -> PlanTime:
    """The step's time at `depth` blocks and micro-batch `batch` from the probes' times: every
    figure affine in the batch (the two probed at each depth; one: that batch only) and in
    the depth (the two depths; one: that depth only), then the overlap rule at the result."""
    at_depth: dict[int, Figures] = {}
    for d in sorted({p.depth for p in probes}):
        here = {p.batch: p.time.figures for p in probes if p.depth == d and p.time is not None}
        if not here:
            raise ValueError(f"no probe at {d} blocks was timed")
        at_depth[d] = _affine(here, batch)
    figures = _affine(at_depth, depth)
    by_phase: dict[str, float] = {}
    by_bound = dict.fromkeys(BOUNDS, 0.0)
    for phase in PHASES:
        other = 0.0
        for bound in BOUNDS:
            value = max(0.0, figures.get(("other", phase, bound), 0.0))
            by_bound[bound] += value
            other += value
        rest = max(0.0, figures.get(("rest", phase), 0.0))
        exposed = max(0.0, figures.get(("ends", phase), 0.0)) + max(0.0, rest - other)
        by_bound["communication"] += exposed
        by_phase[phase] = other + exposed
    flops = {key[1]: max(0.0, v) for key, v in figures.items() if key[0] == "flops"}
    return PlanTime(sum(by_phase.values()), by_phase, by_bound, flops)


def _affine(points: dict[int, Figures], x: int) -> Figures:
    """Each figure at `x` on the line through the two points (one point: at it only)."""
    xs = sorted(points)
    if len(xs) == 1:
        if x != xs[0]:
            raise ValueError(f"timed at {xs[0]} only, not {x}")
        return dict(points[xs[0]])
    lo, hi = xs[0], xs[-1]
    a, b = points[lo], points[hi]
    return {k: a.get(k, 0.0) + (x - lo) * (b.get(k, 0.0) - a.get(k, 0.0)) / (hi - lo)
            for k in a.keys() | b.keys()}


class Rule:
    """Each phase's peak of a plan at any depth and micro-batch, from its probes."""

    def __init__(self, probes: list[Probe], rounded: bool,
                 allocator: AllocatorConfig | None = None) -> None:
        """`probes`: at each depth, two micro-batches (any batch derived) or one (that batch
        only); `allocator`: the caching allocator's options for `reserved`."""
        self.rounded, self.allocator = rounded, allocator
        # Memos by (depth, batch): the search asks the same ones again (its bisections, the
        # plan's figures, the reserved peak over the allocated one).
        self._reserved: dict[tuple[int, int], int] = {}  # two replays each
        self._peaks: dict[tuple[int, int], dict[str, int]] = {}
        self._places: dict[tuple[int, int], dict[tuple[str, str], int]] = {}
        self._sizes: dict[tuple[int, int], list[int]] = {}
        self.depths = sorted({p.depth for p in probes})
        self._pairs: dict[int, tuple[Probe, Probe]] = {}
        # Each depth's storages as the live sweep needs them, read once: the low probe's
        # sizes, their growth to the high probe, and when each is made and freed (the same
        # in both: `_check_paired`).
        self._lines: dict[int, tuple[list[int], list[int], list[int | None], list[int | None]]] \
            = {}
        for d in self.depths:
            at = sorted((p for p in probes if p.depth == d), key=lambda p: p.batch)
            low, high = self._pairs[d] = at[0], at[-1]
            _check_paired(low, high)
            self._lines[d] = ([s.nbytes for s in low.storages],
                              [b.nbytes - a.nbytes for a, b in zip(low.storages, high.storages,
                                                                   strict=True)],
                              [s.created for s in low.storages], [s.freed for s in low.storages])

    def phase_peaks(self, depth: int, batch: int) -> dict[str, int]:
        """Each phase's most bytes live at once at `depth` blocks and micro-batch `batch`."""
        if (depth, batch) not in self._peaks:
            at = {d: self._at_batch(d, batch) for d in self.depths}
            peaks: dict[str, int] = {}
            for key in at[self.depths[-1]]:
                if key in at[self.depths[0]]:  # (a place of both depths)
                    value = self._at_depth({d: at[d][key] for d in self.depths}, depth)
                elif key[1] == "middle" and depth >= self.depths[-1]:
                    value = self._middle(at, key[0], depth)
                else:
                    continue
                peaks[key[0]] = max(peaks.get(key[0], 0), value)
            self._peaks[depth, batch] = peaks
        return dict(self._peaks[depth, batch])  # (a copy: the caller's to change)

    def peak(self, depth: int, batch: int) -> tuple[int, str]:
        """The step's peak and the phase it is in."""
        peaks = self.phase_peaks(depth, batch)
        phase = max(peaks, key=peaks.__getitem__)
        return peaks[phase], phase

    def reserved(self, depth: int, batch: int) -> int:
        """The caching allocator's reserved peak at `depth` blocks and micro-batch `batch`
        (a CUDA setting's): the allocated peak plus the reserved gap (reserved − allocated) of
        the allocator replayed over the probes' storages at `batch` — each probe depth's
        exact (every storage's size is), the full depth's affine in the depth from them (an
        approximation: the module docstring)."""
        if (depth, batch) in self._reserved:
            return self._reserved[depth, batch]
        gaps = {}
        for d in self.depths:
            low = self._pairs[d][0]
            replayed = replay_storages(self._storages(d, batch), len(low.phases), self.allocator)
            gaps[d] = replayed.reserved_peak - replayed.allocated_peak
        # Not affine in the depth (fragmentation comes and goes with the blocks' order of
        # frees): the largest of the probes' gaps and their line, an estimate.
        gap = max(*gaps.values(), self._at_depth(gaps, depth))
        self._reserved[depth, batch] = self.peak(depth, batch)[0] + gap
        return self._reserved[depth, batch]

    def _middle(self, at: dict[int, dict[tuple[str, str], int]], phase: str, depth: int) -> int:
        """The middle blocks' peak in `phase` at `depth` blocks: the deeper probe's one middle
        block's, and per block more the larger growth of the first and last blocks' places —
        the middle blocks next to them, where the middle's peak lies (module docstring)."""
        low, high = self.depths
        slopes = [(at[high][phase, p] - at[low][phase, p]) // (high - low)
                  for p in ("first", "last") if (phase, p) in at[low] and (phase, p) in at[high]]
        return at[high][phase, "middle"] + (depth - high) * max(slopes, default=0)

    def _at_depth(self, by_depth: dict[int, int], depth: int) -> int:
        """A figure of each probe depth at `depth`: on their line (one depth: its own)."""
        if len(self.depths) == 1:
            return by_depth[self.depths[0]]
        l1, l2 = self.depths
        return by_depth[l1] + (depth - l1) * (by_depth[l2] - by_depth[l1]) // (l2 - l1)

    def _storage_sizes(self, depth: int, batch: int) -> list[int]:
        """The bytes of each storage of the probe at `depth` blocks at micro-batch `batch`."""
        if (depth, batch) in self._sizes:
            return self._sizes[depth, batch]
        low, high = self._pairs[depth]
        step = high.batch - low.batch
        if step == 0 and batch != low.batch:
            raise ValueError(f"probed at micro-batch {low.batch} only, not {batch}")
        step = step or 1
        sizes = []
        base, growth, _, _ = self._lines[depth]
        for a, g in zip(base, growth, strict=True):
            grow, rest = divmod(g * (batch - low.batch), step)
            if rest:
                raise AmpscopeError("a storage's size is not affine in the micro-batch; this "
                                    "plan cannot be derived")
            sizes.append(a + grow)
        self._sizes[depth, batch] = sizes
        return sizes

    def _storages(self, depth: int, batch: int) -> list[StorageRecord]:
        """The probe at `depth` blocks' storages at micro-batch `batch`."""
        sizes = self._storage_sizes(depth, batch)
        return [dataclasses.replace(s, nbytes=n)
                for s, n in zip(self._pairs[depth][0].storages, sizes, strict=True)]

    def _at_batch(self, depth: int, batch: int) -> dict[tuple[str, str], int]:
        """Each place's most bytes live at once in the probe at `depth` blocks at `batch`."""
        if (depth, batch) in self._places:
            return self._places[depth, batch]
        low = self._pairs[depth][0]
        sizes = self._storage_sizes(depth, batch)
        _, _, made, freed = self._lines[depth]
        # Over the sizes alone: a record each would be most of the cost.
        _, live = lives_bytes(zip(sizes, made, freed, strict=True), len(low.phases),
                              cuda_block_size if self.rounded else None)
        peaks: dict[tuple[str, str], int] = {}
        for key, value in zip(zip(low.phases, low.places, strict=True), live, strict=True):
            peaks[key] = max(peaks.get(key, 0), value)
        self._places[depth, batch] = peaks
        return peaks


def places(modules: Sequence[str | None], phases: Sequence[str], blocks: str,
           depth: int, lead: int = 0) -> list[str]:
    """Where each op of a step runs, for the depth rule: "first", "middle" or "last" (of the
    `depth` blocks after the first `lead`, the children of the ModuleList named `blocks`), or,
    for an op outside them (the first `lead` blocks' too), "before", "between" or "after" the
    blocks' ops of its phase."""
    index: list[int | None] = []
    head = blocks + "."
    for module in modules:
        j = None
        if module is not None and module.startswith(head):
            first = module[len(head):].split(".", 1)[0]
            j = int(first) - lead if first.isdigit() and int(first) >= lead else None
        index.append(j)
    spans: dict[str, tuple[int, int]] = {}
    for k, (phase, j) in enumerate(zip(phases, index, strict=True)):
        if j is not None:
            lo, hi = spans.get(phase, (k, k))
            spans[phase] = (min(lo, k), max(hi, k))
    out = []
    for k, (phase, j) in enumerate(zip(phases, index, strict=True)):
        if j is not None:
            out.append("first" if j == 0 else "last" if j == depth - 1 else "middle")
        elif phase not in spans or k < spans[phase][0]:
            out.append("before")
        else:
            out.append("after" if k > spans[phase][1] else "between")
    return out


def _check_paired(low: Probe, high: Probe) -> None:
    same = len(low.storages) == len(high.storages) and list(low.phases) == list(high.phases) \
        and all((a.created, a.freed) == (b.created, b.freed)
                for a, b in zip(low.storages, high.storages, strict=True))
    if not same:
        raise AmpscopeError(
            f"the step at micro-batch {low.batch} and {high.batch} ({low.depth} blocks) does not "
            "run the same ops and storages; this plan's larger batches cannot be derived")


def largest_batch(rule: Rule, depth: int, budget: int, start: int, limit: int,
                  reserved: bool) -> int:
    """The largest micro-batch from `start` up to `limit` whose derived peak fits `budget` —
    with `reserved` (a CUDA setting), the allocator's reserved peak, searched up to the
    allocated peak's answer (the reserved peak is never below it); `start - 1` when none
    fits. Both peaks grow with the batch (no storage shrinks as it grows; the reserved peak
    not in steps of one size: a request past 1 MiB takes a 20 MiB segment): bisection."""
    batch = _largest(lambda b: rule.peak(depth, b)[0] <= budget, start, limit)
    if reserved:
        batch = _largest(lambda b: rule.reserved(depth, b) <= budget, start, batch)
    return batch


def _largest(fits: Callable[[int], bool], start: int, high: int) -> int:
    """The largest n from `start` up to `high` that `fits`, `high` tried first; `start - 1`
    when `start` does not."""
    if high < start or not fits(start):
        return start - 1
    if fits(high):
        return high
    lo, hi = start, high  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Plan:
    """One way to run the job on `dp * tp` GPUs, and its derived per-rank peak."""

    dp: int
    tp: int
    checkpoint: bool
    batch: int  # the largest micro-batch that fits (0: not even 1)
    tokens: int  # per optimizer step: dp × batch × seq
    peak_bytes: int  # at `batch`; when nothing fits, at `searched_from`
    phase: str
    searched_from: int = 1  # the smallest micro-batch searched (2: batch 1 could not win)
    # `batch` is the search's limit: every micro-batch up to it fits, a larger one may too.
    at_batch_limit: bool = False
    # Its step on the target GPU at `batch` (derived_time; None without --gpu or a fit).
    step_seconds: float | None = None
    tokens_per_second: float | None = None  # dp × batch × seq / step_seconds
    mfu: float | None = None
    bound: str | None = None  # what bounds most of the step's time
    # The caching allocator's reserved peak at `batch` (at `searched_from` when nothing fits;
    # None off CUDA): what must fit the budget.
    reserved_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return self.batch > 0

    @property
    def name(self) -> str:
        parts = [f"FSDP {self.dp}"] + ([f"TP {self.tp}"] if self.tp > 1 else [])
        return " × ".join(parts) + (" + checkpointing" if self.checkpoint else "")


@dataclass
class PlansReport:
    model: str
    depth: int  # the model's repeated blocks
    gpus: int
    accelerator: str | None
    memory_bytes: int
    setting: str
    mp_policy: dict
    seq: int
    optimizer: str
    plans: list[Plan]  # best first
    seconds: float
    notes: list[str] = field(default_factory=list)
    # The largest micro-batch the search answers (api/parallel_plans.py: BATCH_LIMIT): a plan
    # at it fits every batch up to it, and no larger one was derived.
    batch_limit: int | None = None
    # The depths each plan was traced at: 2 and 3 blocks, or the model's own (its blocks unlike,
    # or no more than 3).
    probe_depths: list[int] = field(default_factory=list)

    @property
    def best(self) -> Plan | None:
        fitting = [p for p in self.plans if p.fits]
        return fitting[0] if fitting else None

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "model": self.model, "depth": self.depth, "gpus": self.gpus,
                "accelerator": self.accelerator, "memory_bytes": self.memory_bytes,
                "setting": self.setting, "mp_policy": self.mp_policy, "seq": self.seq,
                "optimizer": self.optimizer, "seconds": round(self.seconds, 2),
                "batch_limit": self.batch_limit, "probe_depths": list(self.probe_depths),
                "plans": [asdict(p) | {"name": p.name, "fits": p.fits} for p in self.plans],
                "notes": list(self.notes)}


def could_win(tokens_at_1: int, rate_ceiling: float | None, plans: list[Plan]) -> bool:
    """Could a plan that fits no micro-batch of 2 beat the best of `plans` at batch 1? With a
    GPU, when its tokens/s at batch 2 (`rate_ceiling`) is above the fastest plan's: its rate at
    1 is at most that (each op's time at batch 2 is at most twice its time at 1, its bytes and
    FLOPs doubled and its waves at most), so the step's is too. Without one, when batch 1's
    tokens a step (`tokens_at_1`: dp × seq) are more than any plan that fits gives."""
    fitting = [p for p in plans if p.fits]
    fastest = max((p.tokens_per_second or 0.0 for p in fitting), default=0.0)
    if rate_ceiling is None or not fastest:
        return tokens_at_1 > max((p.tokens for p in fitting), default=0)
    return rate_ceiling > fastest


def ranked(plans: list[Plan]) -> list[Plan]:
    """Plans that fit first, by predicted tokens per second (most first; where a GPU was
    given), then by tokens per step, then by the room they leave."""
    return sorted(plans, key=lambda p: (not p.fits, -(p.tokens_per_second or 0.0), -p.tokens,
                                        p.peak_bytes or 0, p.tp, p.checkpoint))
