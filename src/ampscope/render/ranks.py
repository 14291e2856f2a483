"""The per-rank section of `ampscope run --nproc N`: what each rank's parameters, gradients and
optimizer state hold (of a sharded parameter, the rank's shard), and the collectives each rank
ran (printed after rank 0's usual trace report)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.distributed.report import DistributedReport, RankPeak, summarize
from ampscope.hardware import Accelerator
from ampscope.records import Trace
from ampscope.render.style import format_bytes

_SHAPES = 6  # parameter shapes listed per rank before "…"


def _held(by_dtype: dict[str, int]) -> str:
    return ", ".join(f"{format_bytes(b)} {d}" for d, b in sorted(by_dtype.items())) or "—"


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "()"


def _shapes(trace: Trace | None) -> str:
    """The rank's parameter shapes: a sharded one's as "its shard of the full shape"."""
    if trace is None:
        return ""
    shapes = [_shape(p.shape) if p.local_shape is None
              else f"{_shape(p.local_shape)} of {_shape(p.shape)}" for p in trace.parameters]
    more = f", … ({len(shapes)} in all)" if len(shapes) > _SHAPES else ""
    return ", ".join(shapes[:_SHAPES]) + more


def _peak(peak: RankPeak | None) -> str:
    """The rank's peak as a CUDA allocator would count it (its 512-byte blocks), and where."""
    if peak is None:
        return "—"
    counted = peak.rounded_bytes if peak.rounded_bytes is not None else peak.bytes
    return f"{format_bytes(counted)} ({peak.phase})" if peak.phase else format_bytes(counted)


def verdicts(report: DistributedReport, gpu: Accelerator | None) -> list[str]:
    """Each rank's peak held against `gpu`'s memory (the report's notes): a line for each
    peak, naming the ranks that reach it."""
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


def render_ranks(report: DistributedReport, traces: list[Trace] | None = None
                 ) -> RenderableType:
    """One table of what each rank holds and its peak, one of each rank's collectives;
    `traces` (every rank's, rank 0 first) adds the parameter shapes."""
    n = report.parallel.world_size
    head = Text()
    head.append(f"{n} rank{'s' if n != 1 else ''}", style="bold")
    head.append(f" · {report.backend} · gradients reduced in: "
                f"{', '.join(report.reduce_dtypes) or '—'}")
    if report.unshard_dtypes:
        head.append(f" · parameters all-gathered in: {', '.join(report.unshard_dtypes)}")
    held = Table(title="Held by each rank after its last step", title_justify="left",
                 show_edge=False)
    for column in ("rank", "parameters", "gradients", "optimizer state", "peak"):
        held.add_column(column, justify="right" if column in ("rank", "peak") else "left")
    if traces is not None:
        held.add_column("parameter shapes")
    for r in report.ranks:
        cells = [str(r.rank), _held(r.held.get("parameter", {})),
                 _held(r.held.get("gradient", {})), _held(r.held.get("optimizer_state", {})),
                 _peak(r.peak)]
        if traces is not None:
            cells.append(_shapes(traces[r.rank] if r.rank < len(traces) else None))
        held.add_row(*cells)
    comms = Table(title="Collectives of each rank", title_justify="left", show_edge=False)
    for column in ("rank", "collective", "phase", "dtype", "calls", "payload"):
        comms.add_column(column, justify="right" if column in ("rank", "calls", "payload")
                         else "left")
    for r in report.ranks:
        for row in summarize(r.collectives):
            comms.add_row(str(r.rank), row.kind.replace("_", "-"), row.phase, row.dtype,
                          str(row.calls), format_bytes(row.payload_bytes))
    parts: list[RenderableType] = [head, Text(), held, Text()]
    parts.append(comms if comms.rows else Text("No rank ran a collective."))
    parts += [Text(f"Note: {note}", style="dim") for note in report.notes]
    return Group(*parts)
