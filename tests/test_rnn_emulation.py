"""The cuDNN RNN path of an emulated CUDA run (runtime/rnn_kernels.py, runtime/rnn_choice.py).

Truths: the op names and the autocast wrapper's float16 come from torch's CUDA sources
(`RNN.cpp`'s `use_cudnn`, `cudnn/AutocastRNN.cpp`), quoted in rnn_choice's docstring; the
shapes and dtypes of `_cudnn_rnn`'s results from the build's own Meta kernel
(torch/_meta_registrations.py), which is what fake CUDA tensors get on any build; the values
from the build's own CPU kernels run outside the emulation; the flattening from the installed
torch/nn/modules/rnn.py (`flatten_parameters`).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampscope.runtime.attention_choice import CudaTarget
from ampscope.runtime.rnn_choice import choose_rnn
from ampscope.runtime.rnn_kernels import cuda_rnn, emulable
from ampscope.torchcompat import rnn as private_rnn

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(not emulable(), reason="this build lacks the private details")]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, tuple, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, out))
        return out

    def names(self) -> list[str]:
        return [str(f) for f, _, _ in self.calls]


_MODULES = {
    "lstm": lambda: torch.nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True),
    "gru": lambda: torch.nn.GRU(4, 6, num_layers=2),
    "rnn_tanh": lambda: torch.nn.RNN(4, 6, nonlinearity="tanh", bias=False),
    "rnn_relu": lambda: torch.nn.RNN(4, 6, nonlinearity="relu", bidirectional=True),
}


@pytest.mark.parametrize("mode", list(_MODULES))
def test_values_and_grads_are_the_cpu_kernels(mode):
    torch.manual_seed(0)
    module, x = _MODULES[mode](), torch.randn(3, 5, 4)
    expected = module(x.requires_grad_())[0]
    expected.square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    module.zero_grad()
    x.grad = None
    with cuda_rnn() as choices, _Ops() as ops:
        out = module(x)[0]
        out.square().sum().backward()
    assert [c.cudnn for c in choices] == [True]
    names = ops.names()
    assert "aten._cudnn_rnn.default" in names and "aten._cudnn_rnn_backward.default" in names
    assert not any("mkldnn" in n for n in names)
    torch.testing.assert_close(out, expected)
    for got, want in zip([p.grad for p in module.parameters()] + [x.grad], grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", list(_MODULES))
def test_autocast_results_match_the_meta_kernel(mode):
    module, x = _MODULES[mode](), torch.randn(3, 5, 4)
    with cuda_rnn(), _Ops() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
        module(x)
    ops_ = private_rnn.cudnn_rnn_ops()
    assert ops_ is not None
    (func, args, out), = [c for c in ops.calls if c[0] is ops_.forward]
    # AutocastRNN.cpp casts to at::kHalf whatever the autocast dtype (bfloat16 here).
    assert args[0].dtype == torch.float16 and all(w.dtype == torch.float16 for w in args[1])
    meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else
                 [w.to("meta") for w in a] if isinstance(a, list) and a and
                 isinstance(a[0], torch.Tensor) else a for a in args]
    meta = func(*meta_args)
    for i, (got, want) in enumerate(zip(out, meta, strict=True)):
        if i == 2 and mode != "lstm":
            # cy of GRU/RNN: the CUDA kernel's `at::empty({0}, hx.options())` (float16);
            # the Meta kernel writes torch.empty(0), float32.
            assert got.shape == want.shape == (0,) and got.dtype == args[4].dtype
            continue
        assert (got.shape, got.dtype) == (want.shape, want.dtype), i


def test_choice_follows_use_cudnn():
    x = torch.randn(2, 3, 4)
    assert choose_rnn("lstm", x).cudnn
    # bfloat16 inputs from cuDNN 9.13 on (supportsBFloat16RNNWithCuDNN)
    assert choose_rnn("lstm", x.bfloat16()).cudnn
    old = CudaTarget(cudnn_version=91200)
    assert not choose_rnn("lstm", x.bfloat16(), target=old).cudnn
    assert not choose_rnn("lstm", torch.empty(0, 3, 4)).cudnn
    assert not choose_rnn("gru", x, dropout=0.5, train=True).cudnn
    assert choose_rnn("gru", x, dropout=0.5, train=False).cudnn
    with torch.backends.cudnn.flags(enabled=False):
        assert not choose_rnn("lstm", x).cudnn


def test_fallbacks_run_the_cpu_kernel():
    module = torch.nn.LSTM(4, 6, num_layers=2, dropout=0.5)
    with cuda_rnn() as choices, _Ops() as ops:
        module(torch.randn(3, 2, 4))
    assert not choices[0].cudnn and "dropout" in (choices[0].reason or "")
    assert not any("cudnn" in n for n in ops.names())


def test_flatten_parameters_packs_the_weights_without_the_warning():
    from ampscope.runtime.emulation import Emulation
    from ampscope.runtime.virtual_device import VirtualDevice

    with warnings.catch_warnings(record=True) as caught, Emulation("cuda", torch.float16):
        warnings.simplefilter("always")
        with VirtualDevice("cuda").active(), _Ops() as ops:
            module = torch.nn.GRU(4, 6, num_layers=2).to("cuda")
            out = module(torch.randn(3, 2, 4, device="cuda"))[0]
    assert "aten._cudnn_rnn_flatten_weight.default" in ops.names()
    weights = module._flat_weights
    # one storage, laid out in _flat_weights' order (copy_weights_to_flat_buf_views)
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    offsets = [w.storage_offset() for w in weights]
    assert offsets == [sum(w.numel() for w in weights[:i]) for i in range(len(weights))]
    assert out.dtype == torch.float32
    assert not [w for w in caught if "cuDNN" in str(w.message)]
    # the flat buffer is handed to _cudnn_rnn as its weight_buf
    (_, args, _), = [c for c in ops.calls if "_cudnn_rnn.default" in str(c[0])]
    assert args[3] is not None and args[3].numel() == sum(w.numel() for w in weights)


def test_the_rnn_note_names_the_gpu_the_run_stands_for():
    """An emulated run on an A100 says cuDNN's RNN ran as on an A100 (it said "H100" whatever
    the GPU), and a B200 run "on a B200": the note names `Emulation`'s own target."""
    from ampscope.runtime.attention_choice import A100
    from ampscope.runtime.emulation import Emulation
    from ampscope.runtime.virtual_device import VirtualDevice

    with Emulation("cuda", None, A100) as emulation, VirtualDevice("cuda").active():
        torch.nn.LSTM(4, 6).to("cuda")(torch.randn(3, 2, 4, device="cuda"))
    rnn_notes = [n for n in emulation.notes("forward", []) if "RNNs ran cuDNN" in n]
    assert len(rnn_notes) == 1 and "on an A100:" in rnn_notes[0]
    b200 = CudaTarget("B200", (10, 0))
    with Emulation("cuda", None, b200) as emulation, VirtualDevice("cuda").active():
        torch.nn.GRU(4, 6).to("cuda")(torch.randn(3, 2, 4, device="cuda"))
    assert any("on a B200:" in n for n in emulation.notes("forward", []))
