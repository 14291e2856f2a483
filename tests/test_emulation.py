"""Emulated devices: the policy read from the build, the kernels that apply it on CPU tensors,
and what an emulated trace of a whole model shows.

The reference for "what CUDA does" here is the build's own AutocastCUDA kernels, run on fake
`cuda` tensors (forward only: autograd refuses CUDA tensors on a CPU-only build). A real-GPU
comparison lives in docs/emulation.md when a GPU was available.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import ampscope
from ampscope.errors import AmpscopeError
from ampscope.precision import GlobalState, parse_setting, resolve_device
from ampscope.precision.policy_history import applies, changes
from ampscope.runtime.autocast_policy import default_autocast_dtype, read_policy, registered_ops
from ampscope.runtime.emulation import (
    Emulation,
    TargetAutocast,
    TargetKernels,
    autocast_region,
    fused_on,
)
from ampscope.torchcompat.policy import has_kernel

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="emulation needs no CUDA")


# --- the policy read from the build ---------------------------------------------------------


def test_cuda_policy_read_from_the_build():
    policy = read_policy("cuda", torch.bfloat16)
    category = {name: rule.category for name, rule in policy.items()}
    for op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
               "aten::scaled_dot_product_attention", "aten::conv2d"):
        assert category[op] == "lower", op
    for op in ("aten::layer_norm", "aten::native_layer_norm", "aten::exp", "aten::log",
               "aten::mse_loss", "aten::rsqrt"):
        assert category[op] == "fp32", op
    # What changed between releases is in the history, each change with its release.
    for change in (c for c in changes() if c.device == "cuda"):
        here = category.get(change.op, "passthrough")
        assert here == (change.since if applies(change) else change.before), change
    for op in ("aten::softmax.int", "aten::log_softmax.int", "aten::sum", "aten::prod",
               "aten::cumsum"):
        assert category[op] == "fp32_set_opt_dtype", op
    assert policy["aten::norm.Scalar"].redirect == "aten::norm.ScalarOpt_dtype"
    for op in ("aten::addcmul", "aten::addcdiv", "aten::index_put", "aten::cross"):
        assert category[op] == "promote", op
    assert category["aten::binary_cross_entropy"] == "banned"
    assert "unsafe to autocast" in policy["aten::binary_cross_entropy"].message
    # mean, relu and cat are not CUDA autocast ops: they follow their inputs.
    assert not {"aten::mean", "aten::relu", "aten::cat"} & set(policy)
    assert "unclassified" not in category.values()


def test_cpu_policy_differs_where_the_issue_says():
    cpu = read_policy("cpu", torch.bfloat16)
    assert cpu["aten::cat"].category == "promote"  # CPU promotes cat; CUDA leaves it alone
    assert cpu["aten::mm"].category == "lower"
    for op in ("aten::softmax.int", "aten::layer_norm", "aten::exp", "aten::log", "aten::sum"):
        assert op not in cpu  # on CPU they follow the input


@pytest.mark.parametrize("op", ["aten::mm", "aten::bmm", "aten::cat", "aten::mse_loss",
                                "aten::stack", "aten::baddbmm"])
def test_cpu_policy_predicts_what_cpu_autocast_does(op):
    """The category probed on fake tensors says what a real CPU autocast call returns."""
    rule = read_policy("cpu", torch.bfloat16)[op]
    a32, b32 = torch.randn(2, 3, 3), torch.randn(2, 3, 3)
    call = {
        "aten::mm": lambda a, b: torch.mm(a[0], b[0]),
        "aten::bmm": torch.bmm,
        "aten::cat": lambda a, b: torch.cat([a, b]),
        "aten::stack": lambda a, b: torch.stack([a, b]),
        "aten::mse_loss": F.mse_loss,
        "aten::baddbmm": lambda a, b: torch.baddbmm(a, a, b),
    }[op]
    expected = {"lower": torch.bfloat16, "fp32": torch.float32, "promote": torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(a32.bfloat16(), b32)  # one low and one fp32 input
    assert out.dtype == expected[rule.category]


def test_default_autocast_dtypes_come_from_the_build():
    assert default_autocast_dtype("cuda") == torch.float16
    assert default_autocast_dtype("cpu") == torch.bfloat16


def test_a_device_without_an_autocast_policy_is_refused(monkeypatch):
    assert registered_ops("xla") == ()
    with pytest.raises(AmpscopeError, match="no autocast policy for 'xla'"):
        read_policy("xla", torch.bfloat16)
    from ampscope.precision import setting
    monkeypatch.setattr(setting, "registered_ops", lambda device: ())
    with pytest.raises(AmpscopeError, match="has no cuda autocast policy to emulate it with"):
        resolve_device(parse_setting("cuda:fp32+amp-bf16"))


# --- the emulated kernels against the build's AutocastCUDA kernels ---------------------------


class _Ops(TorchDispatchMode):
    """(op, in dtypes, out dtypes) of every aten op, below autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "prim":
            ins = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.ops.append((func.name(), tuple(t.dtype for t in ins),
                             tuple(t.dtype for t in outs if isinstance(t, torch.Tensor))))
        return out


