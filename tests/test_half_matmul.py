"""float16 matmuls on the emulated CUDA device: float32 products and sums, one rounding, as a
GPU's Tensor Cores compute them (runtime/half_matmul.py), checked against float32 and float64
arithmetic done here and against the CPU's own float16 kernel."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ampscope
import ampscope.runtime.half_matmul as half_matmul
from ampscope.runtime.half_matmul import half_matmuls

pytestmark = pytest.mark.fast


def _half(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half()


CASES = {
    "mm": (lambda a, b, c: torch.mm(a, b), (64, 512), (512, 96), None),
    "addmm": (lambda a, b, c: torch.addmm(c, a, b, beta=0.5, alpha=2.0), (64, 512), (512, 96),
              (96,)),
    "bmm": (lambda a, b, c: torch.bmm(a, b), (3, 32, 256), (3, 256, 40), None),
    "baddbmm": (lambda a, b, c: torch.baddbmm(c, a, b, alpha=0.25), (3, 32, 256), (3, 256, 40),
                (3, 32, 40)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_rounding_of_the_float32_result(name):
    call, sa, sb, sc = CASES[name]
    a, b = _half(*sa, seed=1), _half(*sb, seed=2)
    c = _half(*sc, seed=3) if sc is not None else None
    cpu = call(a, b, c)  # PyTorch's own float16 kernel
    with half_matmuls():
        ours = call(a, b, c)
    # The float32 GEMM of the widened inputs (each product exact in float32), rounded once.
    wide = call(a.float(), b.float(), c.float() if c is not None else None)
    assert ours.dtype == torch.float16 and ours.shape == cpu.shape
    assert torch.equal(ours, wide.half())
    # Within float16's tolerance of the CPU kernel and of float64 arithmetic.
    torch.testing.assert_close(ours, cpu)
    exact = call(a.double(), b.double(), c.double() if c is not None else None)
    torch.testing.assert_close(ours.double(), exact, rtol=1e-3, atol=1e-2)
    # PyTorch's kernel is back afterwards.
    assert torch.equal(call(a, b, c), cpu)


def test_other_dtypes_run_pytorchs_kernel_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        a = torch.randn(33, 70, generator=g).to(dtype)
        b = torch.randn(70, 21, generator=g).to(dtype)
        c = torch.randn(21, generator=g).to(dtype)
        x, y = torch.randn(2, 5, 7).to(dtype), torch.randn(2, 7, 3).to(dtype)
        expected = (torch.mm(a, b), torch.addmm(c, a, b), torch.bmm(x, y))
        with half_matmuls():
            got = (torch.mm(a, b), torch.addmm(c, a, b), torch.bmm(x, y))
        for e, o in zip(expected, got, strict=True):
            assert o.dtype == dtype and torch.equal(o, e)


def test_gradients_flow_through():
    a = _half(8, 16, seed=4).requires_grad_()
    b = _half(16, 4, seed=5).requires_grad_()
    with half_matmuls():
        torch.mm(a, b).float().sum().backward()
    assert a.grad is not None and a.grad.dtype == torch.float16
    # d(sum(a @ b))/da = ones @ b.T: each row the sums of b's rows.
    torch.testing.assert_close(a.grad, b.detach().float().sum(1).expand(8, 16).half())


def test_an_emulated_fp16_trace_records_the_ops_the_script_called(monkeypatch):
    """The kernels' own widening and rounding run below the recorders: the trace lists the
    same float16 ops with and without them."""

    def ops(trace):
        return [(o.op, o.phase, tuple(m.dtype for m in o.inputs),
                 tuple(m.dtype for m in o.outputs)) for o in trace.ops]

    options = dict(setting="cuda:fp32+amp-fp16", workload="train", seq=8, predict=False)
    with_kernels = ampscope.trace("gpt2-tiny", **options)
    monkeypatch.setattr(half_matmul, "half_matmuls", contextlib.nullcontext)
    without = ampscope.trace("gpt2-tiny", **options)
    assert ops(with_kernels) == ops(without)
    assert ("aten.addmm.default", "forward", ("float16",) * 3, ("float16",)) in ops(with_kernels)
