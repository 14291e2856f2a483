"""The predicted step in the reports: `flops`, `trace`, `matrix`, `diff` and the distributed view
show the same `step_time` the model computes for the same trace, on the GPU the rule of
api/gpu_time.py picks; a measured step time is shown beside it; a CPU setting has none."""

from __future__ import annotations

import json
import math
import re

import pytest
from jsonschema import Draft202012Validator

import ampscope
from ampscope import hardware, schemas
from ampscope.analysis.diff import diff_traces
from ampscope.analysis.step_time import step_time
from ampscope.analysis.time_diff import block_modules
from ampscope.api.gpu_time import accelerator_for, predicted_step
from ampscope.cli import main

A100 = hardware.by_name("a100")
TRAIN = {"batch": 4, "seq": 32, "predict": True}


@pytest.fixture(scope="module")
def ladder():
    """gpt2-tiny's train step in fp32, fp32+tf32 and fp32 on the CPU, predicted on an A100."""
    return ampscope.matrix("gpt2-tiny", settings=["cuda:fp32", "cuda:fp32+tf32", "fp32"],
                           gpu="a100", **TRAIN)


def _run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _words(out: str) -> str:
    """The output with its line wraps undone (the terminal's width decides them)."""
    return " ".join(out.split())


def test_flops_report_predicts_what_step_time_computes_for_the_same_trace():
    trace = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16", **TRAIN)
    report = ampscope.flops(trace, gpu="a100")
    expected = step_time(trace, A100)
    assert report.predicted is not None
    assert report.predicted.accelerator == "a100"
    assert report.predicted.seconds == expected.seconds > 0
    assert report.predicted.by_bound == expected.by_bound
    assert report.predicted.tokens == 4 * 32
    document = report.to_dict()["predicted"]
    assert document["seconds"] == expected.seconds
    assert "ops" not in document  # the per-op list stays out of the report's JSON
    assert math.isclose(sum(document["by_phase"].values()), expected.seconds)


def test_the_gpu_rule():
    emulated = ampscope.trace("gpt2-tiny", setting="cuda:bf16", seq=8, predict=True)
    assert emulated.setting.emulated
    assert accelerator_for(None, emulated.setting).name == "h100"  # what emulated CUDA stands for
    assert accelerator_for("a100", emulated.setting) is A100
    assert predicted_step(emulated).accelerator == "h100"
    cpu = ampscope.trace("gpt2-tiny", setting="fp32", seq=8, predict=True)
    assert accelerator_for(None, cpu.setting) is None
    # A CPU step says nothing about a GPU's, even with a GPU named.
    assert predicted_step(cpu) is None and predicted_step(cpu, "a100") is None
    sampling = ampscope.trace("gpt2-tiny", setting="cuda:bf16", workload="generate", seq=8,
                              new_tokens=2, predict=True)
    assert predicted_step(sampling, "a100") is None


def test_matrix_row_orders_fp32_above_tf32_on_an_a100(ladder):
    matrix, traces = ladder
    fp32, tf32, cpu = matrix.predicted
    assert cpu is None
    assert fp32.seconds == step_time(traces[0], A100).seconds
    assert fp32.seconds > tf32.seconds
    # TF32 moves the matmuls to Tensor Cores: compute drops, the bytes moved stay.
    assert fp32.by_bound["compute"] > tf32.by_bound["compute"]
    assert fp32.by_bound["memory"] == pytest.approx(tf32.by_bound["memory"])
    rows = {r.what: r.values for r in matrix.summary}
    shown = rows["step on A100 (predicted)"]
    assert shown == tuple(f"{p.seconds * 1e3:,.1f} ms" for p in (fp32, tf32)) + ("—",)
    assert rows["tokens/s (predicted)"][:2] == (f"{fp32.tokens_per_second:,.0f}",
                                                f"{tf32.tokens_per_second:,.0f}")
    assert fp32.tokens_per_second == pytest.approx(4 * 32 / fp32.seconds)
    document = matrix.to_dict()
    assert [p and p["seconds"] for p in document["predicted"]] == [fp32.seconds, tf32.seconds,
                                                                  None]
    assert Draft202012Validator(schemas.load("matrix")).is_valid(document)