FUNCTIONS = {
    "matmul": lambda x, w, b: x @ w,
    "linear": lambda x, w, b: F.linear(x, w, b),
    "softmax": lambda x, w, b: F.softmax(x, -1),
    "log_softmax": lambda x, w, b: x.log_softmax(-1),
    "layer_norm": lambda x, w, b: F.layer_norm(x, (4,), b, b),
    "rms_norm": lambda x, w, b: F.rms_norm(x, (4,)),
    "sum": lambda x, w, b: x.sum(),
    "mean": lambda x, w, b: x.mean(),
    "exp": lambda x, w, b: x.exp(),
    "relu": lambda x, w, b: F.relu(x),
    "norm": lambda x, w, b: torch.norm(x),
    "cumsum": lambda x, w, b: torch.cumsum(x, 0),
    "mse_loss": lambda x, w, b: F.mse_loss(x, w),
    "addcmul": lambda x, w, b: torch.addcmul(x, w, w),  # mixed dtypes when x is low
    "cat": lambda x, w, b: torch.cat([x, w]),
    # cross_entropy is on the CPU's fp32 list but not on CUDA's: there log_softmax keeps the
    # logits' dtype (cross_entropy passes it explicitly) and only nll_loss runs in fp32.
    "cross_entropy": lambda x, w, b: F.cross_entropy(x, torch.zeros(4, dtype=torch.long,
                                                                    device=x.device)),
}


def _on_fake_cuda(fn, x_dtype, dtype):
    """What the build's own CUDA autocast does: fake cuda tensors under AutocastCUDA."""
    state = GlobalState.save()
    try:
        with FakeTensorMode():
            x = torch.randn(4, 4, device="cuda").to(x_dtype)
            w = torch.randn(4, 4, device="cuda")
            b = torch.randn(4, device="cuda")
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", dtype)
            with _Ops() as seen:
                fn(x, w, b)
    finally:
        state.restore()
    return seen.ops


def _emulated(fn, x_dtype, dtype):
    x = torch.randn(4, 4).to(x_dtype)
    w = torch.randn(4, 4)
    b = torch.randn(4)
    with TargetKernels("cuda"), TargetAutocast("cuda", dtype), autocast_region(dtype), \
            _Ops() as seen:
        fn(x, w, b)
    return seen.ops


# fp16 softmax on CUDA runs _softmax(x, half_to_float=True) where any other device converts
# first: a device branch inside the op's own code, not autocast (docs/emulation.md).
KNOWN_OP_DIFFERENCES = {("softmax", torch.float16, torch.float16),
                        ("log_softmax", torch.float16, torch.float16)}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize(("x_dtype", "dtype"), [(torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16)])
def test_emulated_kernels_do_what_cuda_autocast_does(name, x_dtype, dtype):
    cuda = _on_fake_cuda(FUNCTIONS[name], x_dtype, dtype)
    emulated = _emulated(FUNCTIONS[name], x_dtype, dtype)
    assert emulated[-1][2] == cuda[-1][2]  # the result's dtype
    if (name, x_dtype, dtype) in KNOWN_OP_DIFFERENCES:
        assert cuda != emulated
    else:
        assert emulated == cuda  # op for op, with every dtype in and out


