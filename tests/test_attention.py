"""SDPA backend choice (torch 2.13 rules) and running the chosen CUDA ops on CPU/fake tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from ampscope.runtime.attention_choice import (
    A100,
    H100,
    CudaTarget,
    SdpFlags,
    TensorSpec,
    choose_backend,
)
from ampscope.runtime.attention_kernels import cuda_attention

BF16 = torch.bfloat16
aten = torch.ops.aten


def spec(*shape, dtype=BF16, **kw) -> TensorSpec:
    return TensorSpec(shape, dtype, **kw)


def backend(*tensors, **kw) -> str:
    return choose_backend(*tensors, **kw).backend


class OpLog(TorchDispatchMode):
    """The aten ops that ran, with (shape, dtype, stride) of each output."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), [_layout(o) for o in outs]))
        return out

    def names(self, part: str = "scaled_dot_product") -> list[str]:
        return [name for name, _ in self.ops if part in name]


def _layout(x):
    return (tuple(x.shape), x.dtype, x.stride()) if isinstance(x, torch.Tensor) else x


def qkv(*shape, dtype=torch.float32, kv_heads=None, grad=True, seed=0):
    torch.manual_seed(seed)
    kv_shape = (shape[0], kv_heads or shape[1], *shape[2:])
    shapes = (shape, kv_shape, kv_shape)
    return tuple(torch.randn(s, dtype=dtype, requires_grad=grad) for s in shapes)


# -- the choice, from the rules of torch 2.13 ------------------------------------------------

@pytest.mark.fast
def test_h100_with_the_default_wheel_picks_cudnn():
    """torch 2.13.0 from PyPI ships cuDNN 9.20 (> 9.15.0): cuDNN goes first on sm90."""
    q = spec(2, 4, 16, 64)
    choice = choose_backend(q, q, q, is_causal=True)
    assert choice.backend == "cudnn"
    assert choice.forward_op == "aten._scaled_dot_product_cudnn_attention.default"
    assert choice.backward_op == "aten._scaled_dot_product_cudnn_attention_backward.default"
    assert choice.reasons == ()


@pytest.mark.parametrize("target, flags", [
    (A100, SdpFlags()),                                     # cuDNN is never first on sm80
    (CudaTarget(cudnn_version=91002), SdpFlags()),           # cu126/cu128 wheels: cuDNN 9.10.2
    (H100, SdpFlags(cudnn_deprioritized=True)),             # TORCH_CUDNN_SDPA_DEPRIORITIZED=1
    (H100, SdpFlags(cudnn=False)),
])
def test_bf16_causal_head_dim_64_is_flash_when_cudnn_is_not_first(target, flags):
    q = spec(2, 4, 16, 64)
    choice = choose_backend(q, q, q, is_causal=True, target=target, flags=flags)
    assert choice.backend == "flash"
    assert choice.forward_op == "aten._scaled_dot_product_flash_attention.default"
    assert choice.backward_op == "aten._scaled_dot_product_flash_attention_backward.default"


def test_runtime_disabled_cudnn_is_a_reason():
    q = spec(2, 4, 16, 64)
    reasons = choose_backend(q, q, q, flags=SdpFlags(cudnn=False)).reasons
    assert reasons == ("cudnn: cuDNN attention has been runtime disabled.",)


@pytest.mark.parametrize("target", [H100, A100])
def test_fp32_goes_to_efficient_because_flash_and_cudnn_need_half(target):
    q = spec(2, 4, 16, 64, dtype=torch.float32)
    choice = choose_backend(q, q, q, is_causal=True, target=target)
    assert choice.backend == "efficient"
    assert any(r.startswith("flash: expected query, key and value") for r in choice.reasons)


def test_a_float_mask_rules_out_flash():
    q, mask = spec(2, 4, 16, 64), spec(2, 1, 16, 16)
    choice = choose_backend(q, q, q, mask, target=A100)
    assert choice.backend == "efficient"
    assert choice.reasons == ("flash: Flash Attention does not support non-null attn_mask.",)
    assert backend(q, q, q, mask) == "cudnn"  # a (B, 1, L, S) mask suits cuDNN


def test_cudnn_rejects_3d_masks_and_masks_needing_grad():
    q = spec(2, 4, 16, 64)
    assert backend(q, q, q, spec(2, 16, 16)) == "efficient"
    assert backend(q, q, q, spec(16, 16, requires_grad=True)) == "efficient"
    assert backend(q, q, q, spec(16, 16)) == "cudnn"


def test_head_dim_512_is_not_flash():
    q = spec(1, 2, 16, 512)
    choice = choose_backend(q, q, q)
    assert choice.backend == "efficient"
    assert choice.reasons[0] == "cudnn: head_dim should be no more than 256."
    assert choice.reasons[1].startswith("flash: Flash attention requires q,k,v")


