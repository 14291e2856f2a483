"""Progress of a run: the op recorder's reports, and the bar the CLI draws from them."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import ampscope
from ampscope.cli import common, main
from ampscope.runs import progress


@pytest.mark.fast
def test_reports_follow_the_recorded_ops_and_their_phases():
    reports: list[tuple[int, str]] = []
    with progress.reporting(lambda ops, phase: reports.append((ops, phase)), every=40):
        trace = ampscope.trace("gpt2-tiny", seq=8, predict=True)
    counts = [ops for ops, _ in reports]
    assert counts == sorted(set(counts)) and counts[0] == 1
    # Each report names the phase of the op it counts up to: the record says which it is.
    assert all(phase == trace.ops[ops - 1].phase for ops, phase in reports)
    assert [p for i, (_, p) in enumerate(reports) if i == 0 or p != reports[i - 1][1]] == [
        "forward", "backward", "optimizer"]
    # Every 40 ops, and at each change of phase: nothing in between.
    changes = {i + 1 for i in range(1, len(trace.ops)) if trace.ops[i].phase != trace.ops[i - 1].phase}
    assert set(counts) == {n for n in range(1, len(trace.ops) + 1) if n % 40 == 0} | changes | {1}


@pytest.mark.fast
def test_no_report_outside_reporting_and_a_bad_interval_is_refused():
    assert progress.listener() is None
    with pytest.raises(ValueError, match="at least 1"), progress.reporting(lambda o, p: None, every=0):
        pass
    assert progress.listener() is None


def test_the_bar_shows_ops_and_phase_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with common._run_progress("Tracing", after=0, console=console):
        trace = ampscope.trace("gpt2-tiny", seq=8, predict=True)
    # The last report before the run ended: a multiple of EVERY or the start of a phase.
    ops = trace.ops
    last = max(n for n in range(1, len(ops) + 1)
               if n % progress.EVERY == 0 or ops[n - 1].phase != ops[n - 2].phase)
    assert f"{last:,} ops · {ops[last - 1].phase}" in out.getvalue()


def test_nothing_reaches_a_stderr_that_is_no_terminal(capsys, monkeypatch):
    seen: list[int] = []
    report = progress.Reporter.op

    def counting(self, count, phase):
        seen.append(count)
        report(self, count, phase)

    monkeypatch.setattr(progress.Reporter, "op", counting)
    monkeypatch.setattr(common, "PROGRESS_AFTER_S", 0.0)
    assert main(["trace", "gpt2-tiny", "--seq", "8"]) == 0
    out, err = capsys.readouterr()
    assert seen and "Ops" not in err  # the recorder reported, the bar drew nothing
    assert err == ""