def test_fused_rms_norm_kernels_compute_what_the_composite_does():
    """The CPU kernels standing in for the device's fused RMSNorm: the forward is the op's own
    composite; the backward, derived by hand, equals autograd through that composite."""
    from ampscope.runtime.emulation import _fused_rms_norm, _fused_rms_norm_backward

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    g = torch.randn(3, 5, 8)
    y = F.rms_norm(x, (8,), w, 1e-6)  # the CPU's composite
    dx, dw = torch.autograd.grad(y, (x, w), g)
    out, rstd = _fused_rms_norm(x.detach(), [8], w.detach(), 1e-6)
    assert torch.allclose(out, y) and rstd.shape == (3, 5, 1) and rstd.dtype == torch.float32
    fused_dx, fused_dw = _fused_rms_norm_backward(g, x.detach(), [8], rstd, w.detach(),
                                                  [True, True])
    assert torch.allclose(fused_dx, dx, atol=1e-5) and torch.allclose(fused_dw, dw, atol=1e-5)
    assert _fused_rms_norm_backward(g, x.detach(), [8], rstd, None, [True, False])[1] is None


def test_emulated_rms_norm_calls_the_op_the_builds_device_kernel_is():
    """A CUDA build has a CUDA kernel for `_fused_rms_norm` and F.rms_norm on a CUDA tensor is
    that one op (forward and backward); a CPU build has none, and the op decomposes on both."""
    fused = set(fused_on("cuda"))
    builds_kernel = has_kernel("aten::_fused_rms_norm", "CUDA")
    assert ("aten::_fused_rms_norm" in fused) == builds_kernel
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    with TargetKernels("cuda"), _Ops() as seen:
        F.rms_norm(x, (8,), w).sum().backward()
    ran = {name for name, _, _ in seen.ops}
    assert ("aten::_fused_rms_norm" in ran) == builds_kernel
    assert ("aten::_fused_rms_norm_backward" in ran) == builds_kernel
    reference_x = x.detach().requires_grad_()
    reference_w = w.detach().requires_grad_()
    F.rms_norm(reference_x, (8,), reference_w).sum().backward()
    assert torch.allclose(x.grad, reference_x.grad, atol=1e-5)
    assert torch.allclose(w.grad, reference_w.grad, atol=1e-5)
    assert not has_kernel("aten::_fused_rms_norm", "CPU")  # PyTorch's own kernels are back


@pytest.mark.fast
def test_softmax_of_bf16_activations_is_fp32_on_cuda_and_bf16_on_cpu():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(x, -1).dtype == torch.bfloat16
    with TargetAutocast("cuda", torch.bfloat16), autocast_region(torch.bfloat16):
        assert F.softmax(x, -1).dtype == torch.float32
        assert x.sum().dtype == torch.float32
        assert x.mean().dtype == torch.bfloat16  # mean is not on CUDA's list


def test_weights_are_cast_once_per_autocast_region_as_cuda_caches_them():
    layer = nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8)

    def casts(regions: int) -> int:
        with TargetAutocast("cuda", torch.bfloat16), _Ops() as seen:
            for _ in range(regions):
                with autocast_region(torch.bfloat16):
                    layer(layer(x))  # the same weight twice; the second input is already bf16
        return sum(op == "aten::_to_copy" for op, _, _ in seen.ops)

    assert casts(1) == 2  # x, and the weight once (uncached it would be cast twice)
    assert casts(2) == 4  # the cache empties when the region ends


def test_emulation_restores_cpu_autocast_and_attention_also_after_an_error():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 4, 8)
    before = GlobalState.save()
    with pytest.raises(RuntimeError, match="boom"), Emulation("cuda", torch.bfloat16):
        raise RuntimeError("boom")
    after = GlobalState.save()
    assert (after.autocast, after.fp32_precision) == (before.autocast, before.fp32_precision)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(x, -1).dtype == torch.bfloat16  # PyTorch's own CPU kernel again
        assert torch.mm(x.float(), x.float().T).dtype == torch.bfloat16
    with _Ops() as seen:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert seen.ops[0][0] == "aten::_scaled_dot_product_flash_attention_for_cpu"


# --- whole models -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def opt_cuda():
    pytest.importorskip("transformers")
    return ampscope.trace("opt-125m", setting="cuda:fp32+amp-bf16", workload="train", seq=16)


