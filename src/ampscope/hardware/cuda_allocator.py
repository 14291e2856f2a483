"""PyTorch's CUDA caching allocator replayed over allocations and frees: the bytes it would
reserve from the driver (`torch.cuda.max_memory_reserved`), beside the bytes handed out
(`max_memory_allocated`), and what makes the gap: a fact of CUDA's runtime, over events (bytes,
made at, freed at, stream); analysis/allocator.py replays a trace's storages (`replay_storages`).

The rules are those of `c10/cuda/CUDACachingAllocator.cpp` and PyTorch's "CUDA memory
management" notes, implemented from their description; docs/memory.md ("The allocator replay")
lists them and what is not modelled."""

from __future__ import annotations

import os
import re
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from ampscope.errors import AmpscopeError

MiB = 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = MiB  # kSmallSize: the largest request the small pool serves
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small pool segment; an expandable small page
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: a large segment for 1-10 MiB requests; a large page
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here segments fit the request
ROUND_LARGE = 2 * MiB  # kRoundLarge: what those segments are rounded to
POWER2_INTERVALS = 16  # roundup_power2_divisions: one figure per power of two from 1 MiB up
_KNOWN = "expandable_segments, max_split_size_mb, roundup_power2_divisions, max_non_split_rounding_mb"
# Options PyTorch reads that change nothing the replay models.
_IGNORED = ("garbage_collection_threshold", "backend", "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register", "pinned_num_register_threads")
ENV = "PYTORCH_CUDA_ALLOC_CONF"  # the options' variable, read by the allocator at start-up


