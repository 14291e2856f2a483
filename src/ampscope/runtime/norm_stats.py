"""Normalization statistics in the dtypes the target device keeps them.

Which device keeps them in which dtype (the mean and 1/std `native_layer_norm` saves for
backward: float32 on CUDA and MPS, the input's dtype or float32 on the CPU by the weights'
dtype) is docs/emulation.md's ("What an emulated run does"); nothing here states it.
`target_dtypes` reads it: for the CPU, from the kernel itself, run on tiny real tensors of the
same dtypes (`_tiny_args` keeps only the dimensions the weights tie to), because PyTorch's fake
implementations give the input's dtype there whatever the weights are; for the other devices,
from those fake implementations (the reference `native_layer_norm`, the Meta kernels of the
others), which branch on the input's device, called on fake tensors of the target device, or
on `meta` tensors (any device that is not the CPU, to them) where one cannot take that device
on this build.

While an emulated or a predicted run is active, `TargetNormStats` (a TorchDispatchMode below
ampscope's recorders) converts the statistics the kernel returned (the CPU kernel's, or a fake
implementation's) to those dtypes, so the trace, the tensors saved for backward and the memory
report see what the device keeps; the backward kernel then gets them back in the dtypes the CPU
kernel takes. Both conversions run inside the mode, where the recorders above it do not see
them, as the device makes none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ampscope.torchcompat import ops as private_ops
from ampscope.torchcompat.dispatch import OpOverload, modes_off
from ampscope.torchcompat.dynamo import UncompiledDispatchMode
from ampscope.torchcompat.fake import FakeTensorMode
from ampscope.torchcompat.policy import no_autocast

aten = torch.ops.aten


@dataclass(frozen=True)
class _Backward:
    """A norm's backward op: the forward call its arguments describe, where the saved
    statistics sit among its arguments (with the forward output each one is), and where its
    output mask is (which gradients the caller wants)."""

    forward: OpOverload
    forward_args: Callable[[tuple], tuple]  # backward args -> the forward call's args
    stats: tuple[tuple[int, int], ...]  # (backward argument index, forward output index)
    mask: int  # the output_mask argument's index


# Forward norms whose statistics (outputs after the first) may differ by device.
NORMS = (
    aten.native_layer_norm.default,
    aten.native_group_norm.default,
    aten.native_batch_norm.default,
    *private_ops.BATCH_NORM_LEGIT,
    private_ops.FUSED_RMS_NORM,
)

BACKWARDS = {
    # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)
    aten.native_layer_norm_backward.default: _Backward(
        aten.native_layer_norm.default, lambda a: (a[1], a[2], a[5], a[6], 1e-5),
        ((3, 1), (4, 2)), 7),
    # (grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)
    aten.native_group_norm_backward.default: _Backward(
        aten.native_group_norm.default, lambda a: (a[1], a[4], None, *a[5:9], 1e-5),
        ((2, 1), (3, 2)), 9),
    # (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
    #  output_mask)
    aten.native_batch_norm_backward.default: _Backward(
        aten.native_batch_norm.default, lambda a: (a[1], a[2], None, a[3], a[4], a[7], 0.1, a[8]),
        ((5, 1), (6, 2)), 9),
    # (grad_out, input, normalized_shape, rstd, weight, output_mask)
    private_ops.FUSED_RMS_NORM_BACKWARD: _Backward(
        private_ops.FUSED_RMS_NORM, lambda a: (a[1], a[2], a[4], None), ((3, 1),), 5),
}

# Norms whose statistics' dtype is decided in code every device shares, before the device's
# kernel runs: `native_group_norm` (ATen's group_norm.cpp) keeps them in the parameters' dtype
# when they differ from the input's (`param_scalar_type`), on every device. PyTorch's fake
# implementation gives the input's dtype; the CPU kernel answers for all devices.
_SHARED_DTYPE_CODE = (aten.native_group_norm.default,)


def _signature(value) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value


def target_dtypes(op: OpOverload, args: tuple, device: str,
                  kwargs: dict | None = None) -> tuple[torch.dtype, ...]:
    """The dtypes of `op(*args, **kwargs)`'s tensor outputs on `device`, from PyTorch's fake
    implementation of the op (see the module docstring)."""
    return _target_dtypes(op, _signature(args), _signature(tuple((kwargs or {}).items())),
                          device)


@functools.cache
def _target_dtypes(op: OpOverload, signature: tuple, kw_signature: tuple,
                   device: str) -> tuple[torch.dtype, ...]:
    if device == "cpu" or op in _SHARED_DTYPE_CODE:
        try:
            return _cpu_kernel_dtypes(op, signature, kw_signature)
        except Exception:  # noqa: BLE001 - an op this module cannot shrink: its fake answer
            pass
    for where in (device, "meta"):
        try:
            with FakeTensorMode():
                out = op(*zeros_of(signature, where), **dict(zeros_of(kw_signature, where)))
        except Exception:  # noqa: BLE001 - this build cannot take the device: ask meta
            continue
        return tuple(t.dtype for t in out if isinstance(t, torch.Tensor))
    raise RuntimeError(f"no fake implementation of {op} answers for {device}")


def _cpu_kernel_dtypes(op: OpOverload, signature: tuple,
                       kw_signature: tuple) -> tuple[torch.dtype, ...]:
    """What the CPU kernel itself returns for these dtypes: it runs on tiny real tensors, seen
    by no mode (the fake mode of a predicted run, ampscope's recorders) and by no autocast."""
    with modes_off(), no_autocast("cpu"), torch.no_grad():
        args = zeros_of(_tiny_args(op, signature), "cpu")
        out = op(*args, **dict(zeros_of(kw_signature, "cpu")))
    return tuple(t.dtype for t in out if isinstance(t, torch.Tensor))


_LAYER_NORMS = (aten.native_layer_norm.default, private_ops.FUSED_RMS_NORM)


def _tiny_args(op: OpOverload, signature: tuple) -> tuple:
    """The call's signature with the input shrunk to the dimensions the other arguments tie to:
    the normalized dimensions of a layer (or RMS) norm, the channels of a batch or group norm
    (two rows for batch norm, whose training statistics need more than one value per channel).
    The statistics' dtypes depend on the arguments' dtypes only."""
    (kind, dtype, shape), *rest = signature
    if op in _LAYER_NORMS:
        normalized = tuple(rest[0])
        tiny = (1,) * (len(shape) - len(normalized)) + normalized
    elif op is aten.native_group_norm.default:  # (input, weight, bias, N, C, HxW, group, eps)
        tiny = (1, shape[1]) + (1,) * (len(shape) - 2)
        rest[2], rest[4] = 1, 1
    elif op in NORMS:  # the batch norms: (input, weight, bias, ...)
        tiny = (2, shape[1]) + (1,) * (len(shape) - 2)
    else:
        raise ValueError(f"no tiny form of {op}")
    return ((kind, dtype, tiny), *rest)


def zeros_of(signature, device: str, *, tiny: bool = False):
    """The arguments a signature (`_signature`, predict.py's) describes, each tensor as zeros
    of its dtype on `device`, of its shape or (`tiny`) of one element. Zeros, not empty: a CPU
    kernel reads the values (a variance of garbage may warn)."""
    if isinstance(signature, tuple) and signature[:1] == ("tensor",):
        _, dtype, shape = signature
        return torch.zeros((1,) * len(shape) if tiny else shape, dtype=dtype, device=device)
    if isinstance(signature, tuple):
        return tuple(zeros_of(s, device, tiny=tiny) for s in signature)
    return signature


def _as_masked(out, mask) -> tuple:
    """A backward's gradients, None where the output mask asks for none: the kernels return an
    undefined tensor there, where PyTorch's fake batch-norm backward makes one anyway."""
    if not isinstance(mask, (list, tuple)) or all(mask):
        return out
    return type(out)(None if not wanted else t for t, wanted in zip(out, mask, strict=False))


class TargetNormStats(UncompiledDispatchMode):
    """While active, norm statistics come out in the dtypes `device` keeps them in; with no
    `device`, in those of the device each norm's input is on (a predicted run's fake tensors
    on the CPU: the CPU kernel's dtypes, which PyTorch's fake implementations do not give)."""

    def __init__(self, device: str | None) -> None:
        super().__init__()
        self.device = device

    @staticmethod
    def passes_through(func: OpOverload) -> bool:
        """Whether the mode hands `func` on unchanged: all but the norms and their backwards
        (runs/fake_cache.py answers those others without it)."""
        return func not in BACKWARDS and func not in NORMS

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        backward = BACKWARDS.get(func)
        if backward is not None:
            args = self._stats_for_this_kernel(backward, args)
            return _as_masked(func(*args, **kwargs), args[backward.mask])
        out = func(*args, **kwargs)
        if func in NORMS:
            wanted = target_dtypes(func, args, self.device or args[0].device.type, kwargs)
            if wanted != tuple(t.dtype for t in out):
                out = type(out)(t.to(d) if isinstance(t, torch.Tensor) and t.dtype != d else t
                                for t, d in zip(out, wanted, strict=True))
        return out

    def _stats_for_this_kernel(self, backward: _Backward, args: tuple) -> tuple:
        """The saved statistics in the dtypes the CPU's forward kernel gives them, which its
        backward kernel expects (eps and momentum change no dtype: any value serves)."""
        kernel = target_dtypes(backward.forward, backward.forward_args(args), "cpu")
        values = list(args)
        for arg, output in backward.stats:
            if isinstance(values[arg], torch.Tensor) and values[arg].dtype != kernel[output]:
                values[arg] = values[arg].to(kernel[output])
        return tuple(values)
