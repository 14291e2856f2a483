"""Whether each rank of a job fits a GPU: its peak held against the GPU's memory.

The verdicts are part of the `ampscope.distributed/1` report (its notes), so the JSON, the HTML
page and the terminal say the same: the caller adds them where it builds the report (the
`run --nproc N --gpu NAME` command), and the views only show the notes.
"""

from __future__ import annotations

from ampscope.distributed.report import DistributedReport
from ampscope.hardware import Accelerator
from ampscope.wording import format_bytes


def verdicts(report: DistributedReport, gpu: Accelerator | None) -> list[str]:
    """A note for each distinct peak of `report`'s ranks, largest first, naming the ranks that
    reach it and whether it fits in `gpu`'s memory (by how much it is under or over); none
    without a GPU or its memory size. A peak is counted as a CUDA allocator counts it (its
    512-byte blocks) where the run recorded that."""
    if gpu is None or gpu.memory_bytes is None:
        return []
    by_peak: dict[int, list[int]] = {}
    for r in report.ranks:
        if r.peak is not None:
            counted = r.peak.rounded_bytes if r.peak.rounded_bytes is not None else r.peak.bytes
            by_peak.setdefault(counted, []).append(r.rank)
    lines = []
    for counted, ranks in sorted(by_peak.items(), reverse=True):
        room = gpu.memory_bytes - counted
        answer = (f"fits, {format_bytes(room)} to spare" if room >= 0 else
                  f"does not fit: {format_bytes(-room)} over")
        who = f"Rank {ranks[0]}" if len(ranks) == 1 else \
            "Ranks " + ", ".join(map(str, ranks))
        lines.append(f"{who}: peak {format_bytes(counted)} of {gpu.title}'s "
                     f"{format_bytes(gpu.memory_bytes)}: {answer} (the steps' own storages; "
                     "the CUDA context, NCCL's buffers and the allocator's reserve come on top).")
    return lines
