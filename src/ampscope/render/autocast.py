"""`ampscope policy`: an autocast policy, two devices' differences, and the quiz, as tables.

Namesakes, the same concern at another layer: `analysis/autocast.py`; and the checks of the
autocast regions a run entered, `analysis/checks/autocast.py`."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ampscope.analysis.autocast import PolicyReport, PolicyRow, meaning
from ampscope.render.style import ColumnOptions, dtype_text, titled_table


def _read_from(version: str) -> dict:
    """The caption every policy table carries: the build the policy was read from."""
    return {"caption": f"Read from PyTorch {version}.", "caption_justify": "left"}


def policy_table(rows: list[PolicyRow], device: str, dtype: str, total: int, version: str
                 ) -> Table:
    table = titled_table(f"Autocast on {device} with {dtype}: {len(rows)} of {total} ops",
                         "op", "category", ("what autocast does", {"style": "dim"}),
                         **_read_from(version))
    for r in rows:
        table.add_row(r.op, r.categories[0], meaning(r.categories[0], dtype))
    return table


def compare_table(rows: list[PolicyRow], devices: tuple[str, str], dtype: str, version: str
                  ) -> Table:
    table = titled_table(f"Where autocast differs between {devices[0]} and {devices[1]} "
                         f"({dtype}): {len(rows)} ops", "op", *devices, **_read_from(version))
    for r in rows:
        table.add_row(r.op, *(Text(c, style="dim" if c == "passthrough" else "") for c in r.categories))
    return table


def quiz_table(answers: dict[str, dict[str, dict[str, str]]], dtype: str, version: str
               ) -> Table:
    """answers: device → expression → input dtype → output dtype."""
    devices = list(answers)
    inputs = list(next(iter(next(iter(answers.values())).values())))
    table = titled_table(f"What comes out under autocast ({dtype})", "expression",
                         *((f"{device}\n{name} in", ColumnOptions(justify="center"))
                           for device in devices for name in inputs), **_read_from(version))
    for expression in next(iter(answers.values())):
        cells = [dtype_text([answers[d][expression][i]]) for d in devices for i in inputs]
        table.add_row(expression, *cells)
    return table


def history_table(report: PolicyReport) -> Table:
    """How the device's policy changed for the ops GPT-style models call."""
    assert report.history is not None
    table = titled_table(f"Autocast on {report.device} in earlier releases (ops GPT-style "
                         "models call)", "op", "before", "since", "release", "here",
                         ("source", {"no_wrap": True}), caption_justify="left",
                         caption=f"here: this build, PyTorch {report.torch}, has the change.")
    for change, has in zip(report.history, report.in_build, strict=True):
        table.add_row(change.name, Text(change.before, style="dim"), change.since,
                      change.version, "yes" if has else "no", change.source)
    return table


def render_policy(report: PolicyReport) -> Table:
    """The table `ampscope policy` prints for the report's form."""
    if report.history is not None:
        return history_table(report)
    if report.quiz is not None:
        return quiz_table(report.quiz, report.dtype, report.torch)
    if report.devices is not None:
        return compare_table(report.rows, report.devices, report.dtype, report.torch)
    assert report.device is not None
    return policy_table(report.rows, report.device, report.dtype, report.total, report.torch)