def test_head_dim_limits():
    q256 = spec(1, 2, 16, 256)
    assert backend(q256, q256, q256) == "cudnn"                 # 256 on sm90 from cuDNN 9.10
    assert backend(q256, q256, q256, target=A100) == "flash"
    no_flash = SdpFlags(flash=False)
    q160 = spec(1, 2, 16, 160)
    assert backend(q160, q160, q160, target=A100, flags=no_flash) == "efficient"
    q60 = spec(1, 2, 16, 60)                                    # not a multiple of 8
    assert backend(q60, q60, q60) == "flash"                     # flash pads it to 64
    assert backend(q60, q60, q60, target=A100, flags=no_flash) == "math"  # efficient needs % 8
    f6 = spec(1, 2, 16, 6, dtype=torch.float32)
    assert backend(f6, f6, f6) == "math"                        # efficient needs % 4 in fp32


@pytest.mark.fast
def test_grouped_query_attention():
    q, kv = spec(1, 8, 16, 64), spec(1, 2, 16, 64)
    assert backend(q, kv, kv, enable_gqa=True, target=A100) == "flash"
    assert backend(q, kv, kv, enable_gqa=True) == "cudnn"
    assert backend(q, kv, kv, enable_gqa=True, target=A100, flags=SdpFlags(flash=False)) == "math"
    assert backend(q, kv, kv, target=A100) == "math"             # heads differ, no enable_gqa
    f, fkv = spec(1, 8, 16, 64, dtype=torch.float32), spec(1, 2, 16, 64, dtype=torch.float32)
    assert backend(f, fkv, fkv, enable_gqa=True) == "math"       # 2.13 efficient has no GQA


def test_dropout():
    q = spec(2, 4, 16, 64)
    choice = choose_backend(q, q, q, dropout_p=0.1)
    assert choice.backend == "flash"
    assert choice.reasons == ("cudnn: cuDNN dropout probability resolution is limited to 1/16.",)
    assert backend(q, q, q, dropout_p=0.125) == "cudnn"
    assert backend(q, q, q, dropout_p=0.125, target=CudaTarget(cudnn_version=91200)) == "flash"


def test_causal_with_seq_q_other_than_seq_k_is_not_flash():
    q, kv = spec(1, 2, 4, 64), spec(1, 2, 8, 64)
    assert backend(q, kv, kv, is_causal=True, target=A100) == "efficient"
    assert backend(q, kv, kv, target=A100) == "flash"


def test_fused_kernels_need_4d_inputs_and_unit_last_stride():
    q3 = spec(4, 16, 64)
    assert backend(q3, q3, q3) == "math"
    strided = spec(1, 2, 16, 64, stride=(4096, 2048, 128, 2))
    assert backend(strided, strided, strided) == "math"


def test_training_with_big_heads_is_not_flash_on_sm86():
    rtx3090 = CudaTarget("RTX 3090", (8, 6), cudnn_version=None)
    q, q_grad = spec(1, 2, 16, 200), spec(1, 2, 16, 200, requires_grad=True)
    assert backend(q, q, q, target=rtx3090) == "flash"
    assert backend(q_grad, q, q, target=rtx3090) == "efficient"
    assert backend(q_grad, q, q, target=rtx3090, grad_enabled=False) == "flash"


def test_before_sm80():
    v100 = CudaTarget("V100", (7, 0))
    q, h = spec(1, 2, 16, 64), spec(1, 2, 16, 64, dtype=torch.half)
    assert backend(q, q, q, target=v100) == "math"               # no bf16 before sm80
    assert backend(h, h, h, target=v100) == "efficient"


def test_determinism_rules_out_cudnn_and_no_backend_raises():
    q = spec(2, 4, 16, 64)
    assert backend(q, q, q, flags=SdpFlags(deterministic=True)) == "flash"
    no_efficient_no_math = SdpFlags(efficient=False, math=False)
    assert backend(q, q, q, spec(16, 16), target=A100, flags=no_efficient_no_math) == "cudnn"
    with pytest.raises(RuntimeError, match="No available kernel"):
        choose_backend(q, q, q, spec(16, 16), target=A100,
                       flags=SdpFlags(efficient=False, math=False, cudnn=False))


@pytest.mark.fast
def test_tensors_and_specs_agree():
    q, k, v = qkv(1, 2, 8, 16, dtype=BF16)
    assert choose_backend(q, k, v) == choose_backend(*(TensorSpec.of(t) for t in (q, k, v)))


def test_flags_follow_sdpa_kernel():
    q = spec(2, 4, 16, 64)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert backend(q, q, q, flags=SdpFlags.current()) == "efficient"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert backend(q, q, q, flags=SdpFlags.current()) == "flash"
    assert SdpFlags.current() == SdpFlags()


