"""FLOPs counted from the ops that ran, checked against counts derived by hand."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import ampscope
from ampscope.analysis.flops import flop_report
from ampscope.api import tokens_of
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.models import gpt2
from ampscope.runs import flops
from ampscope.runs.flops import _kept_fraction


def _linear_step(module, batch):
    out = module(batch["x"])
    out.sum().backward()


def _phase_flops(t, phase: str) -> int:
    return sum(o.flops for o in t.ops if o.phase == phase)


@pytest.mark.fast
def test_a_linear_layer_does_2mkn_forward_and_twice_that_backward():
    layer = nn.Linear(256, 64)
    x = torch.randn(1024, 256, requires_grad=True)
    t = ampscope.trace(layer, {"x": x}, workload=_linear_step)
    forward = _phase_flops(t, "forward")
    assert forward == 2 * 1024 * 256 * 64
    # grad of the input (1024×64 @ 64×256) and of the weight (64×1024 @ 1024×256)
    assert _phase_flops(t, "backward") == 2 * forward
    # An input that needs no gradient leaves only the weight's matmul.
    t = ampscope.trace(layer, {"x": x.detach()}, workload=_linear_step)
    assert _phase_flops(t, "backward") == forward


def test_gpt2_counted_training_flops_agree_with_estimate_flops_within_1_percent():
    B, T = 1, 256
    t = ampscope.trace("gpt2", setting="fp32", workload="train", batch=B, seq=T, predict=True)
    report = flop_report(t, tokens=tokens_of(t))
    estimate = gpt2.load("gpt2", device="meta").module.estimate_flops(T) * B * T
    assert report.tokens == B * T
    assert abs(report.total / estimate - 1) < 0.01
    # nanoGPT's convention computed from the traced shapes is the model's own estimate.
    nanogpt = next(c for c in report.conventions if c.name.startswith("nanoGPT 6N'"))
    assert nanogpt.flops == estimate
    assert (report.attention.layers, report.attention.heads, report.attention.head_dim,
            report.attention.seq) == (12, 12, 64, T)


def test_cpu_flash_attention_is_counted_and_causal_counts_the_kept_half():
    B, T = 2, 16
    t = ampscope.trace("gpt2-tiny", setting="fp32", workload="forward", batch=B, seq=T)
    attention = [o for o in t.ops if o.op == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    _, H, _, Q = attention[0].inputs[0].shape
    # scores q@kᵀ and weights@v: two B·H·T·T·Q multiply-adds, 2 FLOPs each
    assert all(o.flops == 4 * B * H * T * T * Q for o in attention)
    assert all(o.flops_causal == 4 * B * H * Q * T * (T + 1) // 2 for o in attention)


@pytest.mark.fast
def test_kept_fraction_of_a_causal_mask():
    assert _kept_fraction(4, 4) == (1 + 2 + 3 + 4) / 16
    assert _kept_fraction(1, 9) == 1 / 9  # a decoding step sees only its first key


def test_emulated_cuda_attention_kernels_are_counted_like_the_cpu_one():
    cpu = ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", workload="train", seq=16)
    cuda = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16", workload="train", seq=16)
    for phase in ("forward", "backward"):
        assert sum(o.flops for o in cpu.ops if o.phase == phase) == \
            sum(o.flops for o in cuda.ops if o.phase == phase)
    assert any("cudnn" in o.op and o.flops for o in cuda.ops)


def test_flops_by_dtype_follow_autocast():
    t = ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", workload="train", seq=16)
    report = flop_report(t, tokens=tokens_of(t))
    assert set(report.by_dtype) == {"bfloat16"}  # every matmul ran in bf16 under autocast
    assert sum(report.by_dtype.values()) == report.total


@pytest.mark.fast
def test_flops_cli_json(capsys):
    code = main(["flops", "gpt2-tiny", "--seq", "8", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["schema"] == "ampscope.flops/1"
    assert data["tokens"] == 8 and data["total"] == sum(data["by_phase"].values())
    assert [c["name"] for c in data["conventions"]][:3] == ["counted", "counted, causal", "6·N·D"]


@pytest.mark.fast
def test_measuring_an_emulated_device_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from ampscope.api import measure_step
    with pytest.raises(AmpscopeError, match="cannot time cuda:fp32 here"):
        measure_step("gpt2-tiny", setting="cuda:fp32")


def test_mfu_holds_each_dtype_to_its_own_peak():
    from ampscope import hardware
    from ampscope.analysis.flops import utilization

    t = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16", workload="train", seq=16)
    report = flop_report(t, tokens=tokens_of(t))
    h100 = hardware.by_name("h100")
    used = utilization(report, 0.001, h100)
    assert used.mfu == pytest.approx(report.by_dtype["bfloat16"] / 989e12 / 0.001)
    assert used.tokens_per_second == pytest.approx(16 / 0.001)
    # fp32 matmuls under TF32 ("high") are held to the TF32 peak, not the bf16 one.
    t32 = ampscope.trace("gpt2-tiny", setting="cuda:fp32+tf32", workload="train", seq=16)
    r32 = flop_report(t32, tokens=tokens_of(t32))
    assert utilization(r32, 0.001, h100, "high").mfu == pytest.approx(
        r32.by_dtype["float32"] / 495e12 / 0.001, rel=1e-3)


def test_flops_cli_with_a_step_time_shows_mfu(capsys):
    code = main(["flops", "gpt2-tiny", "--seq", "8", "--device", "cuda", "--step-time", "0.001",
                 "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["utilization"]["device"] == "NVIDIA H100 SXM5 80GB"
    assert data["utilization"]["mfu"] > 0


@pytest.mark.fast
def test_backward_flops_stay_with_the_module_before_an_identity_or_dropout():
    """nn.Identity and Dropout(p=0) return their input: the backward ops of the Linear before
    them are that Linear's (2·2·4·4 for its input's gradient plus as much for its weight's)."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.d, self.b, self.drop = (nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 4),
                                                 nn.Dropout(0.0))

        def forward(self, x):
            return self.drop(self.b(self.d(self.a(x))))

    def step(m, batch):
        m.train()
        m(batch["x"]).sum().backward()

    t = ampscope.trace(Net(), {"x": torch.randn(2, 4)}, workload=step)
    backward = {}
    for o in t.ops:
        if o.phase == "backward":
            backward[o.module] = backward.get(o.module, 0) + o.flops
    assert backward.get("b") == 2 * (2 * 2 * 4 * 4)
    assert backward.get("a") == 2 * 2 * 4 * 4  # x needs no gradient: the weight's only
    assert not backward.get("drop") and not backward.get("d")
    assert [m.name for m in t.modules if m.phase == "backward" and m.name in ("d", "drop")]


