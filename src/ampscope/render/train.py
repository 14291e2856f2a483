"""What `ampscope train` and `ampscope bench` show: a progress bar, tables, a plot.

Renderers only read results (docs/architecture.md); the plot is drawn with matplotlib's `Figure` and
Agg canvas directly, never through pyplot, so no global figure state is touched.

Namesakes, the same concern at another layer: `cli/train.py`."""

from __future__ import annotations

import io
import statistics
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ampscope.files import write_atomic
from ampscope.render.style import format_bytes, titled_table
from ampscope.train.bench import BenchReport
from ampscope.train.config import EvalLog, StepLog, TrainResult


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{mfu:.1%}"


def step_line(s: StepLog) -> str:
    """One training log line, as nanoGPT prints it."""
    mfu = f" | MFU {s.mfu:.1%}" if s.mfu is not None else ""
    return (f"step {s.step:5d} | loss {s.loss:.4f} | lr {s.lr:.2e} | norm {s.grad_norm:.3f} | "
            f"{s.seconds * 1e3:.1f} ms | {s.tokens_per_s:,.0f} tok/s{mfu}")


class TrainProgress:
    """A rich progress bar for a training run; pass the instance as `train(log=...)`.

    Evaluations and every `log_every`-th step are printed above the bar, so the log stays in
    the terminal's scrollback when the bar is gone.
    """

    def __init__(self, console: Console, total_steps: int, log_every: int):
        self.console, self.log_every = console, max(1, log_every)
        self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                 console=console, transient=True)
        self.task = self.progress.add_task("train", total=total_steps, status="")

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, entry: StepLog | EvalLog) -> None:
        if isinstance(entry, EvalLog):
            self.progress.console.print(f"step {entry.step:5d} | val loss {entry.val_loss:.4f}")
            return
        if entry.step % self.log_every == 0:
            self.progress.console.print(step_line(entry), highlight=False)
        self.progress.update(self.task, completed=entry.step,
                             status=f"loss {entry.loss:.3f}  {entry.tokens_per_s:,.0f} tok/s")


def train_header(result: TrainResult) -> Text:
    c = result.config
    setting = result.setting
    text = Text(f"{c.model} ({result.parameters:,} parameters)  setting {setting['name']} on "
                f"{result.device_name}  ", style="bold")
    accum = f" = {result.grad_accum} × {c.batch}×{c.seq}" if result.grad_accum > 1 else ""
    text.append(f"\n{result.tokens_per_step:,} tokens/step{accum}; data {result.data}: "
                f"{result.train_tokens:,} train / {result.val_tokens:,} val tokens",
                style="")
    for note in result.notes:
        text.append(f"\n  • {note}", style="dim")
    return text


def train_summary(result: TrainResult) -> RenderableType:
    """After the run: losses, speed, memory, the checkpoint and the sample."""
    timed = result.steps[result.start_step:][1:] or result.steps[-1:]  # the first step warms up
    ms = statistics.median(s.seconds for s in timed) * 1e3
    mfus = [s.mfu for s in timed if s.mfu is not None]
    first, last = result.evals[0], result.evals[-1]
    lines = [
        f"val loss {first.val_loss:.4f} (step {first.step}) → {last.val_loss:.4f} "
        f"(step {last.step})",
        f"median step {ms:.1f} ms, {result.tokens_per_step / ms * 1e3:,.0f} tokens/s, "
        f"MFU {format_mfu(statistics.median(mfus) if mfus else None)} "
        f"(FLOPs/token {result.flops_per_token:,}: {result.flops_formula})",
        f"peak memory {format_bytes(result.peak_memory)} ({result.memory_kind})",
    ]
    if result.checkpoint:
        lines.append(f"checkpoint {result.checkpoint}")
    parts: list[RenderableType] = [Text("\n".join(lines))]
    if result.sample is not None:
        parts += [Text("\nSample", style="bold"), Text(result.sample)]
    return Group(*parts)


def bench_table(report: BenchReport) -> Table:
    numbers = ("ms/step", "tokens/s", f"vs {report.baseline or 'first'}", "MFU", "peak mem",
               "loss")
    table = titled_table(None, "rung", *numbers, right=numbers, no_wrap=True)
    for r in report.rungs:
        if r.status != "ok":
            table.add_row(r.name, r.status, "", "", "", "", "", style="dim")
            continue
        table.add_row(r.name, f"{r.ms_per_step:.1f}", f"{r.tokens_per_s:,.0f}",
                      f"{r.speedup:.2f}×", format_mfu(r.mfu), format_bytes(r.peak_memory),
                      f"{r.final_loss:.4f}")
    return table


def render_bench(report: BenchReport) -> RenderableType:
    kinds = {r.memory_kind for r in report.rungs if r.status == "ok"}
    size = f" ({report.parameters:,} parameters)" if report.parameters else ""
    title = Text(f"{report.model}{size} on "
                 f"{report.device_name}: {report.batch}×{report.seq} tokens/step, "
                 f"{report.warmup} warm-up + {report.steps} timed steps per rung",
                 style="bold")
    notes = [f"{r.name}: {r.status}: {r.reason}" for r in report.rungs if r.status != "ok"]
    notes.append("ms/step: median of the timed steps; loss: training loss of the last step "
                 "(the same batch on every rung); rungs without +flash run attention on the "
                 "math kernel")
    if kinds:
        notes.append(f"peak mem: {', '.join(sorted(kinds))}; MFU against this device's dense "
                     "peak for the rung's compute dtype (n/a on a CPU or an unknown GPU)")
    return Group(title, bench_table(report), Text("\n".join(notes), style="dim"))


def save_bench_plot(report: BenchReport, path: str | Path) -> Path | None:
    """tokens/s per rung (bars) and the training loss of every rung per step (lines), as PNG.
    None when no rung ran."""
    ran = [r for r in report.rungs if r.status == "ok"]
    if not ran:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8), layout="constrained")
    speed, loss = fig.subplots(1, 2, width_ratios=(1.2, 1))
    bars = speed.barh([r.name for r in ran][::-1], [r.tokens_per_s for r in ran][::-1],
                      color="#2e7d32")
    speed.bar_label(bars, [f"{r.speedup:.2f}×" for r in ran][::-1], padding=3, fontsize=8)
    speed.set_xlabel(f"tokens/s (label: speedup over {report.baseline})", fontsize=9)
    speed.set_title(f"{report.model} on {report.device_name}, "
                    f"{report.batch}×{report.seq} tokens/step", fontsize=10)
    for r in ran:
        loss.plot(range(1, len(r.losses) + 1), r.losses, label=r.name, linewidth=1.2)
    loss.set_xlabel("step", fontsize=9)
    loss.set_ylabel("training loss", fontsize=9)
    loss.legend(fontsize=7, frameon=False)
    for ax in (speed, loss):
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    FigureCanvasAgg(fig).print_png(png)
    write_atomic(path, png.getvalue())
    return path
