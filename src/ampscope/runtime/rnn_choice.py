"""Whether a CUDA GPU would run an RNN call through cuDNN: `choose_rnn`, torch's own rules.

nn.LSTM, nn.GRU and nn.RNN (tanh, relu) call `aten::lstm.input` and its siblings; on a CUDA
build each begins `if (use_cudnn(_input))` and hands the call to `_cudnn_impl`, which calls
`_cudnn_rnn`. Sources, torch 2.13 (`aten/src/ATen/native/RNN.cpp`, `native/TensorProperties.cpp`,
`native/cudnn/RNN.cpp` and `cudnn/AutocastRNN.cpp` as stored in the pytorch/pytorch index; the
Python side is the installed `torch/nn/modules/rnn.py` and `torch/backends/cudnn/__init__.py`):

- `use_cudnn(t)`: `cudnn_is_acceptable(t)` (cuDNN enabled by the user, a CUDA tensor, a build
  with cuDNN, at least one element) and a dtype of float64, float32, float16, or bfloat16 where
  the runtime cuDNN supports bfloat16 RNNs (9.13 on). Only the input is asked: under autocast it
  is still float32 there, the casts come later (`_cudnn_rnn`'s own autocast wrapper).
- the wrapper (`_cudnn_rnn_cast_reflatten`, registered for `_cudnn_rnn` at the CUDA Autocast
  key) casts input and hidden states to float16 and copies the weights into a new float16 flat
  buffer, whatever dtype the autocast region asked for: its dtype is written `at::kHalf`. A
  CPU-only build does not compile it, so no policy read from the build can hold it.
- `flatten_parameters()` (Python) packs the weights only when all are CUDA tensors of one dtype
  in `torch.backends.cudnn.CUDNN_TENSOR_DTYPES` (no bfloat16 in 2.13) that share no memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampscope.runtime.attention_choice import H100, CudaTarget

# Inputs cuDNN RNNs take (`use_cudnn`); bfloat16 from this runtime cuDNN version on.
_CUDNN_DTYPES = (torch.float64, torch.float32, torch.float16)
_BF16_CUDNN = 91300
# The dtype `_cudnn_rnn`'s autocast wrapper casts to (`at::kHalf` in AutocastRNN.cpp).
AUTOCAST_RNN_DTYPE = torch.float16


@dataclass(frozen=True)
class RnnChoice:
    """One RNN call: its mode ("lstm", "gru", "rnn_tanh", "rnn_relu"), whether it took cuDNN,
    and why not where it did not."""

    mode: str
    cudnn: bool
    reason: str | None = None


def choose_rnn(mode: str, input: torch.Tensor, *, dropout: float = 0.0, train: bool = False,
               packed: bool = False, target: CudaTarget = H100) -> RnnChoice:
    """What the CUDA build of torch would run for this call on `target`."""
    version = target.cudnn_version
    if not torch.backends.cudnn.enabled:
        return RnnChoice(mode, False, "cuDNN is disabled (torch.backends.cudnn.enabled)")
    if version is None:
        return RnnChoice(mode, False, f"the {target.name} build has no cuDNN")
    if input.numel() == 0:
        return RnnChoice(mode, False, "an empty input is not given to cuDNN")
    dtypes = _CUDNN_DTYPES + ((torch.bfloat16,) if version >= _BF16_CUDNN else ())
    if input.dtype not in dtypes:
        return RnnChoice(mode, False, f"cuDNN RNNs do not take {input.dtype}")
    # From here cuDNN is what the GPU runs; the two cases below are ones ampscope cannot
    # reproduce, so they keep the CPU's kernel (and say so).
    if packed:
        return RnnChoice(mode, False, "packed sequences are not emulated")
    if dropout > 0 and train:
        return RnnChoice(mode, False, "inter-layer dropout in training is not emulated")
    return RnnChoice(mode, True)


def weight_shapes(mode: str, input_size: int, hidden_size: int, proj_size: int,
                  num_layers: int, bidirectional: bool, has_biases: bool) -> list[tuple[int, ...]]:
    """The shapes of nn.RNNBase's flat weight list, in its order (per layer and direction:
    w_ih, w_hh, b_ih, b_hh, w_hr), which is also the order of cuDNN's flat buffer."""
    gates = {"lstm": 4, "gru": 3}.get(mode, 1) * hidden_size
    out = proj_size or hidden_size
    directions = 2 if bidirectional else 1
    shapes: list[tuple[int, ...]] = []
    for layer in range(num_layers):
        layer_input = input_size if layer == 0 else out * directions
        for _ in range(directions):
            shapes += [(gates, layer_input), (gates, out)]
            if has_biases:
                shapes += [(gates,), (gates,)]
            if proj_size:
                shapes.append((proj_size, hidden_size))
    return shapes