def test_opt_on_emulated_cuda_shows_the_cuda_dtypes(opt_cuda):
    t = opt_cuda
    assert t.setting.emulated and t.setting.device == "cuda" and t.mode == "predict"
    forward = [m for m in t.modules if m.phase == "forward"]
    norms = [m for m in forward if m.type == "LayerNorm"]
    assert len(norms) == 12 * 2 + 1
    assert all(m.inputs[0].dtype == m.outputs[0].dtype == "float32" for m in norms)
    projections = [m for m in forward if m.name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")]
    assert len(projections) == 36
    assert all((m.inputs[0].dtype, m.outputs[0].dtype) == ("float32", "bfloat16")
               for m in projections)
    # The residual add of each decoder layer: bf16 branch + fp32 stream → fp32.
    residual = [o for o in t.ops if o.phase == "forward" and o.op == "aten.add.Tensor"
                and o.module and o.module.startswith("model.decoder.layers.")
                and o.module.count(".") == 3]
    assert len(residual) == 24
    assert all(sorted(m.dtype for m in o.inputs) == ["bfloat16", "float32"]
               and o.outputs[0].dtype == "float32" for o in residual)
    softmax = [o for o in t.ops if "softmax" in o.op and o.phase == "forward"]
    assert softmax and all(o.outputs[0].dtype == "float32" for o in softmax)
    # H100 with PyTorch 2.13's cuDNN picks cuDNN attention for bf16, forward and backward.
    assert sum(o.op == "aten._scaled_dot_product_cudnn_attention.default" for o in t.ops) == 12
    assert sum(o.op == "aten._scaled_dot_product_cudnn_attention_backward.default"
               for o in t.ops) == 12
    # The optimizer is the _foreach_ one PyTorch picks on CUDA.
    assert any(o.op.startswith("aten._foreach_") for o in t.ops if o.phase == "optimizer")
    assert any("Emulated cuda on the CPU" in n for n in t.notes)


def test_nanochat_keeps_its_embedding_in_bf16_on_emulated_cuda():
    cuda = ampscope.trace("nanochat-d4", setting="cuda:fp32+amp-bf16", workload="forward", seq=8)
    cpu = ampscope.trace("nanochat-d4", setting="fp32+amp-bf16", workload="forward", seq=8)

    def wte(t):
        param = next(p for p in t.parameters if p.name == "transformer.wte.weight")
        module = next(m for m in t.modules if m.name == "transformer.wte")
        return param.dtype, module.outputs[0].dtype

    assert wte(cuda) == ("bfloat16", "bfloat16")
    assert wte(cpu) == ("float32", "float32")


def test_model_code_that_asks_for_the_device_runs_on_the_virtual_device(tmp_path, monkeypatch):
    (tmp_path / "syncing.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        torch.cuda.synchronize()\n"
        "        assert x.is_cuda and self.lin.weight.device.type == 'cuda'\n"
        "        return self.lin(x.cuda())\n"
        "class Leaky(M):\n"
        "    def forward(self, x):\n"
        "        torch.cuda.ipc_collect()\n"
        "        return self.lin(x)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from syncing import Leaky, M

    def step(m, b):
        return m(next(iter(b.values())))

    t = ampscope.trace(M(), torch.randn(2, 4), setting="cuda:fp32+amp-bf16", workload=step)
    linear = next(m for m in t.modules if m.name == "lin")
    assert linear.outputs[0].dtype == "bfloat16"  # CUDA's autocast, on the virtual device
    assert any("synchronize() returned at once" in n for n in t.notes)
    assert any("saw cuda" in n for n in t.notes)
    # What is not virtual still stops the run with one line naming the call and the user's line.
    with pytest.raises(AmpscopeError) as e:
        ampscope.trace(Leaky(), torch.randn(2, 4), setting="cuda:fp32", workload=step)
    assert "syncing.py:13 needs torch.cuda.ipc_collect()" in str(e.value)


# --- norm statistics in the target's dtypes ----------------------------------------------------


def _layer_norm_args(dtype):
    x, w = torch.randn(2, 3, 4, dtype=dtype), torch.randn(4, dtype=dtype)
    return (x, [4], w, w, 1e-5)


def test_norm_statistics_dtypes_are_read_from_pytorchs_fake_implementations():
    from ampscope.runtime.norm_stats import target_dtypes

    aten = torch.ops.aten
    args = _layer_norm_args(torch.bfloat16)
    # The CPU answer agrees with the CPU kernel itself (a real call, the ground truth here).
    cpu_kernel = tuple(t.dtype for t in aten.native_layer_norm(*args))
    assert target_dtypes(aten.native_layer_norm.default, args, "cpu") == cpu_kernel \
        == (torch.bfloat16,) * 3
    for device in ("cuda", "mps"):  # mean and rstd stay fp32 on the GPUs
        assert target_dtypes(aten.native_layer_norm.default, args, device) == \
            (torch.bfloat16, torch.float32, torch.float32)
    x, c = torch.randn(2, 4, 3, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)
    batch_norm = (x, c, c, None, None, True, 0.1, 1e-5)
    assert target_dtypes(aten.native_batch_norm.default, batch_norm, "cpu") == \
        tuple(t.dtype for t in aten.native_batch_norm(*batch_norm))
    assert target_dtypes(aten.native_batch_norm.default, batch_norm, "cuda")[1:] == \
        (torch.float32, torch.float32)
    # group norm and fused rms norm keep the same dtypes on every device in this build
    group_norm = (x, c, c, 2, 4, 3, 2, 1e-5)
    assert target_dtypes(aten.native_group_norm.default, group_norm, "cuda") == \
        tuple(t.dtype for t in aten.native_group_norm(*group_norm))
    rms = (x, [3], None, 1e-5)
    assert target_dtypes(aten._fused_rms_norm.default, rms, "cuda") == \
        tuple(t.dtype for t in aten._fused_rms_norm(*rms))


@pytest.mark.parametrize("predict", [False, True])
def test_layer_norm_statistics_are_fp32_on_emulated_cuda_in_trace_backward_and_memory(predict):
    def layer_norms(setting):
        t = ampscope.trace("gpt2-tiny", setting=setting, workload="train", seq=8, predict=predict)
        forward = [o for o in t.ops if o.op == "aten.native_layer_norm.default"]
        backward = [o for o in t.ops if o.op == "aten.native_layer_norm_backward.default"]
        saved = [s for s in t.storages if s.saved and s.op == "aten.native_layer_norm.default"]
        return forward, backward, saved

    forward, backward, saved = layer_norms("cuda:bf16")
    assert len(forward) == len(backward) == 5  # 2 per block and ln_f
    assert all([m.dtype for m in o.outputs] == ["bfloat16", "float32", "float32"]
               for o in forward)
    assert all([m.dtype for m in o.inputs][2:4] == ["float32", "float32"] for o in backward)
    stats = [s for s in saved if s.shape == (1, 8, 1)]
    assert len(stats) == 10 and all(s.dtype == "float32" and s.nbytes == 8 * 4 for s in stats)
    forward, backward, saved = layer_norms("bf16")  # the CPU keeps them in bf16
    assert all([m.dtype for m in o.outputs] == ["bfloat16"] * 3 for o in forward)
    stats = [s for s in saved if s.shape == (1, 8, 1)]
    assert len(stats) == 10 and all(s.dtype == "bfloat16" and s.nbytes == 8 * 2 for s in stats)


def test_autocast_casts_of_q_and_k_are_counted_on_the_math_attention_path():
    """Falcon with multi-query attention passes a mask, so the emulated H100 runs SDPA's math
    path, which computes in fp32 and casts back; autocast's casts of the fp32 (rotary) q and k
    to bf16 before it are autocast's all the same."""
    transformers = pytest.importorskip("transformers")
    from ampscope.models.hf import build_from_config, hf_loaded_model

    config = transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       multi_query=True, new_decoder_architecture=False,
                                       vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = hf_loaded_model(build_from_config(config, device="cpu"), name="falcon-mqa")
    t = ampscope.trace(lm, setting="cuda:fp32+amp-bf16", workload="forward", seq=8)
    sdpa = {c.index for c in t.calls if c.func.endswith("scaled_dot_product_attention")}
    casts = [o for o in t.ops if o.caller in sdpa and o.op == "aten._to_copy.default"]
    autocast = [(o.inputs[0].dtype, o.outputs[0].dtype) for o in casts if o.autocast_cast]
    assert autocast == [("float32", "bfloat16")] * 4  # q and k, in each of the two layers
    own = [(o.inputs[0].dtype, o.outputs[0].dtype) for o in casts if not o.autocast_cast]
    assert ("bfloat16", "float32") in own and ("float32", "bfloat16") in own  # the math path's
    flagged = sum(o.autocast_cast for o in t.ops if o.phase == "forward")
    assert any(f.text.startswith(f"Autocast inserted {flagged} casts") for f in t.findings)
