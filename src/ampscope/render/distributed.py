"""Terminal rendering of a `DistributedReport`: per-rank bytes held and peak (with the caching
allocator's reserved peak on cuda), rank 0's collectives, and rank 0's step predicted on a GPU
(collectives included).

Namesakes, the same concern at another layer: `torchcompat/distributed.py`."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from ampscope.analysis.step_time import StepTime
from ampscope.distributed.report import DistributedReport, summarize
from ampscope.render.predicted_step import predicted_line
from ampscope.render.ranks import HELD_CATEGORIES, any_reserved, peak_cell, reserved_cell
from ampscope.render.style import format_bytes, titled_table


def render_distributed(report: DistributedReport,
                       predicted: StepTime | None = None) -> RenderableType:
    p = report.parallel
    how = "predicted (fake tensors, fake process group)" if report.mode == "predict" \
        else f"{p.world_size} processes, {report.backend}"
    head = Text()
    head.append(f"{report.model}", style="bold")
    head.append(f" ({report.parameters:,} parameters) · {p.strategy.upper()} on {p.world_size} "
                f"ranks · {report.setting.name} · {how}\n")
    policy = ", ".join(f"{k}={v}" for k, v in p.policy_dict().items() if v) or "none"
    head.append(f"Mixed-precision policy: {policy}\n")
    head.append(f"Parameters unsharded (all-gathered) in: "
                f"{', '.join(report.unshard_dtypes) or '— (not sharded)'}\n")
    head.append(f"Gradients reduced in: {', '.join(report.reduce_dtypes) or '—'}")
    if predicted is not None:
        head.append("\n")
        head.append_text(predicted_line(predicted))

    # The peak over the step (in the CUDA allocator's blocks on cuda), and beside it what the
    # caching allocator would reserve (cuda settings only).
    peaks = any(r.peak is not None for r in report.ranks)
    reserved = any_reserved(report)
    columns = ["rank", *(c.replace("_", " ") for c in HELD_CATEGORIES), "total",
               *(["peak"] if peaks else []), *(["reserved"] if reserved else [])]
    held = titled_table("Held by each rank after the step", *columns, right=columns)
    for r in report.ranks:
        cells = [f"{format_bytes(r.held_bytes(c))} {', '.join(sorted(r.held.get(c, {}))) or '—'}"
                 for c in HELD_CATEGORIES]
        held.add_row(str(r.rank), *cells, format_bytes(r.held_total),
                     *([peak_cell(r.peak, where=False)] if peaks else []),
                     *([reserved_cell(r.peak)] if reserved else []))

    numbers = ("calls", "payload", "sent (ring)")
    comms = titled_table(f"Collectives of rank {report.ranks[0].rank} in one step",
                         "collective", "phase", "dtype", *numbers, right=numbers)
    rows = summarize(report.ranks[0].collectives)
    for row in rows:
        comms.add_row(row.kind.replace("_", "-"), row.phase, row.dtype, str(row.calls),
                      format_bytes(row.payload_bytes), format_bytes(row.wire_bytes))
    if rows:
        comms.add_row("total", "", "", str(sum(r.calls for r in rows)),
                      format_bytes(sum(r.payload_bytes for r in rows)),
                      format_bytes(sum(r.wire_bytes for r in rows)), style="bold")
    parts: list[RenderableType] = [head, Text(), held, Text(), comms]
    parts += [Text(f"Note: {n}", style="dim") for n in report.notes]
    return Group(*parts)
