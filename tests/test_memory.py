"""Memory of a step, from its storages: capture on tiny models, analysis on hand-built records,
the renderer against saved output. Every expected figure is derived by hand in its test.

Regenerate the golden output after an intended change with
`AMPSCOPE_UPDATE_GOLDEN=1 pytest tests/test_memory.py` and read the diff.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

import ampscope
from ampscope.analysis.memory import (
    cuda_block_size,
    live_at,
    live_bytes,
    memory_report,
)
from ampscope.analysis.summary import itemsize, numel
from ampscope.records import ModelInfo, OpCall, ParameterRecord, StorageRecord, TensorMeta, Trace
from ampscope.render.memory import render_memory
from tests.helpers import check, setting_record


def _bytes(trace: Trace, *categories: str) -> int:
    return sum(s.nbytes for s in trace.storages if s.category in categories)


def _param_bytes(trace: Trace) -> int:
    """Σ numel × element size over the parameters, each storage once (ParameterRecords list
    a tied weight once, under its first name)."""
    return sum(numel(p.shape) * itemsize(p.dtype) for p in trace.parameters)


@pytest.fixture(scope="module")
def gpt2_train():
    return ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", workload="train", batch=2, seq=8)


# -- capture on tiny models -------------------------------------------------------------------

def test_adamw_state_is_twice_the_fp32_parameter_bytes_plus_its_step_counters(gpt2_train):
    """AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (float32 here: 2 × the
    parameter bytes) and a `step` counter per parameter tensor: a 0-dim float32 tensor, 4 B."""
    params = _param_bytes(gpt2_train)
    steps = [s for s in gpt2_train.storages if s.category == "optimizer_state" and s.shape == ()]
    assert {s.names[0].rsplit(":", 1)[1] for s in steps} == {"step"}
    assert len(steps) == len(gpt2_train.parameters) == 28
    assert _bytes(gpt2_train, "optimizer_state") == 2 * params + 4 * len(steps)


def test_parameter_bytes_are_counted_per_storage_and_gradients_match_them(gpt2_train):
    assert _bytes(gpt2_train, "parameter") == _param_bytes(gpt2_train) == 547_840
    # fp32 parameters get fp32 gradients, one per storage.
    assert _bytes(gpt2_train, "gradient") == _param_bytes(gpt2_train)
    assert all(p.grad_dtype == "float32" for p in gpt2_train.parameters)


def test_tied_weights_are_one_storage_counted_once(gpt2_train):
    tied = [s for s in gpt2_train.storages if "lm_head.weight" in s.names]
    assert len(tied) == 1
    wte = tied[0]
    assert (wte.category, wte.names, wte.nbytes) == (
        "parameter", ("transformer.wte.weight", "lm_head.weight"), 512 * 64 * 4)
    # 28 parameter tensors, 29 names: one storage each for the 28.
    assert sum(s.category == "parameter" for s in gpt2_train.storages) == 28
    report = memory_report(gpt2_train)
    assert [s.names for s in report.shared] == [("transformer.wte.weight", "lm_head.weight")]
    by_name = next(e for e in report.estimates
                   if e.label == "numel × element size per parameter name")
    assert by_name.bytes - by_name.counted == wte.nbytes  # what counting names adds


def test_a_transpose_is_no_new_storage_and_its_contiguous_copy_is():
    model = nn.Linear(6, 4, bias=False)
    with ampscope.capture(model) as t:
        w_t = model.weight.t()  # a view: the weight's storage
        copy = w_t.contiguous()  # a copy in the transposed layout: 6×4 float32, 96 B
        flat = copy.view(-1)  # a view of the copy
        del copy, flat, w_t
    ops = [o.op for o in t.ops]
    assert ops == ["aten.t.default", "aten.clone.default", "aten.view.default"]
    weight, made = t.storages
    assert (weight.category, weight.names, weight.created, weight.nbytes) == (
        "parameter", ("weight",), None, 96)
    # The clone made one storage; `del` freed it after the last op, the view.
    assert (made.op, made.created, made.freed, made.nbytes, made.shape) == (
        "aten.clone.default", 1, 2, 96, (6, 4))


def test_a_storage_bigger_than_its_tensor_counts_whole():
    """A slice keeps its base's storage alive: the bytes are the storage's, not numel × size."""
    model = nn.Linear(2, 2)
    with ampscope.capture(model) as t:
        base = torch.zeros(10)
        part = base[:2]
        del base
        model(part)
    zeros = next(s for s in t.storages if s.op == "aten.zeros.default")
    assert zeros.nbytes == 40 and zeros.freed is None  # alive through `part`
    assert next(s for s in t.storages if s.category == "input").names == ("input",)


def test_a_two_layer_mlp_peaks_where_relu_backward_runs():
    """Hand-derived timeline of forward, backward and SGD for x (3, 4) → Linear(4, 8) → ReLU →
    Linear(8, 2) → sum, no biases, float32:

    before the step: W1 8×4 (128 B) + W2 2×8 (64 B) + x 3×4 (48 B) = 240 B.
    forward: mm → h (96 B); relu → r (96 B, saved for ReluBackward), then h is dropped (nobody
    saved it: mm saves its inputs); mm → out (24 B); sum → loss (4 B), then out is dropped.
    backward: the seed ones_like(loss) (4 B, held by the graph root to the end); MmBackward of
    the second layer makes W2's gradient (gᵀ·r, 2×8 = 64 B: W2's own layout, so AccumulateGrad
    keeps it rather than copying) and then dL/dr (96 B); ReluBackward's threshold_backward
    makes dL/dh (96 B) while r and dL/dr are still held — the peak:
        240 + loss 4 + seed 4 + dW2 64 + r 96 + dL/dr 96 + dL/dh 96 = 600 B.
    Then r and dL/dr go (408 B), W1's gradient is made (128 B: 536 B), dL/dh goes, the seed
    goes; SGD without momentum updates in place (`add_`): nothing new. 436 B at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2, bias=False))
    x = torch.randn(3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampscope.capture(model) as t:
        loss = model(x).sum()
        loss.backward()
        opt.step()
    report = memory_report(t)
    assert report.before_bytes == 240
    assert (report.peak.bytes, report.peak.op_name, report.peak.phase, report.peak.module) == (
        600, "aten.threshold_backward.default", "backward", "1")
    assert report.end_bytes == 436 and max(report.live_bytes) == 600
    relu_out = next(s for s in t.storages if s.op == "aten.relu.default")
    assert (relu_out.category, relu_out.saved, relu_out.nbytes) == ("activation", True, 96)
    assert relu_out.freed == report.peak.op  # released once ReluBackward ran
    grads = sorted(s.nbytes for s in t.storages if s.category == "gradient")
    assert grads == [64, 128]
    assert not [s for s in t.storages if s.phase == "optimizer"]  # in place: no new storage


def test_autocast_casts_are_their_own_category_and_weight_casts_are_saved(gpt2_train):
    casts = [s for s in gpt2_train.storages if s.category == "autocast_cast"]
    assert casts and all(gpt2_train.ops[s.created].autocast_cast for s in casts)
    weight_casts = [s for s in casts if any(gpt2_train.ops[s.created].input_names)]
    # The bf16 copies of the Linear weights are saved for backward by the matmuls.
    assert weight_casts and any(s.saved for s in weight_casts)
    assert {s.dtype for s in weight_casts} == {"bfloat16"}


@pytest.mark.fast
def test_a_forward_pass_saves_nothing_and_makes_no_gradient():
    t = ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", workload="forward", seq=8)
    categories = {s.category for s in t.storages}
    assert not categories & {"gradient", "optimizer_state", "activation"}
    logits = next(s for s in t.storages if s.category == "output")
    assert logits.names == ("logits",) and logits.freed is None
    report = memory_report(t)
    assert [e.label for e in report.estimates] == ["parameters only",
                                                   "numel × element size per parameter name"]


def _storages(trace: Trace) -> list[tuple]:
    return [(s.nbytes, s.dtype, s.shape, s.created, s.freed, s.category, s.names, s.module,
             s.phase, s.op, s.saved) for s in trace.storages]


@pytest.mark.parametrize("model", ["gpt2-tiny", "nanochat-tiny"])
@pytest.mark.parametrize("setting", ["fp32+amp-bf16", "cuda:fp32+amp-bf16"])
def test_predicted_storages_and_peak_equal_the_real_ones(model, setting):
    real = ampscope.trace(model, setting=setting, workload="train", batch=2, seq=8, predict=False)
    predicted = ampscope.trace(model, setting=setting, workload="train", batch=2, seq=8,
                               predict=True)
    assert _storages(predicted) == _storages(real)
    assert memory_report(predicted).peak == memory_report(real).peak
    assert len(real.storages) > 100


def test_storages_survive_the_json_round_trip(gpt2_train):
    back = Trace.from_dict(gpt2_train.to_dict())
    assert back.storages == gpt2_train.storages
    old = gpt2_train.to_dict()
    del old["storages"]  # a document written before storages were recorded
    assert Trace.from_dict(old).storages == []


def test_the_report_names_its_schema(gpt2_train):
    d = memory_report(gpt2_train).to_dict()
    assert d["schema"] == "ampscope.memory/1"
    assert d["peak"]["bytes"] == max(d["timeline"]["live_bytes"])
    assert d["rounding"] is None  # a CPU run: no CUDA allocator


# -- analysis on hand-built records -----------------------------------------------------------

def test_cuda_blocks_are_multiples_of_512_bytes():
    assert [cuda_block_size(n) for n in (0, 1, 4, 511, 512, 513, 1024, 1025)] == [
        0, 512, 512, 512, 512, 1024, 1024, 1536]
    assert cuda_block_size(2**20 + 1) == 2**20 + 512
    assert cuda_block_size(3 * 2**30) == 3 * 2**30  # a multiple already


F32 = TensorMeta("float32", (250,))


def toy_trace(device: str = "cuda") -> Trace:
    """Four ops; a weight (1000 B) and an input (100 B) before the step, an activation made by
    op 0 and freed after op 2, a 10-byte temporary of op 1, a gradient made by op 2."""
    op = OpCall
    ops = [op(0, "aten.mm.default", "fc", "forward", (F32,), (F32,), False, None, None, (None,)),
           op(1, "aten.relu.default", "act", "forward", (F32,), (F32,), False, None, None, (None,)),
           op(2, "aten.threshold_backward.default", "act", "backward", (F32,), (F32,), False,
              None, None, (None,), "ReluBackward0"),
           op(3, "aten.add_.Tensor", None, "optimizer", (F32,), (F32,), False, None, None,
              ("fc.weight",))]

    def storage(i, nbytes, dtype, created, freed, category, names=(), saved=False):
        o = ops[created] if created is not None else None
        return StorageRecord(i, nbytes, dtype, (nbytes // 4,), created, freed, category, names,
                             o.module if o else None, o.phase if o else None,
                             o.op if o else None, saved)

    return Trace(
        model=ModelInfo("toy", "Net", 250),
        setting=setting_record(f"{device}:fp32", device=device),
        workload="train", ops=ops,
        parameters=[ParameterRecord("fc.weight", "float32", (250,), True, "float32")],
        storages=[storage(0, 1000, "float32", None, None, "parameter", ("fc.weight",)),
                  storage(1, 100, "int64", None, None, "input", ("x",)),
                  storage(2, 600, "bfloat16", 0, 2, "activation", saved=True),
                  storage(3, 10, "float32", 1, 1, "temporary"),
                  storage(4, 1000, "float32", 2, None, "gradient", ("fc.weight.grad",))],
    )


def test_live_bytes_and_peak_of_hand_built_records():
    trace = toy_trace()
    before, live = live_bytes(trace.storages, len(trace.ops))
    # 1100 before; +600; +10; -10 (after op 1) +1000; -600 (after op 2)
    assert (before, live) == (1100, [1700, 1710, 2700, 2100])
    assert [s.id for s in live_at(trace.storages, 2)] == [0, 1, 2, 4]
    report = memory_report(trace)
    assert (report.peak.bytes, report.peak.op, report.peak.phase) == (2700, 2, "backward")
    # In 512-byte blocks: 1024 + 512 + 1024 (600 B) + 1024 = 3584 at op 2.
    assert (report.peak.rounded_bytes, report.peak.rounded_op) == (3584, 2)
    assert [(r.category, r.dtype, r.bytes, r.count) for r in report.at_peak] == [
        ("parameter", "float32", 1000, 1), ("input", "int64", 100, 1),
        ("gradient", "float32", 1000, 1), ("activation", "bfloat16", 600, 1)]
    assert sum(r.bytes for r in report.allocated) == 2710
    assert memory_report(toy_trace("cpu")).peak.rounded_bytes is None
    # The allocator replay: five small requests, one 2 MiB segment, reserved by the first
    # (before the step); its allocated peak is the rounded one above.
    r = report.reserved
    assert r is not None
    assert (r.reserved_peak, r.reserved_at, r.allocated_peak, r.allocated_at) == (
        2 * 2**20, None, 3584, 2)
    assert report.to_dict()["reserved"]["segment_count"] == 1
    assert memory_report(toy_trace("cpu")).reserved is None


def test_formulas_say_why_they_do_not_apply():
    estimates = {e.label: e for e in memory_report(toy_trace()).estimates}
    static = estimates["weights + gradients + optimizer state"]
    assert static.bytes == 250 * (4 + 4) and static.counted == 2000
    korthikanti = estimates["activations, Korthikanti et al. 2022"]
    assert korthikanti.bytes is None and "no scaled_dot_product_attention" in korthikanti.note
    assert korthikanti.counted == 600  # the saved activation, live as backward starts


def test_korthikanti_formula_from_the_attention_shapes(gpt2_train):
    """gpt2-tiny: 2 layers, batch 2, seq 8, 2 heads of 32 (h = 64): per layer
    s·b·h·(34 + 5·a·s/h) = 8·2·64·34 + 5·2·8²·2 = 34,816 + 1,280 bytes."""
    estimates = {e.label: e for e in memory_report(gpt2_train).estimates}
    full = estimates["activations, Korthikanti et al. 2022"]
    fused = estimates["activations, Korthikanti et al. 2022, fused attention"]
    assert full.bytes == 2 * (34_816 + 1_280) and fused.bytes == 2 * 34_816
    assert "L=2, s=8, b=2, h=64, a=2" in full.formula


@pytest.mark.fast
def test_memory_report_renders_as_saved():
    out = io.StringIO()
    Console(file=out, width=100, color_system=None, legacy_windows=False).print(
        render_memory(memory_report(toy_trace())))
    check("memory.txt", out.getvalue())


def test_memory_cli_json_and_measure_needs_a_real_device(capsys):
    from ampscope.cli import main

    code = main(["memory", "gpt2-tiny", "--seq", "8", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["schema"] == "ampscope.memory/1"
    assert data["peak"]["bytes"] == max(data["timeline"]["live_bytes"])
    assert data["measured"] is None
    if not torch.cuda.is_available():
        code = main(["memory", "gpt2-tiny", "--seq", "8", "--device", "cuda", "--measure"])
        err = capsys.readouterr().err
        assert code == 2 and "--measure needs a real CUDA device or the CPU" in err
        assert "runs emulated on cpu" in err


# The prediction misses a few 4-byte scalars the step makes outside the dispatcher (12 B on
# gpt2-tiny); the smallest tensor the model itself makes at seq 8 (a LayerNorm's per-token mean,
# 8 x 4 B = 32 B) is larger than this, so any activation the prediction missed would fail it.
CPU_PEAK_TOLERANCE = 16


def test_cpu_measure_replays_the_profilers_allocations_to_the_predicted_peak(capfd):
    """memory --measure on the CPU: the real step's peak, from the profiler's allocation and
    free events, agrees with the peak predicted on fake tensors to a few bytes."""
    import ampscope
    from ampscope.cli import main

    report = ampscope.memory("gpt2-tiny", setting="fp32", seq=8, measure=True)
    m = report.measured
    assert report.mode == "predict" and m is not None
    assert (m.device, m.source) == ("cpu", "torch.profiler memory events")
    assert abs(m.max_memory_allocated - report.peak.bytes) <= CPU_PEAK_TOLERANCE
    # the start holds the step's copies of the weights and the batch: the prediction's
    # bytes live before its first op, counted from the real storages
    assert m.allocated_before == report.before_bytes
    assert m.max_memory_allocated == m.allocated_before + m.raw_max_memory_allocated

    capfd.readouterr()
    code = main(["memory", "gpt2-tiny", "-s", "fp32", "--seq", "8", "--measure", "--json", "-"])
    out, err = capfd.readouterr()
    assert code == 0 and json.loads(out)["measured"] == dataclasses.asdict(m)
    assert "profiler" not in err  # kineto's start/stop lines on file descriptor 2 are silenced


def test_an_emulated_memory_report_says_so():
    import ampscope
    from ampscope.render.memory import render_memory

    report = ampscope.memory("gpt2-tiny", setting="cuda:fp32+amp-bf16", seq=8, predict=True)
    assert report.emulated and report.to_dict()["emulated"] is True
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(render_memory(report))
    assert "on cuda (emulated, predicted)" in out.getvalue().splitlines()[0]
    assert not ampscope.memory("gpt2-tiny", seq=8, predict=True).emulated


def test_reports_from_a_trace_equal_those_of_a_new_run():
    """memory(trace), flops(trace) and findings(trace) compute from the trace given, with
    nothing run again, and equal the reports of the model traced with the same options."""
    import ampscope

    t = ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", seq=16, predict=True)
    assert ampscope.memory(t).to_dict() == ampscope.memory(
        "gpt2-tiny", setting="fp32+amp-bf16", seq=16, predict=True).to_dict()
    assert ampscope.flops(t).to_dict() == ampscope.flops(
        "gpt2-tiny", setting="fp32+amp-bf16", seq=16, predict=True).to_dict()
    assert ampscope.findings(t) == t.findings
    back = ampscope.Trace.from_dict(t.to_dict())
    assert ampscope.findings(back) == t.findings
    assert ampscope.memory(back).to_dict() == ampscope.memory(t).to_dict()


def test_a_trace_refuses_options_that_would_change_its_run():
    import ampscope

    t = ampscope.trace("gpt2-tiny", seq=16, predict=True)
    with pytest.raises(ampscope.AmpscopeError, match="seq cannot apply to a Trace"):
        ampscope.memory(t, seq=32)
    with pytest.raises(ampscope.AmpscopeError, match="measure cannot apply"):
        ampscope.flops(t, measure=True)


def test_saved_tensors_unpacked_where_the_build_cannot_read_them_raw(monkeypatch):
    """Before torch 2.10 a SavedTensor has no `.data`: the saved tensors are unpacked to be read,
    and the storages marked saved are the same as when read raw."""
    from ampscope.torchcompat import autograd

    def saved(predict: bool) -> list[tuple]:
        t = ampscope.trace("gpt2-tiny", setting="fp32", workload="train", seq=8, predict=predict)
        return [(s.op, s.shape, s.dtype, s.nbytes) for s in t.storages if s.saved]

    raw = {p: saved(p) for p in (False, True)}
    monkeypatch.setattr(autograd, "_raw_data", lambda: False)
    assert {p: saved(p) for p in (False, True)} == raw
    assert len(raw[False]) > 20 and raw[False] == raw[True]
