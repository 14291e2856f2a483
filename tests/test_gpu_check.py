"""tools/gpu_check (`make gpu-check`): its plumbing on the CPU. `--device cpu --tiny` runs every
part at tiny shapes; the tests check that the JSON has every part with the right FLOP and byte
counts, that ratios are measured / predicted, that the markdown and the docs section render, that
torch's global settings are as before, and the one-line refusal without a GPU. The measurements
themselves are only meaningful on a GPU (benchmarks/gpu/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampscope
from ampscope import hardware
from ampscope.analysis import op_time
from ampscope.hardware import kernels
from ampscope.precision import GlobalState, matmul

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

from gpu_check import measure, predict, report, steps  # noqa: E402
from gpu_check.__main__ import main  # noqa: E402
from gpu_check.timing import Box, matmul_precision  # noqa: E402

TINY_GPT2_PARAMETERS = 136_960  # gpt2-tiny: 2 layers × 64, vocabulary 512 (catalog.py)


def _state() -> tuple:
    """torch's global settings as the run could change them (the matmul precision per backend:
    torch 2.9+ also has the per-backend API, and reading the legacy one raises once both were
    used)."""
    return (matmul.snapshot(), torch.backends.cuda.matmul.allow_tf32,
            torch.get_default_dtype(), torch.is_grad_enabled(),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny CPU run, started from a user's unusual global state (float32 matmul precision
    "medium", float64 default dtype), the state after it, and its files."""
    out = tmp_path_factory.mktemp("gpu_check")
    saved = GlobalState.save()
    try:
        torch.set_float32_matmul_precision("medium")
        torch.set_default_dtype(torch.float64)
        before = _state() + (torch.get_float32_matmul_precision(),)
        status = main(["--device", "cpu", "--tiny", "--gpu", "h100", "--out", str(out)])
        after = _state() + (torch.get_float32_matmul_precision(),)
    finally:
        saved.restore()
    results = json.loads((out / "gpu_check.json").read_text())
    return {"status": status, "results": results, "markdown": (out / "gpu_check.md").read_text(),
            "before": before, "after": after}


@pytest.mark.slow
def test_global_settings_are_restored(tiny_run):
    assert tiny_run["status"] == 0
    before = tiny_run["before"]
    assert before[-1] == "medium"  # the state the run started from
    assert before[1] is True  # "medium" allows TF32 for CUDA matmuls
    assert before[2] == torch.float64
    assert tiny_run["after"] == before


def test_settings_set_with_the_new_api_are_restored():
    """A user who set the per-backend precision (the new API) gets it back: the legacy read
    would raise here, so only the per-backend values tell."""
    saved = GlobalState.save()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.fp32_precision = "ieee"
        before = _state()
        with matmul_precision("highest"):
            assert matmul.snapshot()["cuda.matmul"] == "ieee"
        with matmul_precision("high"):
            assert matmul.snapshot()["cuda.matmul"] == "tf32"
        assert _state() == before
    finally:
        saved.restore()