# -- running the chosen ops on CPU tensors ---------------------------------------------------

def _reference(q, k, v, **kw):
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    return out, torch.autograd.grad(out.float().square().sum(), (q, k, v))


def _emulated(target, q, k, v, **kw):
    with cuda_attention(target) as choices, OpLog() as log:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return out, grads, choices, log


@pytest.mark.parametrize("target, dtype, chosen", [
    (H100, torch.float32, "efficient"),
    (H100, BF16, "cudnn"),
    (A100, BF16, "flash"),
])
def test_sdpa_runs_the_chosen_ops_forward_and_backward(target, dtype, chosen):
    q, k, v = qkv(2, 4, 8, 16, dtype=dtype)
    out, grads, choices, log = _emulated(target, q, k, v, is_causal=True)
    assert [c.backend for c in choices] == [chosen]
    assert log.names() == [choices[0].forward_op, choices[0].backward_op]
    # The same values in fp32 (randn draws other values for bf16 on some releases).
    ref_out, ref_grads = _reference(*(t.detach().float().requires_grad_() for t in (q, k, v)),
                                    is_causal=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert out.dtype == dtype
    assert torch.allclose(out.float(), ref_out, **tol)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g.float(), ref, **tol)


@pytest.mark.fast
@pytest.mark.parametrize("op, extra", [
    (aten._scaled_dot_product_flash_attention, ()),
    (aten._scaled_dot_product_efficient_attention, (None, True)),
    (aten._scaled_dot_product_cudnn_attention, (None, True)),
])
def test_each_cpu_kernel_matches_math_in_fp32(op, extra):
    """The kernels accept fp32 on CPU, so each can be checked tightly, causal and with GQA."""
    for causal, kv_heads in ((True, None), (False, None), (True, 2)):
        q, k, v = qkv(1, 4, 40, 16, kv_heads=kv_heads)
        ref_out, ref_grads = _reference(q, k, v, is_causal=causal, enable_gqa=kv_heads is not None)
        if op is aten._scaled_dot_product_efficient_attention and kv_heads:
            continue  # the mem-efficient kernel takes no GQA inputs
        with cuda_attention():
            out = op(q, k, v, *extra, 0.0, causal)[0]
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert torch.allclose(out, ref_out, atol=1e-5)
        for g, ref in zip(grads, ref_grads, strict=True):
            assert torch.allclose(g, ref, atol=1e-4)


def test_dropout_gradients_use_the_forward_mask():
    """The backward regenerates the forward's mask from the saved seed (fp64 gradcheck)."""
    q, k, v = qkv(1, 2, 5, 8, dtype=torch.float64)
    kv1 = qkv(1, 1, 5, 8, dtype=torch.float64)[1:]
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)

    def seeded(fn):
        def run(*args):
            torch.manual_seed(0)
            return fn(*args)[0]
        return run

    with cuda_attention():
        assert torch.autograd.gradcheck(seeded(
            lambda q, k, v, b: aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.3)),
            (q, k, v, bias))
        assert torch.autograd.gradcheck(seeded(
            lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.25, True)),
            (q, k, v))
        assert torch.autograd.gradcheck(seeded(
            lambda q, k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.25)),
            (q, *kv1))


