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
- **Depth, per phase and place.** A model of L identical blocks holds, at any op, what any
  depth holds plus what each block adds (its shards of parameters, gradients and optimizer
  state, and the activations saved by the blocks already run): affine in L at each place of
  the step. The places: within each phase (forward, backward, optimizer), the ops before the
  blocks, in the first block, in the last block, after the blocks (and between blocks, the
  root's own ops). A middle block's ops hold what the same op of the first or the last block
  holds, plus or minus one block's share per block between: never more than both, so the
  phase's peak is the largest of the places' peaks, each affine in L and fixed by the probes
  at 2 and 3 blocks. Alike parameters do not make alike blocks (one may keep wider
  activations): the search runs the whole forward once and compares each block's ops and
  shapes with block 0's (distributed/block_forward.py); where they differ, the plan is traced
  at the model's full depth and only the micro-batch rule applies.

tests/test_plans.py traces plans at their full depth and other micro-batches and compares, to
the byte.

Namesakes, the same concern at another layer: `render/plans.py`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ampscope.analysis.memory import cuda_block_size, live_bytes
from ampscope.errors import AmpscopeError
from ampscope.records import StorageRecord

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


class Rule:
    """Each phase's peak of a plan at any depth and micro-batch, from its probes."""

    def __init__(self, probes: list[Probe], rounded: bool) -> None:
        """`probes`: at each depth, two micro-batches (any batch derived) or one (that batch
        only)."""
        self.rounded = rounded
        depths = sorted({p.depth for p in probes})
        self._pairs: dict[int, tuple[Probe, Probe]] = {}
        for d in depths:
            at = sorted((p for p in probes if p.depth == d), key=lambda p: p.batch)
            low, high = at[0], at[-1]
            _check_paired(low, high)
            self._pairs[d] = low, high
        self.depths = depths

    def phase_peaks(self, depth: int, batch: int) -> dict[str, int]:
        """Each phase's most bytes live at once at `depth` blocks and micro-batch `batch`."""
        at = {d: self._at_batch(d, batch) for d in self.depths}
        if len(self.depths) == 1:
            by_place = at[self.depths[0]]
        else:
            (l1, l2) = self.depths
            by_place = {key: at[l1][key] + (depth - l1) * (at[l2][key] - at[l1][key])
                        // (l2 - l1) for key in at[l1].keys() & at[l2].keys()}
        peaks: dict[str, int] = {}
        for (phase, _), value in by_place.items():
            peaks[phase] = max(peaks.get(phase, 0), value)
        return peaks

    def peak(self, depth: int, batch: int) -> tuple[int, str]:
        """The step's peak and the phase it is in."""
        peaks = self.phase_peaks(depth, batch)
        phase = max(peaks, key=peaks.__getitem__)
        return peaks[phase], phase

    def _at_batch(self, depth: int, batch: int) -> dict[tuple[str, str], int]:
        low, high = self._pairs[depth]
        step = high.batch - low.batch
        if step == 0 and batch != low.batch:
            raise ValueError(f"probed at micro-batch {low.batch} only, not {batch}")
        step = step or 1
        storages = []
        for a, b in zip(low.storages, high.storages, strict=True):
            grow, rest = divmod((b.nbytes - a.nbytes) * (batch - low.batch), step)
            if rest:
                raise AmpscopeError("a storage's size is not affine in the micro-batch; this "
                                    "plan cannot be derived")
            storages.append(dataclasses.replace(a, nbytes=a.nbytes + grow))
        _, live = live_bytes(storages, len(low.phases),
                             cuda_block_size if self.rounded else None)
        # A middle block's ops are never above the first's and the last's (see above) where
        # the blocks run alike and the rule extends the depth; traced at one depth (the
        # model's own, as when its blocks are unlike) every op counts.
        middle = len(self.depths) == 1
        peaks: dict[tuple[str, str], int] = {}
        for key, value in zip(zip(low.phases, low.places, strict=True), live, strict=True):
            if middle or key[1] != "middle":
                peaks[key] = max(peaks.get(key, 0), value)
        return peaks


def places(modules: Sequence[str | None], phases: Sequence[str], blocks: str,
           depth: int) -> list[str]:
    """Where each op of a step runs, for the depth rule: "first", "middle" or "last" (of the
    `depth` blocks, the children of the ModuleList named `blocks`), or, for an op outside
    them, "before", "between" or "after" the blocks' ops of its phase."""
    index: list[int | None] = []
    head = blocks + "."
    for module in modules:
        j = None
        if module is not None and module.startswith(head):
            first = module[len(head):].split(".", 1)[0]
            j = int(first) if first.isdigit() else None
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


def largest_batch(rule: Rule, depth: int, budget: int, limit: int, start: int) -> int:
    """The largest micro-batch from `start` up to `limit` whose derived peak fits `budget`;
    `start - 1` when `start` does not. The peak grows with the batch (no storage shrinks as it
    grows), so bisection finds it."""
    if rule.peak(depth, start)[0] > budget:
        return start - 1
    lo, hi = start, limit + 1  # lo fits; hi does not (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if rule.peak(depth, mid)[0] <= budget:
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


def ranked(plans: list[Plan]) -> list[Plan]:
    """Plans that fit first, by tokens per step (most first), then by the room they leave."""
    return sorted(plans, key=lambda p: (not p.fits, -p.tokens, p.peak_bytes or 0, p.tp,
                                        p.checkpoint))