def test_flops_shows_the_measured_step_beside_the_prediction(capsys):
    argv = ["gpt2-tiny", "-s", "cuda:bf16", "--seq", "8", "--predict", "--gpu", "a100"]
    out = _run(capsys, "flops", *argv, "--step-time", "0.004")
    expected = step_time(ampscope.trace("gpt2-tiny", setting="cuda:bf16", seq=8, predict=True),
                         A100)
    assert "Predicted step on NVIDIA A100 SXM4 80GB" in _words(out)
    assert f"measured 4 ms: the prediction is {expected.seconds / 0.004:.2f}×" in _words(out)
    assert "Throughput  step 4.0 ms" in out  # the measured time still makes the throughput
    document = json.loads(_run(capsys, "flops", *argv, "--step-time", "0.004", "--json", "-"))
    assert document["predicted"]["seconds"] == expected.seconds
    assert document["utilization"]["seconds"] == 0.004
    assert list(Draft202012Validator(schemas.load("flops")).iter_errors(document)) == []


def test_cpu_settings_get_no_prediction(capsys):
    argv = ["gpt2-tiny", "-s", "fp32", "--seq", "8", "--predict", "--gpu", "a100"]
    assert "Predicted step" not in _run(capsys, "flops", *argv)
    assert "Predicted step" not in _run(capsys, "trace", *argv)
    assert json.loads(_run(capsys, "flops", *argv, "--json", "-"))["predicted"] is None
    assert json.loads(_run(capsys, "diff", "fp32", "bf16", "--model", "gpt2-tiny", "--seq", "8",
                           "--predict", "--json", "-"))["timing"] is None


def test_trace_header_line(capsys):
    out = _run(capsys, "trace", "gpt2-tiny", "-s", "cuda:fp32", "--seq", "8", "--predict",
               "--gpu", "a100")
    expected = step_time(ampscope.trace("gpt2-tiny", setting="cuda:fp32", seq=8, predict=True),
                         A100)
    line = re.search(r"Predicted step on NVIDIA A100 SXM4 80GB: ([\d.]+) ms \(([^)]*)\), "
                     r"([\d,]+) tokens/s", _words(out))
    assert line is not None
    assert float(line.group(1)) == pytest.approx(expected.seconds * 1e3, rel=5e-3)  # 3 figures
    assert line.group(3) == f"{expected.tokens_per_second:,.0f}"
    shares = dict(part.split() for part in line.group(2).split(", "))
    assert shares == {b: f"{100 * t / expected.seconds:.0f}%"
                      for b, t in expected.by_bound.items() if t > 0}


def test_diff_says_where_the_time_moved(ladder):
    _, (fp32, tf32, _) = ladder
    a, b = step_time(fp32, A100), step_time(tf32, A100)
    timing = diff_traces(fp32, tf32, (a, b)).timing
    assert timing is not None
    assert (timing.a, timing.b) == (a.seconds, b.seconds)
    assert timing.speedup == pytest.approx(a.seconds / b.seconds)
    # The bounds and the phases each account for the whole step, so their moves add up.
    assert sum(m.delta for m in timing.by_bound) == pytest.approx(b.seconds - a.seconds)
    assert sum(m.delta for m in timing.by_phase) == pytest.approx(b.seconds - a.seconds)
    # A stack's blocks are summed under one name, and every op's time is some module's.
    modules = block_modules(a)
    assert "transformer.h.0–1.mlp.c_fc" in modules
    assert sum(modules.values()) == pytest.approx(sum(o.seconds for o in a.ops))
    top = timing.modules[0]
    assert abs(top.delta) == max(abs(m.delta) for m in timing.modules)
    # Settings on different GPUs, or one without a prediction: nothing to compare.
    assert diff_traces(fp32, tf32, (a, None)).timing is None
    assert diff_traces(fp32, tf32, (a, step_time(tf32, hardware.by_name("h100")))).timing is None


def test_distributed_trace_shows_rank_zeros_step_with_its_collectives(capsys):
    out = _run(capsys, "trace", "gpt2-tiny", "--distributed", "fsdp", "--nproc", "2",
               "--predict", "-s", "cuda:bf16", "--seq", "8", "--gpu", "h100")
    line = re.search(r"Predicted step on NVIDIA H100 SXM5 80GB: [^,]+\(([^)]*)\)", _words(out))
    assert line is not None and "communication" in line.group(1)


def test_html_report_has_the_predicted_step_column(ladder):
    from ampscope.render.html import report_html

    matrix, traces = ladder
    reports = [ampscope.flops(t, gpu="a100") for t in traces]
    page = report_html(traces, matrix, reports=reports)
    fp32 = reports[0].predicted
    assert "predicted step" in page
    assert f"{1e3 * fp32.seconds:.1f} ms on A100" in page
    assert f"{round(fp32.tokens_per_second):,}" in page
    # Without a prediction anywhere (CPU settings), the columns are not there.
    cpu = [ampscope.flops(traces[2])]
    assert "predicted step" not in report_html([traces[2]], matrix, reports=cpu)
