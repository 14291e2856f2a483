"""Records of a distributed step → what crossed the network and what each rank held.

Pure functions over plain records, like everything under analysis/: the collectives are read
off the trace's ops (the c10d ops the dispatcher saw: `c10d._allgather_base_`,
`c10d._reduce_scatter_base_`, `c10d.allreduce_`, and the `_c10d_functional.*` ones).

Two byte counts per collective, `payload_bytes` (the unsharded buffer: the figure FSDP and
DDP sizes are quoted in) and `wire_bytes` (what one rank sends with the ring algorithms, the
textbook estimate), each defined in docs/distributed.md ("What is counted"); all-to-all sends
(N-1)/N of its payload, broadcast all of it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from fractions import Fraction

import torch

from ampscope.distributed.parallel import Parallel
from ampscope.hardware.cuda_allocator import AllocatorConfig, config_for, replay
from ampscope.records import OpCall, SettingRecord, Trace
from ampscope.records.timeline import (
    allocation_events,
    argmax,
    cuda_block_size,
    live_at,
    live_bytes,
)
from ampscope.runtime.predict import gc_paused
from ampscope.torchcompat import distributed as c10d_ops


def _wire_factor(kind: str, n: int) -> Fraction:
    if kind == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction(n - 1, n)
    return Fraction(1)


def itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _nbytes(meta) -> int:
    return math.prod(meta.shape) * itemsize(meta.dtype)


@dataclass(frozen=True)
class Collective:
    """One collective call of one rank's step."""

    index: int  # of its op in the trace
    op: str  # "c10d._reduce_scatter_base_.default"
    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all"
    phase: str
    module: str | None
    dtype: str
    payload_bytes: int
    wire_bytes: int


def collective_kind(op: str) -> str | None:
    namespace, _, rest = op.partition(".")
    if namespace not in c10d_ops.NAMESPACES:
        return None
    return c10d_ops.KINDS.get(rest.rsplit(".", 1)[0])


def collective(o: OpCall, world_size: int) -> Collective | None:
    """The collective an op is, or None. An in-place c10d gather or scatter takes the output
    and the input among its arguments: the whole and one shard (`_allgather_base_`,
    `_reduce_scatter_base_`: the whole is the larger, and the ratio is the group's size), or N
    shards and the whole, N + 1 parts of one size (the whole is N of them); a functional one
    returns its output. The group's size is the one the op was recorded with (its process
    group's: FSDP2 on the `dp` dimension of a 2-D mesh gathers over a group smaller than the
    world, tensor parallelism all-reduces over the `tp` one); in a trace that lacks it, a gather's
    or a scatter's is read off its shapes, and any other's is taken to be the world
    (`world_size_note` says so)."""
    kind = collective_kind(o.op)
    if kind is None or not o.inputs:
        return None
    sizes = [_nbytes(m) for m in o.inputs]
    payload, group = _payload_and_group(o, kind, sizes, world_size)
    wire = int(payload * _wire_factor(kind, group))
    return Collective(o.index, o.op, kind, o.phase, o.module, o.inputs[0].dtype, payload, wire)


def _payload_and_group(o: OpCall, kind: str, sizes: list[int],
                       world_size: int) -> tuple[int, int]:
    given = sum(sizes)
    if o.op.startswith(c10d_ops.FUNCTIONAL_PREFIX):
        return max(given, sum(_nbytes(m) for m in o.outputs)), o.group or world_size
    if kind in ("all_gather", "reduce_scatter"):
        if len(sizes) == 2 and min(sizes) and sizes[0] != sizes[1]:
            payload, group = max(sizes), max(sizes) // min(sizes)
        else:
            payload, group = given - given // len(sizes), max(1, len(sizes) - 1)
        return payload, o.group or group
    return given, o.group or world_size


def _takes_the_world(o: OpCall) -> bool:
    """Is this collective's group taken to be the world: no size recorded, none in its shapes
    (an in-place gather's or scatter's)?"""
    if o.group is not None or not o.inputs:
        return False
    kind = collective_kind(o.op)
    if kind is None:
        return False
    return (o.op.startswith(c10d_ops.FUNCTIONAL_PREFIX)
            or kind not in ("all_gather", "reduce_scatter"))


def world_size_note(ops: list[OpCall], world_size: int) -> str | None:
    """The note for collectives whose wire bytes take their group to be the world (their
    record has no group size: it could not be read when the op ran, as the trace's notes say,
    or the trace was recorded before records kept it); None where there are none, or in a
    world of one rank, where every group is the world."""
    if world_size < 2:
        return None
    taken = Counter(o.op for o in ops if _takes_the_world(o))
    if not taken:
        return None
    listed = ", ".join(f"{op} ×{n}" if n > 1 else op for op, n in taken.items())
    return (f"The process group's size of {sum(taken.values())} collective(s) is not recorded "
            f"({listed}): their wire bytes take the group to be the world, {world_size} ranks; "
            "a smaller group (tensor parallelism's, FSDP2's on a 2-D mesh) sends less.")


def collectives(ops: list[OpCall], world_size: int) -> list[Collective]:
    return [c for o in ops if (c := collective(o, world_size)) is not None]


@dataclass(frozen=True)
class CollectiveRow:
    """Collectives of one kind, phase and dtype in one rank's step."""

    kind: str
    phase: str
    dtype: str
    calls: int
    payload_bytes: int
    wire_bytes: int


