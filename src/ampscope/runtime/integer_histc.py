"""`torch.histc` of integer tensors as CUDA counts them, on the CPU.

CUDA's `histc` takes integer tensors and returns its counts in the input's dtype; the CPU's
kernel, and PyTorch's meta function for a CPU tensor, take floating tensors only ("histogram_cpu"
not implemented for 'Int'). transformers' mixture-of-experts layers count the tokens routed to
each expert that way on CUDA (`histc` of the int32 expert ids), so an emulated CUDA run of
Mixtral or Qwen-MoE stopped there, where the GPU runs on.

`integer_histc` registers, for the duration of an emulated CUDA run, a CPU kernel and a meta
kernel for `histc` through a `torch.library.Library` destroyed on exit (PyTorch's own kernels
are back, also when the body raises). The CPU kernel counts an integer tensor by CUDA's rule
(`_histc_cuda_template`): the bounds converted to 64-bit integers (truncated toward zero); where
they are equal, the data's own minimum and maximum, widened by one each way where those are
equal too; values outside [min, max] not counted; a value x in bin (x − min) · bins // (max −
min), in 64-bit integers, the maximum in the last bin. Any other tensor goes to PyTorch's own
kernel through `histc.out`, which this leaves registered: the same counts and errors. The meta
kernel gives fake tensors (a predicted run) the result's shape and dtype, where the build lets
it replace PyTorch's (not torch 2.9: docs/compatibility.md). Both first run PyTorch's own
kernel of their device on an empty floating tensor: bad bins or bounds fail in its words. The trace records the one `histc` the script called: the ops the kernel calls run
below the recorders' dispatch modes (tests/test_integer_histc.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ampscope.torchcompat.policy import destroy_library, overriding_library

aten = torch.ops.aten


def _counted_as_integers(input: torch.Tensor) -> bool:
    return not input.is_floating_point() and not input.is_complex() and input.dtype != torch.bool


def _check(bins: int, min: float, max: float, device: torch.device) -> None:
    """PyTorch's own checks of the arguments, with its own words: its kernel for `device` run
    on an empty floating tensor."""
    empty = torch.empty(0, dtype=torch.float64, device=device)
    aten.histc.out(empty, bins, min, max, out=torch.empty_like(empty))


def _cpu_histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
               ) -> torch.Tensor:
    if not _counted_as_integers(input):
        out = torch.empty((bins,), dtype=input.dtype, device=input.device)
        return aten.histc.out(input, bins, min, max, out=out)
    _check(bins, min, max, input.device)
    values = input.reshape(-1).long()
    low, high = int(min), int(max)
    if low == high and values.numel():
        low, high = int(values.min()), int(values.max())
    if low == high:
        low, high = low - 1, high + 1
    kept = values[(values >= low) & (values <= high)]
    where = ((kept - low) * bins).div(high - low, rounding_mode="floor").clamp(max=bins - 1)
    return torch.bincount(where, minlength=bins).to(input.dtype)


def _meta_histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
                ) -> torch.Tensor:
    _check(bins, min, max, input.device)
    return input.new_empty((bins,))


def _register(library: torch.library.Library, fake: list[bool]) -> None:
    library.impl("histc", _cpu_histc, "CPU")
    # Some builds (torch 2.9) refuse to replace a meta kernel PyTorch registered from Python
    # ("there's already a kernel registered from python"): there a fake tensor's integer histc
    # fails as on PyTorch's own fake CPU tensors, and the rest of the run is unchanged.
    try:
        library.impl("histc", _meta_histc, "Meta")
        fake.append(True)
    except RuntimeError:
        fake.append(False)


@contextlib.contextmanager
def integer_histc() -> Iterator[bool]:
    """While active, `torch.histc` counts integer CPU tensors (and fake ones, where this build
    lets it: the value given) as CUDA does. Process-wide, like any dispatcher registration:
    not for concurrent threads."""
    fake: list[bool] = []
    library = overriding_library(lambda lib: _register(lib, fake))
    try:
        yield fake[0]
    finally:
        destroy_library(library)