# --- grouped-query attention, on every release ------------------------------------------------


class _GroupedQueryAttention(nn.Module):
    def forward(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=True)


def _gqa_step(module, batch):
    module(batch["q"], batch["k"], batch["v"]).sum().backward()


@pytest.mark.fast
@pytest.mark.parametrize("setting", ["fp32", "cuda:fp32+amp-bf16"])
def test_grouped_query_attention_counts_every_query_head(setting):
    """4 query heads over 2 key/value heads: each query head multiplies its group's key and
    value heads, so q·kᵀ and P·v are 2·B·Hq·S·S·D FLOPs each (4·B·Hq·S·S·D forward). Backward
    recomputes q·kᵀ and makes the gradients of the scores, v, q and k: five such products
    (10·B·Hq·S·S·D). The causal mask keeps S·(S+1)/2 of the S·S scores."""
    B, Hq, Hkv, S, D = 1, 4, 2, 8, 16
    batch = {"q": torch.randn(B, Hq, S, D, requires_grad=True),
             "k": torch.randn(B, Hkv, S, D, requires_grad=True),
             "v": torch.randn(B, Hkv, S, D, requires_grad=True)}
    t = ampscope.trace(_GroupedQueryAttention(), batch, workload=_gqa_step, setting=setting)
    forward = [o for o in t.ops if o.phase == "forward" and o.flops]
    backward = [o for o in t.ops if o.phase == "backward" and o.flops]
    assert len(forward) == len(backward) == 1
    assert forward[0].flops == 4 * B * Hq * S * S * D == 16384
    assert backward[0].flops == 10 * B * Hq * S * S * D == 40960
    assert forward[0].flops_causal == 4 * B * Hq * D * S * (S + 1) // 2


@pytest.mark.fast
def test_own_attention_formulas_agree_with_torchs_where_torch_counts():
    """ampscope's attention formulas are torch's convention: equal head counts on every
    release, grouped-query shapes where torch counts them (it asserts on them before 2.12)."""
    from torch.utils import flop_counter

    from ampscope.runs.flops import _sdpa_backward, _sdpa_forward
    from ampscope.torchcompat import flops as torch_flops

    shapes = [((2, 4, 8, 16), (2, 4, 12, 16), (2, 4, 12, 32))]
    if torch_flops.counts_grouped_query_attention():
        shapes.append(((2, 8, 8, 16), (2, 2, 12, 16), (2, 2, 12, 16)))
    for q, k, v in shapes:
        assert _sdpa_forward(q, k, v) == flop_counter.sdpa_flop_count(q, k, v)
        grad_out = (*q[:3], v[-1])
        assert _sdpa_backward(q, k, v) == \
            flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