def summarize(calls: list[Collective]) -> list[CollectiveRow]:
    rows: dict[tuple[str, str, str], list[int]] = {}
    for c in calls:
        row = rows.setdefault((c.kind, c.phase, c.dtype), [0, 0, 0])
        row[0] += 1
        row[1] += c.payload_bytes
        row[2] += c.wire_bytes
    return [CollectiveRow(k, p, d, *v) for (k, p, d), v in rows.items()]


# What a rank holds after the step, by category then dtype (local shards for FSDP2).
Held = dict[str, dict[str, int]]


@dataclass(frozen=True)
class RankPeak:
    """The most bytes a rank's traced steps held at once, and what was live then."""

    bytes: int
    rounded_bytes: int | None  # in the CUDA allocator's 512-byte blocks, on a cuda setting
    phase: str | None  # forward, backward, optimizer, ...: where the peak is
    live: Held  # category -> dtype -> bytes live at the peak
    # what the CUDA caching allocator would hold at most (its replay), on a cuda setting
    reserved_bytes: int | None = None


def rank_peak(trace: Trace, allocator: AllocatorConfig | None = None) -> RankPeak | None:
    """The most bytes a rank held at once over its traced steps (a DTensor's local shard,
    FSDP2's unsharded parameters while they are gathered), counted as `ampscope memory`
    counts one process, and by category and dtype what was live then; None for a trace
    without storage records. On a cuda setting also the caching allocator's reserved peak,
    replayed over the storages with `allocator`'s options (default: this process's
    PYTORCH_CUDA_ALLOC_CONF, which stops the rank when unreadable)."""
    storages, n = trace.storages, len(trace.ops)
    if not storages:
        return None
    before, live = live_bytes(storages, n)
    k = argmax(live)
    rounded = reserved = None
    if trace.setting.device == "cuda":
        rounded_before, rounded_live = live_bytes(storages, n, cuda_block_size)
        rounded = max(rounded_live) if rounded_live else rounded_before
        config = allocator or config_for("cuda")
        with gc_paused():  # thousands of small blocks: no full collection among them
            reserved = replay(allocation_events(storages, n), config).reserved_peak
    at: Held = {}
    for s in live_at(storages, k):
        by_dtype = at.setdefault(str(s.category), {})
        by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.nbytes
    return RankPeak(live[k] if k is not None else before, rounded,
                    str(trace.ops[k].phase) if k is not None else None, at, reserved)


@dataclass
class RankReport:
    rank: int
    held: Held  # "parameter" / "gradient" / "optimizer_state" -> dtype -> bytes on this rank
    collectives: list[Collective] = field(default_factory=list)
    peak: RankPeak | None = None  # None: not known (a trace without storage records)

    @property
    def held_total(self) -> int:
        return sum(sum(by_dtype.values()) for by_dtype in self.held.values())

    def held_bytes(self, category: str) -> int:
        return sum(self.held.get(category, {}).values())

    def to_dict(self) -> dict:
        return {"rank": self.rank, "held": self.held, "held_total": self.held_total,
                "collectives": [asdict(c) for c in self.collectives],
                "summary": [asdict(r) for r in summarize(self.collectives)],
                "peak": asdict(self.peak) if self.peak is not None else None}

    @classmethod
    def from_dict(cls, data: dict) -> RankReport:
        peak = data.get("peak")
        return cls(data["rank"], data["held"], [Collective(**c) for c in data["collectives"]],
                   RankPeak(**peak) if peak is not None else None)


SCHEMA = "ampscope.distributed/1"


@dataclass
class DistributedReport:
    """One step of a DDP or FSDP2 job: per rank, the collectives and the bytes held.

    `mode` "run" comes from real processes (every rank), "predict" from fake tensors and a fake
    process group standing in for rank 0 of `world_size`."""

    model: str
    parameters: int
    setting: SettingRecord
    parallel: Parallel
    backend: str
    mode: str
    ranks: list[RankReport]
    notes: list[str] = field(default_factory=list)
    trace: Trace | None = None  # rank 0's full trace

    def __post_init__(self) -> None:
        # Every report whose collectives took the world for a group says so, whoever made it
        # (a run's, a prediction's, one read back from a rank's file: not twice).
        if self.trace is not None:
            note = world_size_note(self.trace.ops, self.parallel.world_size)
            if note is not None and note not in self.notes:
                self.notes = [*self.notes, note]  # (not the caller's list)

    def _dtypes(self, kinds: tuple[str, ...], phase: str | None) -> list[str]:
        seen: dict[str, None] = {}
        for c in self.ranks[0].collectives if self.ranks else []:
            if c.kind in kinds and (phase is None or c.phase == phase):
                seen[c.dtype] = None
        return list(seen)

    @property
    def unshard_dtypes(self) -> list[str]:
        """The dtypes parameters are all-gathered (unsharded) in: FSDP2's param_dtype."""
        return self._dtypes(("all_gather",), None)

    @property
    def reduce_dtypes(self) -> list[str]:
        """The dtypes gradients are reduced in: FSDP2's reduce_dtype, DDP's bucket dtype."""
        return self._dtypes(("reduce_scatter", "all_reduce"), "backward")

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "model": {"name": self.model, "parameters": self.parameters},
            "setting": self.setting.to_dict(), "parallel": self.parallel.to_dict(),
            "backend": self.backend, "mode": self.mode, "notes": list(self.notes),
            "unshard_dtypes": self.unshard_dtypes, "reduce_dtypes": self.reduce_dtypes,
            "ranks": [r.to_dict() for r in self.ranks],
        }
