"""RNN FLOPs against counts derived by hand.

Convention (PyTorch's): a multiply-add is 2 FLOPs, elementwise work 0. An RNN layer multiplies
each of its T·B input vectors by w_ih (G·H × I_l) and each step's hidden state by w_hh
(G·H × H): 2·T·B·G·H·(I_l + H) per layer and direction, G = 4 (LSTM), 3 (GRU), 1 (RNN),
I_l = the input size IN for layer 0 and D·H after. The sizes below are kept apart (IN, H, OUT
and T, B differ) so that a count with one size in another's place fails.

On the CPU a float32 LSTM runs oneDNN's fused layer (`mkldnn_rnn_layer`, whose backward computes
the gradients of input, state and both weights: 2× the forward); GRU and RNN run as `mm`/`addmm`
ops (their backward computes only the gradients autograd asks for, derived op by op below). On
the emulated CUDA device each runs cuDNN's `_cudnn_rnn` (backward: the data pass always, the
weight pass where the weights train: 2× the forward, 1× with frozen weights).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampscope
from ampscope.runs import flops
from ampscope.runtime.rnn_kernels import emulable

IN, H, T, B, OUT = 3, 4, 5, 2, 6  # input size, hidden size, steps, batch, the head's outputs

needs_emulation = pytest.mark.skipif(not emulable(), reason="this build lacks the RNN emulation")


class _Tagger(nn.Module):
    """An RNN over (B, T, IN) and a Linear head on each step's output."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        width = (rnn.proj_size or rnn.hidden_size) * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(width, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _run(model: nn.Module, device: str | None, *, train: bool, x_grad: bool = False):
    """One step of `model` inside ampscope.capture (on the emulated device where given)."""
    torch.manual_seed(0)
    on = device or "cpu"
    with ampscope.capture(model, device=device) as t:
        model = model.to(on)
        x = torch.randn(B, T, IN, device=on, requires_grad=x_grad)
        if train:
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)
    return t


def _flops(t, phase: str, module: str) -> int:
    return sum(o.flops for o in t.ops if o.phase == phase and o.module == module)


def _head_forward(width: int) -> int:
    return 2 * T * B * width * OUT  # (T·B × width) @ (width × OUT)


def _check_head(t, width: int, *, train: bool) -> None:
    assert _flops(t, "forward", "head") == _head_forward(width)
    # the head's weight gradient and its input's (the RNN's output needs one)
    assert _flops(t, "backward", "head") == (2 * _head_forward(width) if train else 0)


# --- the CPU --------------------------------------------------------------------------------


@pytest.mark.fast
def test_cpu_lstm_training_step_counts_onednns_layer():
    t = _run(_Tagger(nn.LSTM(IN, H, batch_first=True)), None, train=True)
    assert any("mkldnn_rnn_layer" in o.op for o in t.ops)  # the path this test is about
    assert _flops(t, "forward", "rnn") == 2 * T * B * 4 * H * (IN + H) == 2240
    assert _flops(t, "backward", "rnn") == 2 * (2 * T * B * 4 * H * (IN + H)) == 4480
    _check_head(t, H, train=True)


@pytest.mark.fast
def test_cpu_bidirectional_two_layer_lstm_forward_alone():
    t = _run(_Tagger(nn.LSTM(IN, H, num_layers=2, bidirectional=True, batch_first=True)), None,
             train=False)
    layer0 = 2 * T * B * 4 * H * (IN + H)
    layer1 = 2 * T * B * 4 * H * (2 * H + H)  # its input is both directions' outputs
    assert _flops(t, "forward", "rnn") == 2 * layer0 + 2 * layer1 == 12160
    assert not any(o.phase == "backward" for o in t.ops)
    _check_head(t, 2 * H, train=False)


def test_cpu_predicted_lstm_counts_as_the_real_one():
    """A predicted run (fake tensors) dispatches the same oneDNN ops."""
    def step(model, batch):
        model(batch["x"]).sum().backward()

    t = ampscope.trace(_Tagger(nn.LSTM(IN, H, batch_first=True)), {"x": torch.randn(B, T, IN)},
                       workload=step, predict=True)
    assert _flops(t, "forward", "rnn") == 2 * T * B * 4 * H * (IN + H)
    assert _flops(t, "backward", "rnn") == 2 * (2 * T * B * 4 * H * (IN + H))


@pytest.mark.fast
def test_cpu_two_layer_gru_training_step_counts_its_matmuls_once():
    """The CPU GRU runs as mm/addmm: per layer one (T·B × I_l) @ (I_l × 3H) for the input and
    T (B × H) @ (H × 3H) steps. Its backward computes what autograd needs: each weight's
    gradient, the input's only where it needs one (layer 1's input, not x), and the state's at
    each step but the first (h0 is a zero tensor that needs none)."""
    t = _run(_Tagger(nn.GRU(IN, H, num_layers=2, batch_first=True)), None, train=True)
    g = 3 * H
    assert _flops(t, "forward", "rnn") == 2 * T * B * g * (IN + H) + 2 * T * B * g * (H + H)
    layer0 = (2 * T * B * g * IN  # dW_ih
              + 2 * T * B * g * H  # dW_hh
              + 2 * (T - 1) * B * g * H)  # dh at steps T..2
    layer1 = (2 * T * B * g * H  # dW_ih
              + 2 * T * B * g * H  # d(input), layer 0's output
              + 2 * T * B * g * H  # dW_hh
              + 2 * (T - 1) * B * g * H)  # dh
    assert _flops(t, "backward", "rnn") == layer0 + layer1 == 6096
    _check_head(t, H, train=True)