@pytest.mark.slow
def test_json_has_every_part(tiny_run):
    r = tiny_run["results"]
    assert r["schema"] == "ampscope.gpu_check/1"
    assert set(report.PARTS) <= set(r)
    assert r["device"]["device_type"] == "cpu" and r["device"]["torch"] == torch.__version__
    assert r["accelerator"]["name"] == "h100" and r["accelerator"]["chosen"] == "--gpu h100"
    # Every shape in every mode, each with its FLOPs: 2·M·K·N.
    assert [(m["mode"], m["name"]) for m in r["matmuls"]] == [
        (mode, name) for mode, *_ in measure.MATMUL_MODES for name, *_ in measure.MATMULS]
    for row in r["matmuls"]:
        assert row["flops"] == 2 * row["m"] * row["k"] * row["n"]
        assert row["seconds"] > 0 and row["tflops"] == pytest.approx(
            row["flops"] / row["seconds"] / 1e12)
    lm_head = next(m for m in r["matmuls"] if m["name"] == "gpt2 lm_head")
    assert (lm_head["m"], lm_head["k"], lm_head["n"]) == (16384 // 256, 768 // 64, 50257 // 64)
    # A copy reads and writes N bytes; an add reads 2N and writes N (N: 4 MiB of float32).
    n = 4 * 2**20
    assert [(b["name"], b["bytes"]) for b in r["bandwidth"]] == [("copy", 2 * n), ("add", 3 * n)]
    # Each kernel in bf16 and fp32, forward and with backward; the CPU runs flash, math and the
    # hand-written form, and says why it skipped the others.
    attention = {(a["name"], a["dtype"], a["direction"]): a for a in r["attention"]}
    assert len(attention) == 5 * 2 * 2
    b, h, t, d = measure.TINY_ATTENTION
    for (name, _, direction), row in attention.items():
        assert row["flops"] == 4 * b * h * t * t * d * (3 if direction == "forward+backward" else 1)
        if name in ("math", "handwritten"):
            assert row["seconds"] > 0
        if name == "cudnn":
            assert row["seconds"] is None and row["skipped"]
    assert [s["setting"] for s in r["steps"]] == list(steps.SETTINGS)
    for row in r["steps"]:
        assert (row["model"], row["batch"], row["seq"]) == ("gpt2-tiny", 2, 16)
        assert row["tokens"] == 32 and row["seconds"] > 0
        assert row["min_seconds"] <= row["seconds"] <= row["max_seconds"]
        # The CPU has no allocator counters: n/a, never a made-up zero.
        assert row["first_step_peak"] == {"allocated": None, "reserved": None}


@pytest.mark.slow
def test_predicted_peaks_and_ratios(tiny_run):
    r = tiny_run["results"]
    by = {s["setting"]: s for s in r["steps"]}
    # At AdamW's step an fp32 model holds its weights, gradients and two moments, 4 bytes each.
    fp32 = by["fp32"]["predicted"]["allocated"]
    assert fp32 >= 4 * 4 * TINY_GPT2_PARAMETERS
    # bf16 parameters (and so gradients and moments) halve those four; activations shrink too.
    bf16 = by["bf16"]["predicted"]["allocated"]
    assert 4 * 2 * TINY_GPT2_PARAMETERS <= bf16 < fp32
    for row in r["steps"]:
        assert row["ratio"]["allocated"] is None  # nothing measured on the CPU
        assert row["predicted"]["seconds"] > 0
        assert row["ratio"]["seconds"] == row["seconds"] / row["predicted"]["seconds"]
        assert sum(row["predicted"]["by_phase"].values()) == pytest.approx(
            row["predicted"]["seconds"])
    h100 = hardware.by_name("h100")
    figures = kernels.params(h100)
    itemsize = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
    mode = {"fp32": "float32", "tf32": "tf32", "bf16": "bfloat16", "fp16": "float16"}
    for row in r["matmuls"]:
        assert row["peak_tflops"] == h100.peak_flops[mode[row["mode"]]] / 1e12
        assert row["of_peak"] == pytest.approx(row["tflops"] / row["peak_tflops"])
        # The GEMM kernel as the step-time model costs it: compute (tiles, waves) or the bytes
        # of both operands and the result, whichever is longer.
        m, k, n = row["m"], row["k"], row["n"]
        nbytes = (m * k + k * n + m * n) * itemsize[row["mode"]]
        assert row["predicted"]["memory_seconds"] == nbytes / (
            h100.bandwidth_bytes_per_s * figures["bandwidth"])
        assert row["predicted"]["compute_seconds"] == op_time.matmul_seconds(
            m, n, k, mode[row["mode"]], h100, figures)
        assert row["predicted"]["seconds"] == max(row["predicted"]["compute_seconds"],
                                                  row["predicted"]["memory_seconds"])
        assert row["ratio"]["seconds"] == row["seconds"] / row["predicted"]["seconds"]
    for row in r["bandwidth"]:
        assert row["of_peak"] == pytest.approx(row["bytes_per_s"] / h100.bandwidth_bytes_per_s)
        assert row["predicted"]["seconds"] == row["bytes"] / (
            h100.bandwidth_bytes_per_s * figures["bandwidth"])
    for row in r["attention"]:
        if row["seconds"] is None:
            assert "predicted" not in row  # nothing measured, nothing to compare
            continue
        assert row["ratio"]["seconds"] == row["seconds"] / row["predicted"]["seconds"]
        if row["name"] == "flash":  # the traced module ran the kernel the measured one did
            assert row["predicted"]["ops"] and all("flash" in op for op in row["predicted"]["ops"])
    assert r["not_predicted"] == []


def test_no_accelerator_no_time_predictions():
    """On a device the table lacks, without --gpu: no peaks and no predicted times, said once."""
    results = {"device": {"name": "x86_64", "device_type": "cpu"},
               "matmuls": [{"name": "gpt2 c_attn", "mode": "fp32", "m": 8, "k": 8, "n": 8,
                            "seconds": 1.0, "tflops": 1e-12}],
               "bandwidth": [], "attention": [], "steps": []}
    predict.predictions(results, None, Box("predictions", 60))
    assert results["accelerator"] == {"name": None, "title": None,
                                      "chosen": "no entry of ampscope's table matches 'x86_64'"}
    assert results["not_predicted"][0] == (
        "time: no entry of ampscope's table matches 'x86_64' (give one with --gpu NAME); the "
        "predicted time columns and the table's peaks are left out")
    assert set(results["matmuls"][0]) == {"name", "mode", "m", "k", "n", "seconds", "tflops"}


def test_ratio_is_measured_over_predicted():
    assert predict.ratio(3.0, 2.0) == 1.5
    assert predict.ratio(None, 2.0) is None
    assert predict.ratio(3.0, None) is None
    assert predict.ratio(3.0, 0.0) is None


def test_table_leaves_out_an_empty_prediction_column():
    columns = [("item", lambda r: r["name"], False),
               ("measured", lambda r: report._num(r.get("m")), False),
               ("predicted", lambda r: report._num(r.get("p")), True)]
    text = report.table(columns, [{"name": "a", "m": 1.0}, {"name": "b"}])
    assert text.splitlines() == ["| item | measured |", "|---|---:|", "| a | 1.00 |",
                                 "| b | n/a |"]
    text = report.table(columns, [{"name": "a", "m": 1.0, "p": 0.5}, {"name": "b"}])
    assert text.splitlines()[0] == "| item | measured | predicted |"
    assert text.splitlines()[3] == "| b | n/a | n/a |"


@pytest.mark.slow
def test_markdown_renders(tiny_run):
    md, r = tiny_run["markdown"], tiny_run["results"]
    assert md == report.markdown(r)
    assert "Device: **" in md and "tiny shapes" in md
    h100 = hardware.by_name("h100")
    assert (f"\nThe table's h100: {h100.multiprocessors} SMs (this device: n/a), "
            f"{h100.bandwidth_bytes_per_s / 1e12:.2f} TB/s.\n") in md
    for header in ("**Matmuls**", "**Memory bandwidth**", "**Attention**", "**Training step**"):
        assert header in md
    rows = [line for line in md.splitlines() if line.startswith("| gpt2 lm_head")]
    assert len(rows) == 4  # one a mode
    tf32 = next(line for line in rows if "| tf32 |" in line)
    assert r["matmuls"][16]["name"] == "gpt2 lm_head" and r["matmuls"][16]["mode"] == "tf32"
    assert tf32.endswith(f"| {r['matmuls'][16]['of_peak']:.0%} |")
    step_rows = [line for line in md.splitlines() if line.startswith("| gpt2-tiny 2×16")]
    assert len(step_rows) == 4
    header = next(line for line in md.splitlines() if line.startswith("| model |"))
    assert "ratio (allocated)" not in header  # no measured allocation on the CPU: left out
    assert "| predicted ms | ratio (time) |" in header and "predicted allocated" in header


def test_update_docs_rewrites_only_its_section(tmp_path):
    results = {"device": {"name": "NVIDIA H200", "device_type": "cuda", "multiprocessors": 132,
                          "memory_bytes": 150_754_820_096, "torch": "2.11.0", "cuda": "13.0"},
               "accelerator": {"name": "h200", "title": "NVIDIA H200", "chosen": "matched"},
               "matmuls": [], "bandwidth": [], "attention": [], "steps": []}
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\n## Method\n\nthe model.\n\n## Measured on a GPU\n\nold\n\n"
                   "## Later\n\nkept\n")
    report.update_docs(results, doc)
    text = doc.read_text()
    assert text.startswith("# Performance\n\n## Method\n\nthe model.\n\n## Measured on a GPU\n")
    assert "old" not in text and "NVIDIA H200** (132 SMs, 140.40 GiB)" in text
    assert text.endswith("\n## Later\n\nkept\n")
    report.update_docs(results, doc)
    assert doc.read_text() == text  # rewriting is idempotent
    # A page without the section gets it appended; a missing page is made with it alone.
    other = tmp_path / "other.md"
    other.write_text("# Performance\n\n## Method\n\nthe model.\n")
    report.update_docs(results, other)
    assert other.read_text() == "# Performance\n\n## Method\n\nthe model.\n\n" + report.section(results)
    missing = tmp_path / "missing.md"
    report.update_docs(results, missing)
    assert missing.read_text() == report.section(results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_2_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools"), OUT=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "gpu_check"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"gpu_check: no CUDA device here (torch {torch.__version__}); run it on a machine with an "
        "NVIDIA GPU, or pass --device cpu --tiny to check the plumbing"]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_settings_are_the_built_in_ones():
    for name in steps.SETTINGS:
        setting = ampscope.parse_setting(name)
        assert setting.name == name
    assert ampscope.parse_setting("fp32+tf32").matmul_precision == "high"


