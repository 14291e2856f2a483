"""A rank's memory peak, read off its trace's storage records by the memory report's own
analysis: the same figure `ampscope memory` gives for one process."""

from __future__ import annotations

from ampscope.analysis.memory import live_at, memory_report
from ampscope.distributed.report import Held, RankPeak
from ampscope.records import Trace


def rank_peak(trace: Trace) -> RankPeak | None:
    """The most bytes the rank held at once over its traced steps (a DTensor's local shard,
    FSDP2's unsharded parameters while they are gathered), and by category and dtype what was
    live then; None for a trace without storage records."""
    if not trace.storages:
        return None
    report = memory_report(trace, buckets=1, largest=0)
    live: Held = {}
    for s in live_at(trace.storages, report.peak.op):
        by_dtype = live.setdefault(str(s.category), {})
        by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.nbytes
    return RankPeak(report.peak.bytes, report.peak.rounded_bytes, report.peak.phase, live)
