"""The per-rank section of `ampscope run --nproc N`, printed after rank 0's usual trace report
(`render_ranks` says what it shows).

Namesakes, the same concern at another layer: `script/ranks.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.analysis.step_time import StepTime
from ampscope.distributed.report import DistributedReport, RankPeak, summarize
from ampscope.records import Trace
from ampscope.render.predicted_step import duration
from ampscope.render.style import format_bytes, titled_table

_SHAPES = 6  # parameter shapes listed per rank before "…"
# What a rank holds after its step, in the order every view of it shows (distributed.py, html.py).
HELD_CATEGORIES = ("parameter", "gradient", "optimizer_state")


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


def peak_cell(peak: RankPeak | None, *, where: bool = True) -> str:
    """The rank's peak as a CUDA allocator would count it (its 512-byte blocks), and where."""
    if peak is None:
        return "—"
    counted = peak.rounded_bytes if peak.rounded_bytes is not None else peak.bytes
    return f"{format_bytes(counted)} ({peak.phase})" if peak.phase and where \
        else format_bytes(counted)


def reserved_cell(peak: RankPeak | None) -> str:
    """What the caching allocator would reserve at most on the rank (its replay), and how
    much above the allocated peak: "4 MiB (+51%)"."""
    if peak is None or peak.reserved_bytes is None:
        return "—"
    counted = peak.rounded_bytes if peak.rounded_bytes is not None else peak.bytes
    above = f" (+{100 * (peak.reserved_bytes / counted - 1):.0f}%)" if counted else ""
    return format_bytes(peak.reserved_bytes) + above


def any_reserved(report: DistributedReport) -> bool:
    """Whether some rank has a reserved peak (a cuda setting's): its column is shown then."""
    return any(r.peak is not None and r.peak.reserved_bytes is not None for r in report.ranks)


def _step(predicted: StepTime | None) -> str:
    """"312 ms (compute 58%, comm 7%)": the step, its largest bound and, where the rank ran
    collectives, their exposed share (what differs between ranks); "comm" keeps the narrow
    column on one word a line."""
    if predicted is None:
        return "—"
    whole = predicted.seconds
    top = max(predicted.by_bound, key=lambda b: predicted.by_bound[b])
    shares = [top] + (["communication"] if top != "communication"
                      and predicted.by_bound.get("communication") else [])
    return f"{duration(whole)} (" + ", ".join(
        f"{'comm' if b == 'communication' else b} {100 * predicted.by_bound[b] / whole:.0f}%"
        for b in shares) + ")"


def render_ranks(report: DistributedReport, traces: list[Trace] | None = None, *,
                 predicted: list[StepTime | None] | None = None) -> RenderableType:
    """What each rank's parameters, gradients and optimizer state hold (of a sharded parameter,
    the rank's shard), its peak (and the caching allocator's reserved peak, on cuda), each
    rank's collectives, and the report's notes (with `--gpu`, whether each rank's peak fits:
    distributed/verdicts.py); `traces` (every rank's, rank 0 first) adds the parameter shapes,
    `predicted` (every rank's, by rank) its predicted step on a GPU, collectives included."""
    timed = predicted is not None and any(p is not None for p in predicted)
    gpus = {p.accelerator for p in predicted or [] if p is not None}
    step_column = f"step on {gpus.pop().upper()} (predicted)" if len(gpus) == 1 else \
        "step (predicted)"
    n = report.parallel.world_size
    head = Text()
    head.append(f"{n} rank{'s' if n != 1 else ''}", style="bold")
    head.append(f" · {report.backend} · gradients reduced in: "
                f"{', '.join(report.reduce_dtypes) or '—'}")
    if report.unshard_dtypes:
        head.append(f" · parameters all-gathered in: {', '.join(report.unshard_dtypes)}")
    reserved = any_reserved(report)
    # Two tables, so that each fits a terminal of 80 columns: what a rank holds, then its
    # peak and its predicted step.
    held = titled_table("Held by each rank after its last step", "rank", "parameters",
                        "gradients", "optimizer state",
                        *(["parameter shapes"] if traces is not None else []), right=("rank",))
    peaks = titled_table("Peak and step of each rank", "rank", "peak",
                         *(["reserved"] if reserved else []),
                         *([step_column] if timed else []),
                         right=("rank", "peak", "reserved"))
    comms = titled_table("Collectives of each rank", "rank", "collective", "phase", "dtype",
                         "calls", "payload", right=("rank", "calls", "payload"))
    for r in report.ranks:
        cells = [str(r.rank), *(_held(r.held.get(c, {})) for c in HELD_CATEGORIES)]
        if traces is not None:
            cells.append(_shapes(traces[r.rank] if r.rank < len(traces) else None))
        held.add_row(*cells)
        peak_cells = [str(r.rank), peak_cell(r.peak),
                      *([reserved_cell(r.peak)] if reserved else [])]
        if timed:
            assert predicted is not None
            peak_cells.append(_step(predicted[r.rank] if r.rank < len(predicted) else None))
        peaks.add_row(*peak_cells)
        for row in summarize(r.collectives):
            comms.add_row(str(r.rank), row.kind.replace("_", "-"), row.phase, row.dtype,
                          str(row.calls), format_bytes(row.payload_bytes))
    parts: list[RenderableType] = [head, Text(), held, Text(), peaks, Text()]
    parts.append(comms if comms.rows else Text("No rank ran a collective."))
    parts += [Text(f"Note: {note}", style="dim") for note in report.notes]
    return Group(*parts)
