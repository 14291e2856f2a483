"""The CUDA caching allocator (hardware/cuda_allocator.py) replayed over a trace's storage
records: the memory report's reserved peak, in op indices.

`AllocatorConfig` is importable from here too, beside the replay that takes it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ampscope.hardware.cuda_allocator import AllocatorConfig, AllocatorReplay, replay
from ampscope.records import StorageRecord
from ampscope.records.timeline import allocation_events
from ampscope.runtime.predict import gc_paused

__all__ = ["AllocatorConfig", "replay_storages"]


def replay_storages(storages: Iterable[StorageRecord], n_ops: int,
                    config: AllocatorConfig | None = None) -> AllocatorReplay:
    """`replay` over a trace's storage records, on one stream, without a capacity; times are
    op indices, None before the step."""
    with gc_paused():  # thousands of small blocks: no full collection among them
        result = replay(allocation_events(storages, n_ops), config)

    def op(t: int | None) -> int | None:
        return None if t is None or t < 0 else t
    return replace(result, reserved_at=op(result.reserved_at), allocated_at=op(result.allocated_at))
