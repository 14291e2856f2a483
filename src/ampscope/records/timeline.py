"""When storages are live over a step: the timeline of a trace's storage records, in exact bytes
or in the CUDA allocator's blocks, and as the allocation events the allocator replay takes
(hardware/cuda_allocator.py). Plain functions of the records, for the memory report
(analysis/memory.py, analysis/allocator.py) and for each rank's peak (distributed/report.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ampscope.records.tensors import StorageRecord

# PyTorch's CUDACachingAllocator with default settings (c10/cuda/CUDACachingAllocator.cpp,
# `round_size`): a request is rounded up to a multiple of kMinBlockSize = 512 bytes, and a
# request under 512 bytes gets 512. A 0-byte request allocates nothing (`allocate` skips
# `malloc` when size is 0). `torch.cuda.memory_allocated` counts these rounded block sizes.
CUDA_MIN_BLOCK = 512


def cuda_block_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator's block for an `nbytes` storage has (default
    settings: no `roundup_power2_divisions`)."""
    if nbytes == 0:
        return 0
    return max(CUDA_MIN_BLOCK, -(-nbytes // CUDA_MIN_BLOCK) * CUDA_MIN_BLOCK)


def live_bytes(storages: Iterable[StorageRecord], n_ops: int,
               size: Callable[[int], int] | None = None) -> tuple[int, list[int]]:
    """(bytes live before the first op, bytes live through each op 0..n_ops-1). `size` maps a
    storage's bytes to what it occupies (`cuda_block_size`); exact bytes without it."""
    return lives_bytes(((s.nbytes, s.created, s.freed) for s in storages), n_ops, size)


def lives_bytes(lives: Iterable[tuple[int, int | None, int | None]], n_ops: int,
                size: Callable[[int], int] | None = None) -> tuple[int, list[int]]:
    """`live_bytes` of storages given as (bytes, created, freed) alone: a caller that derives
    many sizes of the same storages (analysis/plans.py) makes no record for each."""
    before = 0
    delta = [0] * (n_ops + 1)
    for nbytes, created, freed in lives:
        b = size(nbytes) if size is not None else nbytes
        if created is None:
            before += b
        else:
            delta[created] += b
        if freed is not None:
            delta[freed + 1] -= b
    live, now = [], before
    for k in range(n_ops):
        now += delta[k]
        live.append(now)
    return before, live


def allocation_events(storages: Iterable[StorageRecord],
                      n_ops: int) -> list[tuple[int, int, int | None, int]]:
    """The storages as (bytes, made at, freed at, stream) events, the tuples the allocator
    replay takes: made at their op (-1: before the step), freed after the op they were last
    live through (None: never), on stream 0 (a trace records no streams)."""
    return [(s.nbytes, -1 if s.created is None else s.created,
             None if s.freed is None else min(s.freed + 1, n_ops), 0) for s in storages]


def live_at(storages: Iterable[StorageRecord], op: int | None) -> list[StorageRecord]:
    """The storages live through op `op` (None: before the first op)."""
    if op is None:
        return [s for s in storages if s.created is None]
    return [s for s in storages
            if (s.created is None or s.created <= op) and (s.freed is None or s.freed >= op)]


def argmax(values: list[int]) -> int | None:
    """The index of the first largest value; None for none."""
    return max(range(len(values)), key=values.__getitem__) if values else None