@pytest.mark.fast
def test_flop_formula_detection_reports_its_features():
    from ampscope.runs.flops import formula
    from ampscope.torchcompat import flops as torch_flops

    found = {f.name: f for f in torch_flops.features()}
    assert set(found) == {"flop formulas by shape", "torch's grouped-query attention FLOPs"}
    assert all(f.detail for f in found.values())
    # mm is counted from shapes on every release: cached where the wrapper is recognised,
    # counted on every call (the same count) where it is not.
    mm = formula(torch.ops.aten.mm.default)
    assert mm.by_shape == found["flop formulas by shape"].available
    assert formula(torch.ops.aten.add.Tensor) is None


# --- formulas registered with register_flop_formula -----------------------------------------

# A test-only formula for an underscored op torch has no formula for: torch.cdist's kernel,
# one multiply-add per pair of rows and feature.
_CDIST = "_cdist_forward"


def _cdist_flops(x1, x2, p, compute_mode=None, **kwargs) -> int:
    return 2 * x1.shape[0] * x2.shape[0] * x1.shape[1]


@pytest.mark.fast
def test_registering_a_formula_by_name_changes_the_count():
    x1, x2 = torch.randn(3, 4), torch.randn(5, 4)
    op = torch.ops.aten._cdist_forward.default
    args = (x1, x2, 2.0, None)
    out = op(*args)
    assert flops.op_flops(op, args, {}, out) == (0, 0)  # torch counts nothing for it
    flops.register_flop_formula(_CDIST)(_cdist_flops)
    try:
        assert flops.op_flops(op, args, {}, out) == (2 * 3 * 5 * 4,) * 2
        with pytest.raises(ValueError, match="already"):
            flops.register_flop_formula(_CDIST)(_cdist_flops)
    finally:
        flops.unregister_flop_formula(_CDIST)
    assert flops.op_flops(op, args, {}, out) == (0, 0)


def test_a_registered_formula_reaches_the_trace():
    """Registered at import, before anything ran (as ampscope's own are): the recorder
    counts the op. In a fresh interpreter, as the recorder keeps what it looked up per op."""
    code = textwrap.dedent(f"""
        import torch
        import ampscope
        from ampscope.runs.flops import register_flop_formula

        @register_flop_formula({_CDIST!r})
        def cdist_flops(x1, x2, p, compute_mode=None, **kwargs):
            return 2 * x1.shape[0] * x2.shape[0] * x1.shape[1]

        class Distances(torch.nn.Module):
            def forward(self, a, b):
                return torch.cdist(a, b)

        t = ampscope.trace(Distances(), {{"a": torch.randn(3, 4), "b": torch.randn(5, 4)}},
                           workload=lambda m, batch: m(batch["a"], batch["b"]), predict=False)
        print(sum(o.flops for o in t.ops))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(2 * 3 * 5 * 4)


@pytest.mark.fast
def test_ops_a_build_lacks_or_that_do_not_fit_are_skipped():
    def wrong_names(a, b, p, compute_mode=None, **kwargs) -> int:
        return 1

    flops.register_flop_formula("no_such_op_in_any_build", _CDIST)(wrong_names)
    try:
        skipped = flops.skipped()
        assert skipped["no_such_op_in_any_build"] == "not an op of this torch build"
        assert "argument 0 is 'x1'" in skipped[_CDIST]
        op = torch.ops.aten._cdist_forward.default
        assert flops.formula(op) is None  # nothing registered for it
    finally:
        flops.unregister_flop_formula("no_such_op_in_any_build", _CDIST)
    assert not {"no_such_op_in_any_build", _CDIST} & set(flops.skipped())


@pytest.mark.fast
def test_torchs_formula_counts_unless_the_registration_replaces_it():
    """mm has torch's formula (2·M·K·N): a formula of ampscope's for it counts only where its
    registration's `replaces_torch()` says so."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    op = torch.ops.aten.mm.default
    out = op(a, b)

    def one(self, mat2, *args, **kwargs) -> int:
        return 1

    for replaces, expected in ((lambda: False, 2 * 3 * 4 * 5), (lambda: True, 1)):
        flops.register_flop_formula(torch.ops.aten.mm, replaces_torch=replaces)(one)
        try:
            assert flops.op_flops(op, (a, b), {}, out) == (expected, expected)
        finally:
            flops.unregister_flop_formula(torch.ops.aten.mm)
    assert flops.op_flops(op, (a, b), {}, out) == (2 * 3 * 4 * 5,) * 2