def test_docs_section_is_what_the_check_writes():
    """docs/performance.md ends with the section `--update-docs` writes: from the results kept in
    benchmarks/gpu/ where a GPU run left them, else the paragraph that says there are none."""
    kept = ROOT / "benchmarks" / "gpu" / "gpu_check.json"
    results = json.loads(kept.read_text()) if kept.exists() else None
    text = (ROOT / "docs" / "performance.md").read_text()
    assert text.endswith("\n\n" + report.section(results))


def test_update_docs_from_the_command_line(tmp_path, capsys):
    results = {"device": {"name": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "torch": "2.9.0",
                          "multiprocessors": 132, "memory_bytes": 85_520_809_984, "cuda": "12.8"},
               "matmuls": [], "bandwidth": [], "attention": [],
               "steps": [{"setting": "bf16", "model": "gpt2", "batch": 16, "seq": 1024,
                          "seconds": 0.25, "first_step_peak": {"allocated": 3 * 2**30,
                                                               "reserved": 4 * 2**30},
                          "steady_peak": {"allocated": None, "reserved": None},
                          "predicted": {"seconds": 0.2, "allocated": 2 * 2**30,
                                        "allocated_rounded": None, "reserved": None},
                          "ratio": {"seconds": 1.25, "allocated": 1.5, "reserved": None}}]}
    (tmp_path / "r.json").write_text(json.dumps(results))
    doc = tmp_path / "p.md"
    assert main(["--update-docs", str(tmp_path / "r.json"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text == report.section(results)
    row = next(line for line in text.splitlines() if line.startswith("| gpt2 16×1024"))
    # measured, predicted, ratio; the reserved prediction column is absent (None everywhere).
    assert row == ("| gpt2 16×1024 | bf16 | 250.000 | 200.0 | 1.25 | 3.00 GiB | 2.00 GiB | 1.50 | "
                   "4.00 GiB | n/a |")
    assert "predicted reserved" not in text
    assert capsys.readouterr().out.startswith("gpu_check: rewrote '## Measured on a GPU'")


def test_a_failed_part_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch, capsys):
    """One part raising costs that part only: the files are written after each part (a run
    killed at its time limit keeps what it measured), the error is in them, and the status is 1."""
    seen = []

    def matmuls(device, box, *, tiny):
        return [{"name": "gpt2 c_attn", "mode": "bf16", "m": 8, "k": 8, "n": 8, "flops": 1024,
                 "seconds": 1e-3, "tflops": 1.024e-9}]

    def bandwidth(device, box, *, tiny):
        raise RuntimeError("boom\nsecond line")

    def attention(device, box, *, tiny):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text()))
        return []

    monkeypatch.setattr(measure, "matmuls", matmuls)
    monkeypatch.setattr(measure, "bandwidth", bandwidth)
    monkeypatch.setattr(measure, "attention", attention)
    monkeypatch.setattr(steps, "training_steps", lambda device, box, *, tiny: [])
    assert main(["--device", "cpu", "--tiny", "--gpu", "h100", "--out", str(tmp_path)]) == 1
    # What attention found written when it started: the matmuls, and bandwidth's failure.
    assert seen[0]["matmuls"][0]["seconds"] == 1e-3
    assert seen[0]["bandwidth"] == [] and seen[0]["errors"] == ["bandwidth: RuntimeError: boom"]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["errors"] == ["bandwidth: RuntimeError: boom"]
    assert results["matmuls"][0]["predicted"]["seconds"] > 0  # the predictions still ran
    assert "\nFailed: bandwidth: RuntimeError: boom\n" in (tmp_path / "gpu_check.md").read_text()
    assert "bandwidth failed: RuntimeError: boom" in capsys.readouterr().err