@pytest.mark.fast
def test_cpu_rnn_tanh_forward_alone():
    t = _run(_Tagger(nn.RNN(IN, H, batch_first=True)), None, train=False)
    assert _flops(t, "forward", "rnn") == 2 * T * B * H * (IN + H) == 560
    _check_head(t, H, train=False)


# --- the emulated CUDA device (cuDNN's _cudnn_rnn) -------------------------------------------


@needs_emulation
@pytest.mark.fast
def test_cuda_lstm_training_step():
    t = _run(_Tagger(nn.LSTM(IN, H, batch_first=True)), "cuda", train=True)
    assert any("cudnn_rnn" in o.op for o in t.ops)
    forward = 2 * T * B * 4 * H * (IN + H)
    assert _flops(t, "forward", "rnn") == forward == 2240
    assert _flops(t, "backward", "rnn") == 2 * forward
    _check_head(t, H, train=True)


@needs_emulation
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_cuda_predicted_step_counts_as_the_real_one(cell):
    """`trace` predicts by default: on the virtual CUDA device the fake cuDNN op gets the
    weight buffer cuDNN makes for itself (its fake kernel returns none, which the backward
    refused), and the step counts the same recurrent FLOPs as the real one, by hand."""
    def step(model, batch):
        model(batch["x"]).sum().backward()

    gates = 4 if cell is nn.LSTM else 3
    forward = 2 * T * B * gates * H * (IN + H)
    for predict in (True, False):
        t = ampscope.trace(_Tagger(cell(IN, H, batch_first=True)), {"x": torch.randn(B, T, IN)},
                           setting="cuda:fp32", workload=step, predict=predict)
        assert t.mode == ("predict" if predict else "run")
        assert any("cudnn_rnn" in o.op for o in t.ops)
        assert _flops(t, "forward", "rnn") == forward
        assert _flops(t, "backward", "rnn") == 2 * forward


@needs_emulation
@pytest.mark.fast
def test_cuda_bidirectional_two_layer_lstm_training_step():
    t = _run(_Tagger(nn.LSTM(IN, H, num_layers=2, bidirectional=True, batch_first=True)), "cuda",
             train=True)
    forward = 2 * (2 * T * B * 4 * H * (IN + H)) + 2 * (2 * T * B * 4 * H * (2 * H + H))
    assert _flops(t, "forward", "rnn") == forward == 12160
    assert _flops(t, "backward", "rnn") == 2 * forward
    _check_head(t, 2 * H, train=True)


@needs_emulation
@pytest.mark.fast
def test_cuda_two_layer_gru_forward_alone():
    t = _run(_Tagger(nn.GRU(IN, H, num_layers=2, batch_first=True)), "cuda", train=False)
    assert _flops(t, "forward", "rnn") == \
        2 * T * B * 3 * H * (IN + H) + 2 * T * B * 3 * H * (H + H) == 3600
    _check_head(t, H, train=False)


@needs_emulation
@pytest.mark.fast
def test_cuda_rnn_relu_training_step():
    t = _run(_Tagger(nn.RNN(IN, H, nonlinearity="relu", batch_first=True)), "cuda", train=True)
    assert _flops(t, "forward", "rnn") == 2 * T * B * H * (IN + H) == 560
    assert _flops(t, "backward", "rnn") == 2 * 560
    _check_head(t, H, train=True)


@needs_emulation
@pytest.mark.fast
def test_cuda_frozen_lstm_runs_the_data_pass_only():
    """Frozen weights: cuDNN's backward skips the weight pass (output_mask[3] is False); the
    input's gradient still takes the data pass, the forward's FLOPs once."""
    model = _Tagger(nn.LSTM(IN, H, batch_first=True))
    model.rnn.requires_grad_(False)
    t = _run(model, "cuda", train=True, x_grad=True)
    assert _flops(t, "backward", "rnn") == 2 * T * B * 4 * H * (IN + H) == 2240


@needs_emulation
@pytest.mark.fast
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_cuda_lstm_with_projections_forward():
    """proj_size P: the recurrent weight is 4H × P and each step's output goes through
    w_hr (P × H): 2·T·B·(4H·(IN + P) + P·H)."""
    P = 2
    t = _run(_Tagger(nn.LSTM(IN, H, proj_size=P, batch_first=True)), "cuda", train=False)
    assert _flops(t, "forward", "rnn") == 2 * T * B * (4 * H * (IN + P) + P * H) == 1760
    _check_head(t, P, train=False)


# --- registered on this build -----------------------------------------------------------


@pytest.mark.fast
def test_ampscopes_rnn_formulas_are_registered_on_this_build():
    from ampscope.torchcompat import rnn as private_rnn

    names = ["mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"]
    if private_rnn.cudnn_rnn_ops() is not None:
        names += [private_rnn.CUDNN_RNN_NAME, private_rnn.CUDNN_RNN_BACKWARD_NAME]
    for name in names:
        op = getattr(torch.ops.aten, name).default
        found = flops.formula(op)
        assert found is not None and found.extra, name
    assert not set(names) & set(flops.skipped())
