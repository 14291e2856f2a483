"""float16 matmuls as a GPU computes them, on the CPU: float16 inputs, float32 products and
sums, one rounding to float16 at the end.

cuBLAS runs PyTorch's float16 matmuls on Tensor Cores with float32 accumulation (PyTorch's
default: `torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction` only allows a
reduced-precision split-K reduction, which the default heuristics rarely take). A CPU without
float16 arithmetic runs its own float16 GEMM an order of magnitude slower than float32 (the
emulated fp16 step of a GPT-2 took 10× the bf16 one). The product of two float16 values is exact
in float32 (11 + 11 significand bits fit in 24), so the float32 GEMM of the widened inputs,
rounded once, is the GPU's result up to the order of the float32 sums: faster, and closer to the
device than the CPU's own float16 kernel.

`half_matmuls` registers, for the duration of an emulated CUDA run, CPU kernels for `mm`,
`addmm`, `bmm` and `baddbmm` through a `torch.library.Library` destroyed on exit (PyTorch's own
kernels are back, also when the body raises). A call whose tensors are not all float16 goes to
PyTorch's own kernel through the op's `out=` overload, which these kernels leave registered:
the same GEMM, the same bits. The trace still records the float16 op the script called: the
ops these kernels call run below the recorders' dispatch modes (tests/test_half_matmul.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ampscope.torchcompat.policy import destroy_library, overriding_library

aten = torch.ops.aten
_HALF = torch.float16


def _kernel(out_op: Callable, shape: Callable[..., tuple[int, ...]],
            tensors: int) -> Callable:
    """A CPU kernel for an op whose first `tensors` arguments are tensors: float16 ones through
    `out_op` in float32 and one rounding; any other through `out_op` in their own dtype."""

    def kernel(*args, **kwargs):
        inputs = args[:tensors]
        dtype = inputs[0].dtype
        if not all(t.dtype == _HALF for t in inputs):
            out = torch.empty(shape(*inputs), dtype=dtype, device=inputs[0].device)
            return out_op(*args, **kwargs, out=out)
        wide = tuple(t.float() for t in inputs)
        out = torch.empty(shape(*inputs), dtype=torch.float32, device=inputs[0].device)
        out_op(*wide, *args[tensors:], **kwargs, out=out)
        return out.to(_HALF)

    return kernel


def _mm_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    return (a.shape[0], b.shape[1])


def _bmm_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    return (a.shape[0], a.shape[1], b.shape[2])


def _register(library: torch.library.Library) -> None:
    library.impl("mm", _kernel(aten.mm.out, _mm_shape, 2), "CPU")
    library.impl("bmm", _kernel(aten.bmm.out, _bmm_shape, 2), "CPU")
    # addmm(input, mat1, mat2): the result has mat1 @ mat2's shape (input broadcasts to it).
    library.impl("addmm", _kernel(aten.addmm.out, lambda c, a, b: _mm_shape(a, b), 3), "CPU")
    library.impl("baddbmm", _kernel(aten.baddbmm.out, lambda c, a, b: _bmm_shape(a, b), 3),
                 "CPU")


@contextlib.contextmanager
def half_matmuls() -> Iterator[None]:
    """While active, float16 `mm`, `addmm`, `bmm` and `baddbmm` on CPU tensors multiply and
    accumulate in float32 and round once, as a GPU's Tensor Cores do. Process-wide, like any
    dispatcher registration: not for concurrent threads."""
    library = overriding_library(_register)
    try:
        yield
    finally:
        destroy_library(library)