@pytest.mark.slow
def test_a_cuda_step_gets_its_reserved_peak_and_ratios():
    """A cuda setting's step (predicted here on fake tensors, the CUDA device emulated): the
    allocated peak with CUDA's 512-byte block rounding and the replayed reserved peak, whole
    segments (2 MiB small ones, 20 MiB or 2 MiB-rounded large ones), beside given measured
    figures, ratios measured / predicted."""
    measured = {"allocated": 5 * 2**20, "reserved": 8 * 2**20}
    rows = [{"setting": "fp32", "model": "gpt2-tiny", "batch": 2, "seq": 16, "seconds": 0.01,
             "first_step_peak": measured}]
    predict.training_steps(rows, "cuda", hardware.by_name("h100"), Box("predictions", 60))
    p, ratio = rows[0]["predicted"], rows[0]["ratio"]
    assert p["allocated_rounded"] % 512 == 0 and p["allocated_rounded"] >= p["allocated"]
    assert p["reserved"] % (2 * 2**20) == 0 and p["reserved"] >= p["allocated_rounded"]
    assert p["allocated"] >= 4 * 4 * TINY_GPT2_PARAMETERS  # weights, grads, AdamW's 2 moments
    assert ratio["allocated"] == measured["allocated"] / p["allocated_rounded"]
    assert ratio["reserved"] == measured["reserved"] / p["reserved"]
    assert ratio["seconds"] == 0.01 / p["seconds"]
    assert set(p["by_bound"]) == {"compute", "memory", "launch", "communication"}


def test_first_step_allocated_peak_counts_as_the_prediction_does(monkeypatch):
    """The step's own allocations on top of the weights and the batch: what other parts left
    allocated before it (cuBLAS workspaces) is taken out, the raw counters kept."""
    monkeypatch.setattr(steps, "_peaks", lambda device: {"allocated": 500, "reserved": 800})
    peaks = steps._first_step_peaks(torch.device("cuda"), (100, 200), 30)
    assert peaks == {"allocated": 500 - 100 + 30, "reserved": 800, "raw_allocated": 500,
                     "allocated_before": 100, "reserved_before": 200, "weights_and_batch": 30}
    monkeypatch.setattr(steps, "_peaks", lambda device: {"allocated": None, "reserved": None})
    assert steps._first_step_peaks(torch.device("cpu"), (0, 0), 30) == {"allocated": None,
                                                                        "reserved": None}


def test_storage_bytes_count_a_shared_storage_once():
    base = torch.zeros(4, 8)
    assert steps._storage_bytes([base, base[1:], base.view(-1), torch.zeros(3)]) == 4 * 32 + 4 * 3