def test_masks_boolean_and_float_with_grad():
    q, k, v = qkv(2, 4, 8, 16)
    keep = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    bias = torch.randn(2, 1, 8, 8, requires_grad=True)
    for mask, inputs in ((keep, (q, k, v)), (bias, (q, k, v, bias))):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ref_grads = torch.autograd.grad(ref.sum(), inputs)
        with cuda_attention() as choices:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            grads = torch.autograd.grad(out.sum(), inputs)
        assert choices[0].backend == "efficient"
        assert torch.allclose(out, ref, atol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.allclose(g, r, atol=1e-5)


def test_flash_pads_head_dim_to_a_multiple_of_8_like_the_composite():
    q = qkv(1, 2, 8, 20, dtype=BF16, grad=False)[0]
    with cuda_attention(A100), OpLog() as log:
        out = F.scaled_dot_product_attention(q, q, q)
    assert [name for name, _ in log.ops] == ["aten.constant_pad_nd.default"] * 3 + [
        "aten._scaled_dot_product_flash_attention.default", "aten.slice.Tensor"]
    ref = F.scaled_dot_product_attention(q.float(), q.float(), q.float())
    assert out.shape == q.shape
    assert torch.allclose(out.float(), ref, atol=2e-2)


def test_under_autocast_the_op_sees_the_casted_inputs():
    q, k, v = qkv(1, 2, 8, 16)
    with cuda_attention(A100) as choices, OpLog() as log, torch.autocast("cpu", dtype=BF16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    flash = next(layouts for name, layouts in log.ops if "flash_attention" in name)
    assert [c.backend for c in choices] == ["flash"]
    assert log.names("_to_copy") and flash[0][1] == BF16 and flash[1][1] == torch.float32
    assert out.dtype == BF16


# -- layouts: the CPU kernels return what the Meta kernels (and so fake tensors) return -------

@pytest.mark.parametrize("target, dtype, mask", [
    (H100, BF16, None),
    (H100, BF16, "bool"),
    (A100, BF16, None),
    (A100, torch.float32, "float"),
])
def test_real_and_fake_runs_record_the_same_ops_and_layouts(target, dtype, mask):
    def run(fake: bool):
        with cuda_attention(target), FakeTensorMode() if fake else contextlib.nullcontext():
            q, k, v = (torch.ones(1, 2, 40, 16, dtype=dtype, requires_grad=True) for _ in range(3))
            m = {None: None, "bool": torch.ones(40, 40, dtype=torch.bool),
                 "float": torch.zeros(1, 2, 40, 40)}[mask]
            with OpLog() as log:
                F.scaled_dot_product_attention(q, k, v, attn_mask=m).sum().backward()
        # fake tensors answer `.device` through dispatch (prim.device); the aten ops must agree
        return [op for op in log.ops if not op[0].startswith("prim.")]

    real, fake = run(fake=False), run(fake=True)
    assert [name for name, _ in real] == [name for name, _ in fake]
    assert real == fake
    assert any("scaled_dot_product" in name and "backward" in name for name, _ in real)


def test_saved_tensors_have_the_cuda_shapes():
    q, k, v = qkv(1, 2, 40, 16, dtype=BF16)
    with cuda_attention():
        flash = aten._scaled_dot_product_flash_attention(q, k, v)
        efficient = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        cudnn = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
    assert flash[1].shape == (1, 2, 40) and flash[1].dtype == torch.float32
    assert flash[6].shape == (2,) and flash[6].dtype == torch.uint64  # philox seed and offset
    assert efficient[1].shape == (1, 2, 64)                             # padded to 32 queries
    assert efficient[0].stride() == (1280, 16, 32, 1)                   # (B, L, H, D) storage
    assert cudnn[1].shape == (1, 2, 40, 1)


# -- fake tensors and restoring PyTorch's kernels --------------------------------------------

@pytest.mark.fast
def test_fake_tensors_take_the_cuda_ops():
    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 16, dtype=BF16, requires_grad=True)
        with cuda_attention() as choices, OpLog() as log:
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.sum().backward()
        assert [c.backend for c in choices] == ["cudnn"]
        assert log.names() == [choices[0].forward_op, choices[0].backward_op]
        assert out.shape == q.shape and q.grad.shape == q.shape
        with OpLog() as after:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert after.names() == ["aten._scaled_dot_product_flash_attention_for_cpu.default"]


def _cpu_sdpa_ops() -> list[str]:
    q, k, v = qkv(1, 2, 8, 16)
    with OpLog() as log:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return log.names()


def test_exit_restores_pytorch_kernels_even_when_the_body_raises():
    before = _cpu_sdpa_ops()
    assert before == ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                      "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    with pytest.raises(ValueError), cuda_attention():
        raise ValueError("boom")
    assert _cpu_sdpa_ops() == before
    for op in ("flash_attention", "cudnn_attention_backward"):
        name = f"aten::_scaled_dot_product_{op}"
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    q, k, v = qkv(1, 2, 8, 16, grad=False)
    expected = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
    assert torch.equal(F.scaled_dot_product_attention(q, k, v), expected)


def test_nested_contexts_restore_the_outer_one():
    q = qkv(1, 2, 8, 16, dtype=BF16, grad=False)[0]
    with cuda_attention(A100) as outer:
        with cuda_attention(H100) as inner:
            F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)
    assert [c.backend for c in inner] == ["cudnn"]
    assert [c.backend for c in outer] == ["flash"]


def test_flags_read_only_what_the_build_has():
    """FA3's switch is from torch 2.11 on; without it FA3 counts as off, the other flags are
    read as usual, and the features say which detail is missing and since when it exists."""
    from ampscope.torchcompat import attention as compat

    flags = SdpFlags.current()
    found = {f.name: f for f in compat.features()}
    assert set(found) == {"sdp priority order", "fa3 sdp switch"}
    if not found["fa3 sdp switch"].available:
        assert flags.fa3 is False and "2.11" in found["fa3 sdp switch"].detail
    assert flags.flash == torch.backends.cuda.flash_sdp_enabled()
    if found["sdp priority order"].available:
        assert compat.sdp_priority_order()[:4] == ("flash", "efficient", "math", "cudnn")
