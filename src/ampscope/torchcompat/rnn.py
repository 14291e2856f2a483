"""The private side of cuDNN's RNN path: its underscored ATen ops and the switch nn.RNNBase reads.

nn.LSTM, nn.GRU and nn.RNN call `aten::lstm.input` (and its GRU/RNN siblings), composites
that on a CUDA tensor hand the whole sequence to `_cudnn_rnn`, whose autograd formula calls
`_cudnn_rnn_backward`; `flatten_parameters()` packs the weights with `_cudnn_rnn_flatten_weight`
after asking `torch._use_cudnn_rnn_flatten_weight()`. A CPU-only build declares these ops (they
have autograd formulas and, for `_cudnn_rnn`, a Meta kernel) but no kernel: the emulation gives
them CPU kernels. Each is detected once, by name and argument list; where one is missing or
changed, `cudnn_rnn_ops()` is None and RNNs keep the CPU's kernels (the trace says so).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ampscope.torchcompat.dispatch import OpOverload, op_schema
from ampscope.torchcompat.features import Feature

__all__ = ["CudnnRnnOps", "cudnn_rnn_ops", "flatten_switch", "features", "get_kernel_found"]

# Registration names (a Library registers by name) of the ops the emulation gives kernels to.
CUDNN_RNN_NAME = "_cudnn_rnn"
CUDNN_RNN_BACKWARD_NAME = "_cudnn_rnn_backward"
CUDNN_FLATTEN_NAME = "_cudnn_rnn_flatten_weight"
# The argument lists the kernels are written for (torch 2.9 to 2.15: proj_size included).
_ARGUMENTS = {
    CUDNN_RNN_NAME: ("input", "weight", "weight_stride0", "weight_buf", "hx", "cx", "mode",
                     "hidden_size", "proj_size", "num_layers", "batch_first", "dropout", "train",
                     "bidirectional", "batch_sizes", "dropout_state"),
    CUDNN_RNN_BACKWARD_NAME: ("input", "weight", "weight_stride0", "weight_buf", "hx", "cx",
                              "output", "grad_output", "grad_hy", "grad_cy", "mode",
                              "hidden_size", "proj_size", "num_layers", "batch_first", "dropout",
                              "train", "bidirectional", "batch_sizes", "dropout_state", "reserve",
                              "output_mask"),
    CUDNN_FLATTEN_NAME: ("weight_arr", "weight_stride0", "input_size", "mode", "hidden_size",
                         "proj_size", "num_layers", "batch_first", "bidirectional"),
}
# What `torch.backends.cudnn.rnn.get_cudnn_mode` answers on a cuDNN build (cudnnRNNMode_t).
CUDNN_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
# nn.RNNBase's question before it flattens: an attribute of torch, replaced during a run.
_FLATTEN_SWITCH = "_use_cudnn_rnn_flatten_weight"


@dataclass(frozen=True)
class CudnnRnnOps:
    forward: OpOverload  # _cudnn_rnn
    backward: OpOverload  # _cudnn_rnn_backward
    flatten: OpOverload  # _cudnn_rnn_flatten_weight


@functools.cache
def cudnn_rnn_ops() -> CudnnRnnOps | None:
    """The three ops, where this build declares them with the arguments expected; else None."""
    found = []
    for name, expected in _ARGUMENTS.items():
        op = getattr(getattr(torch.ops.aten, name, None), "default", None)
        if op is None or tuple(a.name for a in op_schema(op).arguments) != expected:
            return None
        found.append(op)
    return CudnnRnnOps(*found)


def flatten_switch() -> tuple[object, str] | None:
    """(owner, name) of `torch._use_cudnn_rnn_flatten_weight`, for `patches.patched`."""
    return (torch, _FLATTEN_SWITCH) if callable(getattr(torch, _FLATTEN_SWITCH, None)) else None


def cudnn_mode_slot() -> tuple[object, str] | None:
    """(owner, name) of `torch.backends.cudnn.rnn.get_cudnn_mode`, which `flatten_parameters()`
    asks for cuDNN's mode number (the bindings behind it are missing on a CPU build), for
    `patches.patched`; None where this build has no such function."""
    try:
        import torch.backends.cudnn.rnn as cudnn_rnn
    except ImportError:
        return None
    return (cudnn_rnn, "get_cudnn_mode") if callable(getattr(cudnn_rnn, "get_cudnn_mode",
                                                                  None)) else None


def get_kernel_found() -> bool:
    """Whether `torch.library.get_kernel` (2.9 on) is there: the emulated composites call the
    build's own kernel through it wherever cuDNN would not be used."""
    return callable(getattr(torch.library, "get_kernel", None))


def features() -> list[Feature]:
    ops, switch, kernel = cudnn_rnn_ops(), flatten_switch(), get_kernel_found()
    mode = cudnn_mode_slot()
    return [
        Feature("cudnn rnn mode", mode is not None,
                "torch.backends.cudnn.rnn.get_cudnn_mode" if mode is not None
                else "missing: RNNs keep the CPU's kernels", "rnn emulation"),
        Feature("cudnn rnn ops", ops is not None,
                "_cudnn_rnn, its backward and _cudnn_rnn_flatten_weight" if ops is not None
                else "missing or changed: RNNs keep the CPU's kernels", "rnn emulation"),
        Feature("rnn flatten switch", switch is not None,
                "torch._use_cudnn_rnn_flatten_weight" if switch is not None
                else "missing: weights are not flattened", "rnn emulation"),
        Feature("library get_kernel", kernel,
                "torch.library.get_kernel" if kernel
                else "needs torch 2.9: RNNs keep the CPU's kernels", "rnn emulation"),
    ]