def _conf_error(text: str, why: str) -> AmpscopeError:
    return AmpscopeError(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: {why}")


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's options the replay models (PyTorch's defaults when built bare)."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: blocks of any size may be split
    max_non_split_rounding: int = LARGE_BUFFER  # how much larger an oversize block may be
    # divisions per power-of-two interval (index 0: below 2 MiB, 1: 2-4 MiB, ...); () none
    roundup_power2_divisions: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()  # options read and not modelled

    @classmethod
    def from_env(cls, text: str | None) -> AllocatorConfig:
        """Parse PYTORCH_CUDA_ALLOC_CONF's text ("expandable_segments:True,max_split_size_mb:128");
        options the replay does not model are noted, malformed text is one AmpscopeError."""
        if not text:
            return cls()
        values: dict[str, object] = {}
        notes = []
        for item in filter(None, map(str.strip, re.split(r",(?![^\[]*\])", text))):
            key, sep, value = (s.strip() for s in item.partition(":"))
            if not sep or not key or not value:
                raise _conf_error(text, f"{item!r} is not option:value")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise _conf_error(text, "expandable_segments takes True or False")
                values["expandable_segments"] = value == "True"
            elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                if not value.isdigit():
                    raise _conf_error(text, f"{key} takes a whole number of MiB")
                mb = int(value)
                if key == "max_split_size_mb" and mb <= LARGE_BUFFER // MiB:
                    raise _conf_error(text, f"max_split_size_mb must be > {LARGE_BUFFER // MiB}")
                values[key.removesuffix("_mb")] = mb * MiB  # the field holds bytes
            elif key == "roundup_power2_divisions":
                values[key] = _parse_divisions(text, value)
            elif key in _IGNORED:
                notes.append(f"PYTORCH_CUDA_ALLOC_CONF's {key} is not modelled by the replay")
            else:
                notes.append(f"PYTORCH_CUDA_ALLOC_CONF's {key!r} is not an option the replay "
                             f"knows ({_KNOWN}): ignored")
        return cls(**values, notes=tuple(notes))  # type: ignore[arg-type]

    def round_size(self, size: int) -> int:
        """The block a request of `size` bytes needs (`round_size`)."""
        table = self.roundup_power2_divisions  # indexed by log2(size) - log2(1 MiB)
        d = table[min(max(size.bit_length() - 21, 0), POWER2_INTERVALS - 1)] if table else 0
        if d > 1 and size > MIN_BLOCK * d:  # then the step is at least 512 B, never 0
            step = (1 << (size.bit_length() - 1)) >> (d.bit_length() - 1)  # 2**floor(log2) / d
            return -(-size // step) * step
        return max(-(-size // MIN_BLOCK) * MIN_BLOCK, MIN_BLOCK)

    def to_dict(self) -> dict:
        return {**asdict(self), "roundup_power2_divisions": list(self.roundup_power2_divisions),
                "notes": list(self.notes)}


def environment_config() -> tuple[AllocatorConfig | None, AmpscopeError | None]:
    """This process's PYTORCH_CUDA_ALLOC_CONF as the replay's options, or (None, the error): it
    concerns CUDA's allocator only, so the caller stops a cuda run with it, and no other."""
    try:
        return AllocatorConfig.from_env(os.environ.get(ENV)), None
    except AmpscopeError as e:
        return None, e


def config_for(device: str) -> AllocatorConfig | None:
    """The options a run on `device` is replayed with: None off cuda (nothing to replay);
    on cuda this process's PYTORCH_CUDA_ALLOC_CONF, an unreadable one raised."""
    return AllocatorConfig.from_env(os.environ.get(ENV)) if device == "cuda" else None


def _parse_divisions(text: str, value: str) -> tuple[int, ...]:
    """"4" (every size) or "[256:1,512:2,>:4]" (from each power-of-two MiB boundary; the first
    figure also below it, ">" for every interval after the last boundary named)."""
    def number(s: str) -> int:
        if not s.strip().isdigit():
            raise _conf_error(text, f"roundup_power2_divisions: {s!r} is not a whole number")
        n = int(s)
        if n & (n - 1):  # neither 0 nor a power of 2
            raise _conf_error(text, "roundup_power2_divisions must be powers of 2 (or 0)")
        return n
    if not value.startswith("["):
        return (number(value),) * POWER2_INTERVALS
    if not value.endswith("]"):
        raise _conf_error(text, "roundup_power2_divisions: an unclosed [")
    slots = [0] * POWER2_INTERVALS
    first, last = True, 0
    for entry in filter(None, (e.strip() for e in value[1:-1].split(","))):
        bound, sep, div = entry.partition(":")
        if not sep:
            raise _conf_error(text, f"roundup_power2_divisions: {entry!r} is not size:divisions")
        n = number(div)
        if bound.strip() == ">":
            slots[last + 1:] = [n] * (POWER2_INTERVALS - last - 1)
            continue
        mb = number(bound)
        if mb == 0:  # number() lets through powers of 2 and 0
            raise _conf_error(text, "roundup_power2_divisions: boundaries must be powers of 2")
        index = min(mb.bit_length() - 1, POWER2_INTERVALS - 1)
        if first:
            slots[:index] = [n] * index
            first = False
        slots[index], last = n, index
    return tuple(slots)


def allocation_size(size: int) -> int:
    """The segment reserved for a rounded request no cached block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Event(NamedTuple):
    """One allocation: `size` bytes requested at time `start`, freed at `end` (after `start`;
    None: never), on `stream`. Frees at a time come before allocations at that time."""

    size: int
    start: int
    end: int | None = None
    stream: int = 0


@dataclass(frozen=True)
class OutOfMemory:
    time: int  # the allocation's start
    size: int  # its rounded request
    reserved: int  # reserved when it failed, after giving back what was cached
    capacity: int


@dataclass(frozen=True)
class AllocatorReplay:
    """The replay's peaks and, at the reserved peak, what the reserved bytes hold."""

    reserved_peak: int
    reserved_at: int | None  # start time of the allocation that reached it; None: no event
    allocated_peak: int  # Σ rounded requests live, its peak (`max_memory_allocated`)
    allocated_at: int | None
    requested: int  # at the reserved peak: the bytes requested, live
    rounding: int  # at the reserved peak: blocks beyond the requests (512 B, power-2, unsplit)
    segments: int  # at the reserved peak: segment tails never handed out (segment sizes, pages)
    fragmentation: int  # at the reserved peak: freed blocks cached and not reused
    other_streams: int  # the part of `fragmentation` held by other streams' pools
    segment_count: int  # segments held at the reserved peak (expandable: one per stream, pool)
    mallocs: int  # segments reserved (cudaMalloc calls; expandable: page mappings) in all
    config: AllocatorConfig = field(default_factory=AllocatorConfig)
    oom: OutOfMemory | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "config": self.config.to_dict()}


class _Segment:
    __slots__ = ("base", "end", "expandable", "small", "stream", "used_end")

    def __init__(self, base: int, size: int, stream: int, small: bool, expandable: bool):
        self.base, self.end, self.used_end = base, base + size, base
        self.stream, self.small, self.expandable = stream, small, expandable


class _Allocator:
    """The allocator's state: blocks by address, free blocks per (stream, pool) sorted by
    (size, address), and running totals kept as each event changes them."""

    def __init__(self, config: AllocatorConfig, capacity: int | None):
        self.config, self.capacity = config, capacity
        self.size: dict[int, int] = {}  # block address -> size
        self.seg: dict[int, _Segment] = {}  # block address -> its segment
        self.by_end: dict[int, int] = {}  # block end address -> block address
        self.free: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self.is_free: set[int] = set()
        self.segments: list[_Segment] = []
        self.expandable: dict[tuple[int, bool], _Segment] = {}
        self.next_base = 0
        self.mallocs = 0
        self.reserved = 0
        self.used_by: dict[int, int] = {}  # per stream: Σ segment bytes up to their used_end
        self.blocks_by: dict[int, int] = {}  # per stream: Σ sizes of blocks handed out

    # -- blocks ---------------------------------------------------------------------------

    def _put(self, addr: int, size: int, seg: _Segment) -> None:
        self.size[addr], self.seg[addr], self.by_end[addr + size] = size, seg, addr

    def _drop(self, addr: int) -> None:
        del self.by_end[addr + self.size.pop(addr)]
        del self.seg[addr]

    def _free_insert(self, addr: int) -> None:
        seg = self.seg[addr]
        self.is_free.add(addr)
        insort(self.free.setdefault((seg.stream, seg.small), []), (self.size[addr], addr))

    def _free_remove(self, addr: int) -> None:
        seg = self.seg[addr]
        pool = self.free[(seg.stream, seg.small)]
        del pool[bisect_left(pool, (self.size[addr], addr))]
        self.is_free.discard(addr)

    def _found(self, size: int, stream: int, small: bool) -> int | None:
        """The best-fit cached block for a rounded request (`get_free_block`)."""
        pool = self.free.get((stream, small))
        i = bisect_left(pool, (size, -1)) if pool else 0
        if not pool or i == len(pool):
            return None
        bsize, addr = pool[i]
        cap, over = self.config.max_split_size, self.config.max_non_split_rounding
        if cap is not None and (size < cap <= bsize or cap <= size <= bsize - over):
            return None
        self._free_remove(addr)
        return addr

    def _split(self, addr: int, size: int) -> None:
        seg, remaining = self.seg[addr], self.size[addr] - size
        if seg.small or seg.expandable:
            split = remaining >= MIN_BLOCK
        else:
            cap = self.config.max_split_size
            split = (cap is None or size < cap) and remaining > SMALL_SIZE
        if split:  # the block keeps its start; the remainder takes over its end
            self.size[addr], self.by_end[addr + size] = size, addr
            self._put(addr + size, remaining, seg)
            self._free_insert(addr + size)

    # -- segments -------------------------------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.mallocs += 1

    def _unreserve(self, seg: _Segment, keep: int) -> None:
        """Give back the segment's bytes from address `keep` to its end."""
        self.reserved -= seg.end - keep
        if seg.used_end > keep:  # a tail handed out once, now given back
            self.used_by[seg.stream] -= seg.used_end - keep
            seg.used_end = keep
        seg.end = keep

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _new_segment(self, size: int, stream: int, small: bool) -> int | None:
        nbytes = allocation_size(size)
        if not self._fits(nbytes):
            return None
        seg = _Segment(self.next_base, nbytes, stream, small, False)
        self.next_base += nbytes
        self.segments.append(seg)
        self._reserve(nbytes)
        self._put(seg.base, nbytes, seg)
        return seg.base

    def _expand(self, size: int, stream: int, small: bool) -> int | None:
        """Map pages at the end of the stream's and pool's one segment so that its free tail
        and the new pages hold `size` (`try_allocate_expandable_block`)."""
        seg = self.expandable.get((stream, small))
        if seg is None:
            seg = self.expandable[(stream, small)] = _Segment(self.next_base, 0, stream, small, True)
            self.next_base += 1 << 50  # a virtual range as large as any device
            self.segments.append(seg)
        tail = self.by_end.get(seg.end, -1)  # segments lie 2**50 apart: a block ending here is seg's
        have = self.size[tail] if tail in self.is_free else 0
        if have >= size:  # a free tail best fit passed over (max_split_size_mb): no page to map
            self._free_remove(tail)
            return tail
        page = SMALL_BUFFER if small else LARGE_BUFFER
        grow = -(-(size - have) // page) * page
        if not self._fits(grow):
            return None
        start = seg.end - have
        if have:
            self._free_remove(tail)
            self._drop(tail)
        seg.end += grow
        self._reserve(grow)
        self._put(start, have + grow, seg)
        return start

    def _release_oversize(self, size: int, stream: int, small: bool) -> bool:
        """Give back cached oversize segments of this pool: one that holds the request, else
        the largest until as many bytes are free (`release_available_cached_blocks`)."""
        cap = self.config.max_split_size
        pool = self.free.get((stream, small))
        if cap is None or not pool or self.config.expandable_segments:
            return False  # PyTorch skips expandable segments' blocks here: never given back
        want = max(size, cap)
        i = bisect_left(pool, (want, -1))
        if i < len(pool):
            self._release_block(pool[i][1])
            return True
        released = 0
        while released < want and pool and pool[-1][0] >= cap:
            released += pool[-1][0]
            self._release_block(pool[-1][1])
        return released >= want

    def _release_block(self, addr: int) -> None:
        seg = self.seg[addr]
        self._free_remove(addr)
        self._drop(addr)
        self._unreserve(seg, seg.base)
        self.segments.remove(seg)

    def _release_cached(self) -> None:
        """Give back every wholly free segment, and unmap the free tail of expandable ones
        (`release_cached_blocks`)."""
        for addr in list(self.is_free):
            seg = self.seg[addr]
            if seg.expandable:
                page = SMALL_BUFFER if seg.small else LARGE_BUFFER
                keep = -(-(addr - seg.base) // page) * page + seg.base
                if addr + self.size[addr] != seg.end or keep >= seg.end:
                    continue  # not the segment's free tail, or no whole page of it
                self._free_remove(addr)
                self._drop(addr)
                self._unreserve(seg, keep)
                if addr < keep:
                    self._put(addr, keep - addr, seg)
                    self._free_insert(addr)
            elif addr == seg.base and self.size[addr] == seg.end - seg.base:
                self._release_block(addr)

    # -- malloc and free ------------------------------------------------------------------

    def malloc(self, size: int, stream: int) -> int | None:
        small = size <= SMALL_SIZE
        addr = self._found(size, stream, small)
        if addr is None:
            get = self._expand if self.config.expandable_segments else self._new_segment
            addr = get(size, stream, small)
            if addr is None and self._release_oversize(size, stream, small):
                addr = get(size, stream, small)
            if addr is None:
                self._release_cached()
                addr = get(size, stream, small)
            if addr is None:
                return None
        self._split(addr, size)
        seg, end = self.seg[addr], addr + self.size[addr]
        if end > seg.used_end:  # handed out for the first time: no longer a tail
            self.used_by[stream] = self.used_by.get(stream, 0) + end - seg.used_end
            seg.used_end = end
        self.blocks_by[stream] = self.blocks_by.get(stream, 0) + self.size[addr]
        return addr

    def release(self, addr: int) -> None:
        """Free a block: back to its stream's pool, merged with free neighbours."""
        seg = self.seg[addr]
        self.blocks_by[seg.stream] -= self.size[addr]
        for other in (self.by_end.get(addr), addr + self.size[addr]):
            if other is None or other not in self.is_free or self.seg[other] is not seg:
                continue  # in use, or another segment's block at the boundary
            self._free_remove(other)
            lo, hi = min(addr, other), max(addr, other)
            size = self.size[lo] + self.size[hi]
            self._drop(hi)  # lo keeps its start and takes hi's end
            del self.by_end[hi]
            self.size[lo], self.by_end[lo + size], addr = size, lo, lo
        self._free_insert(addr)


def replay(events: Iterable[Event | tuple], config: AllocatorConfig | None = None,
           capacity: int | None = None) -> AllocatorReplay:
    """Replay allocations (`Event`s, or (size, start, end[, stream]) tuples) in time order —
    frees at a time before allocations at it, each kind in the order given — through the
    caching allocator. `capacity`: the device's bytes; past it cached segments are given back
    and, failing that, the replay stops with `oom` set. Zero-byte requests allocate nothing."""
    config = config or AllocatorConfig()
    evs = [e if isinstance(e, Event) else Event(*e) for e in events]
    sizes = [config.round_size(e.size) for e in evs]
    n = len(evs)
    order: list[int] = []  # (time, frees first, index) as one integer: sorts fastest
    for i, e in enumerate(evs):
        if e.size <= 0:
            continue
        order.append((e.start * 2 + 1) * n + i)
        if e.end is not None:
            if e.end <= e.start:
                raise AmpscopeError(f"allocation {i} is freed at {e.end}, not after it is "
                                    f"made at {e.start}")
            order.append(e.end * 2 * n + i)
    order.sort()
    state = _Allocator(config, capacity)
    malloc, release = state.malloc, state.release
    addrs: dict[int, int] = {}
    requested = rounded = 0
    best: tuple[int, int | None, int, int, int, int, int, int] = (0, None, 0, 0, 0, 0, 0, 0)
    alloc_peak: tuple[int, int | None] = (0, None)
    oom = None
    for key in order:
        slot, i = divmod(key, n)
        e, size = evs[i], sizes[i]
        if not slot & 1:
            release(addrs.pop(i))
            requested -= e.size
            rounded -= size
            continue
        time = slot // 2
        addr = malloc(size, e.stream)
        if addr is None:
            oom = OutOfMemory(time, size, state.reserved, capacity or 0)
            break
        addrs[i] = addr
        requested += e.size
        rounded += size
        if rounded > alloc_peak[0]:
            alloc_peak = (rounded, time)
        if state.reserved > best[0]:
            blocks = sum(state.blocks_by.values())
            tails = state.reserved - sum(state.used_by.values())
            free_other = sum(used - state.blocks_by[s] for s, used in state.used_by.items()
                             if s != e.stream)
            best = (state.reserved, time, requested, blocks - requested, tails,
                    state.reserved - blocks - tails, free_other, len(state.segments))
    return AllocatorReplay(*best[:2], *alloc_peak, *best[2:], state.mallocs, config, oom)

