"""Running the cuDNN RNN path a CUDA GPU would take, on CPU (and fake) tensors.

`cuda_rnn` replaces, for the duration of a run, the composites nn.LSTM, nn.GRU and nn.RNN call
(`lstm.input`, `gru.input`, `rnn_tanh.input`, `rnn_relu.input`) with their CUDA branch: where
`rnn_choice.choose_rnn` says cuDNN takes the call, the composite does what `_cudnn_impl` does
(the flat weight buffer found from the weights' storage, `_cudnn_rnn`) and, under autocast,
what `_cudnn_rnn`'s autocast wrapper does (float16 casts, the weights copied into a float16
flat buffer); elsewhere it calls the build's own composite. The cuDNN ops get CPU kernels that
compute with the CPU's RNN kernels (in float32 for float16/bfloat16 inputs, as cuDNN's math
type for them is float32) and lay their results out as the ops' Meta kernel does. Their
autograd formula is the build's own, so backward calls `_cudnn_rnn_backward`, whose kernel
recomputes the forward with autograd in a fresh thread (dispatcher state is per thread, and a
kernel runs with autograd switched off). `flatten_parameters()` packs the weights with
`_cudnn_rnn_flatten_weight`, as it does on a GPU, and no longer warns that this build lacks
cuDNN: the emulated GPU has it. Sources are listed in `rnn_choice`; what is not reproduced,
in docs/emulation.md ("RNN kernels").
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from ampscope.patches import patched
from ampscope.runtime.attention_choice import H100, CudaTarget, contiguous_strides
from ampscope.runtime.autocast_key import eligible, key_state
from ampscope.runtime.rnn_choice import AUTOCAST_RNN_DTYPE, RnnChoice, choose_rnn, weight_shapes
from ampscope.torchcompat import rnn as private_rnn
from ampscope.torchcompat.fake import FakeTensor
from ampscope.torchcompat.policy import destroy_library, no_autocast, overriding_library
from ampscope.wording import article

aten = torch.ops.aten
MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
_MODE_NAMES = {code: name for name, code in private_rnn.CUDNN_MODES.items()}

# The active contexts, innermost last; kernels are registered by the outermost one.
_contexts: list[tuple[CudaTarget, list[RnnChoice]]] = []
# The build's own composites, read before ours replace them: {"lstm.input": kernel, ...}.
_originals: dict[str, Any] = {}  # torch.library.get_kernel's SafeKernelFunction
# `.original` set: this thread's RNN composites are the build's own (the CPU kernels and the
# backward's recomputation run the CPU's RNN through them).
_local = threading.local()


@contextlib.contextmanager
def _original_rnns() -> Iterator[None]:
    before = getattr(_local, "original", False)
    _local.original = True
    try:
        yield
    finally:
        _local.original = before


def _half(t: torch.Tensor | None) -> torch.Tensor | None:  # cached_cast(at::kHalf, t)
    return t.to(AUTOCAST_RNN_DTYPE) if t is not None and eligible(t) and t.dtype != AUTOCAST_RNN_DTYPE else t


# -- the CUDA branch of the composites (RNN.cpp, native/cudnn/RNN.cpp, AutocastRNN.cpp)

def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a storage without data: compare offsets only
        return 0


def _weight_buf(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """try_get_weight_buf: the flat buffer the weights are views of, laid out in order."""
    first = params[0]
    if isinstance(first, FakeTensor):  # never flattened (_is_acceptable); no data pointers
        return None
    offset, key = 0, _storage_key(first)
    for p in params:
        if (p.dtype != first.dtype or not p.is_contiguous() or _storage_key(p) != key
                or p.storage_offset() != offset):
            return None
        offset += p.numel()
    buf = first.new_empty(0).set_(first.untyped_storage())  # new_*: fake where params are
    if buf.numel() < offset:
        return None
    return buf.narrow(0, 0, offset) if buf.numel() > offset else buf


def _flat_half_views(params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """copy_weights_to_flat_buf_views(..., kHalf, allow_type_change=true): a new float16 buffer
    and the weights copied into (n, 1) views of it (copies autograd sees, so gradients reach the
    float32 weights)."""
    buf = params[0].new_zeros(sum(p.numel() for p in params), dtype=AUTOCAST_RNN_DTYPE)
    views, offset = [], 0
    for p in params:
        view = buf.new_empty(0).set_(
            buf.untyped_storage(), offset, (p.numel(), 1), (1, 1))
        view.copy_(p.reshape(view.shape))
        views.append(view)
        offset += p.numel()
    return buf, views


def _cudnn_impl(mode: str, input, hx, cx, params, has_biases: bool, num_layers: int,
                dropout: float, train: bool, bidirectional: bool, batch_first: bool):
    hidden_size, proj_size = hx.size(2), 0
    if cx is not None and cx.size(2) != hx.size(2):  # an LSTM with projections
        hidden_size, proj_size = cx.size(2), hx.size(2)
    weight_buf = _weight_buf(params)
    stride0 = (4 if has_biases else 2) + (1 if proj_size else 0)
    if key_state("cpu")[0]:  # the target's autocast, in an emulated run
        with no_autocast("cpu"):  # the wrapper excludes autocast for what it calls
            ref = weight_buf if weight_buf is not None else params[0]
            if eligible(ref) and ref.dtype != AUTOCAST_RNN_DTYPE:
                weight_buf, params = _flat_half_views(params)
            input, hx, cx = _half(input), _half(hx), _half(cx)
            return _call(mode, input, hx, cx, params, stride0, weight_buf, hidden_size,
                         proj_size, num_layers, batch_first, dropout, train, bidirectional)
    return _call(mode, input, hx, cx, params, stride0, weight_buf, hidden_size, proj_size,
                 num_layers, batch_first, dropout, train, bidirectional)


def _call(mode, input, hx, cx, params, stride0, weight_buf, hidden_size, proj_size, num_layers,
          batch_first, dropout, train, bidirectional):
    ops = private_rnn.cudnn_rnn_ops()
    assert ops is not None  # (cuda_rnn registers nothing without them)
    if weight_buf is None and isinstance(input, FakeTensor):
        # cuDNN copies weights it is not given flat into a buffer of its own and returns it
        # for the backward; the fake kernel returns none, which autograd refuses. A predicted
        # run gives it that buffer's storage (its size, no values: the math is never run).
        weight_buf = input.new_empty(sum(w.numel() for w in params))
    output, hy, cy, _, _ = ops.forward(
        input, list(params), stride0, weight_buf, hx, cx, private_rnn.CUDNN_MODES[mode],
        hidden_size, proj_size, num_layers, batch_first, dropout, train, bidirectional, [], None)
    return (output, hy, cy) if mode == "lstm" else (output, hy)


def _composite(mode: str) -> Callable:
    name = f"{mode}.input"

    def rnn(keyset, input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first):
        original = _originals[name]
        args = (input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                batch_first)
        if getattr(_local, "original", False) or not _contexts:
            return original.call_boxed(keyset, *args)
        target, choices = _contexts[-1]
        choice = choose_rnn(mode, input, dropout=dropout, train=train, target=target)
        choices.append(choice)
        if not choice.cudnn:
            return original.call_boxed(keyset, *args)
        h, c = (hx[0], hx[1]) if mode == "lstm" else (hx, None)
        return _cudnn_impl(mode, input, h, c, params, has_biases, num_layers, dropout, train,
                           bidirectional, batch_first)

    return rnn


def _packed(mode: str) -> Callable:
    """`lstm.data` and its siblings: recorded as a choice, run by the build's own composite."""
    name = f"{mode}.data"

    def rnn(keyset, data, *args):
        if not getattr(_local, "original", False) and _contexts:
            target, choices = _contexts[-1]
            choices.append(choose_rnn(mode, data, packed=True, target=target))
        return _originals[name].call_boxed(keyset, data, *args)

    return rnn


# -- CPU kernels for the cuDNN ops: the CPU's RNN does the math, outputs as the Meta kernel says

def _compute(t: torch.Tensor) -> torch.Tensor:
    """The dtype cuDNN computes a tensor's RNN in (promote_rnn_math_type: half → float)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _cpu_rnn(mode: str, input, hx, cx, weights, has_biases, num_layers, batch_first,
             bidirectional, train):
    """The build's own composite on CPU tensors (dropout 0: dropout stays on the CPU path)."""
    with _original_rnns():
        if mode == "lstm":
            return aten.lstm.input(input, [hx, cx], weights, has_biases, num_layers, 0.0, train,
                                   bidirectional, batch_first)
        return getattr(aten, mode).input(input, hx, weights, has_biases, num_layers, 0.0, train,
                                         bidirectional, batch_first)


def _weights(weight, input, hidden_size, proj_size, num_layers, bidirectional, stride0, mode):
    """The weights in nn.RNNBase's shapes (the autocast wrapper hands (n, 1) views)."""
    shapes = weight_shapes(mode, input.size(-1), hidden_size, proj_size, num_layers,
                           bidirectional, stride0 in (4, 5))
    return [_compute(w).reshape(s) for w, s in zip(weight, shapes, strict=True)]


def _rnn_forward(input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size,
                 proj_size, num_layers, batch_first, dropout, train, bidirectional, batch_sizes,
                 dropout_state):
    name = _MODE_NAMES[mode]
    with no_autocast("cpu"):
        ws = _weights(weight, input, hidden_size, proj_size, num_layers, bidirectional,
                      weight_stride0, name)
        out = _cpu_rnn(name, _compute(input), _compute(hx), None if cx is None else _compute(cx),
                       ws, weight_stride0 in (4, 5), num_layers, batch_first, bidirectional, train)
        output = out[0].to(input.dtype).contiguous()
        hy = out[1].to(hx.dtype).contiguous()
        # The CUDA kernel's cy for GRU/RNN is `at::empty({0}, hx.options())`.
        cy = out[2].to(cx.dtype).contiguous() if cx is not None else hx.new_empty(0)
        if weight_buf is None:  # the weights are copied into a buffer of their own
            weight_buf = torch.cat([w.reshape(-1) for w in weight]).to(input.dtype)
        # cudnnGetRNNTempSpaceSizes is not modelled: the Meta kernel's empty reserve.
        return output, hy, cy, input.new_empty(0, dtype=torch.uint8), weight_buf


def _rnn_backward(input, weight, weight_stride0, weight_buf, hx, cx, output, grad_output,
                  grad_hy, grad_cy, mode, hidden_size, proj_size, num_layers, batch_first,
                  dropout, train, bidirectional, batch_sizes, dropout_state, reserve,
                  output_mask):
    name, result = _MODE_NAMES[mode], cast(dict[str, Any], {})

    def recompute() -> None:  # a fresh thread: autograd on, no modes, no autocast
        try:
            with torch.enable_grad():
                leaves = [_compute(t).detach().requires_grad_() for t in
                          (input, hx, *([cx] if cx is not None else []))]
                ws = [w.detach().requires_grad_() for w in _weights(
                    weight, input, hidden_size, proj_size, num_layers, bidirectional,
                    weight_stride0, name)]
                c = leaves[2] if cx is not None else None
                outs = _cpu_rnn(name, leaves[0], leaves[1], c, ws, weight_stride0 in (4, 5),
                                num_layers, batch_first, bidirectional, train)
                pairs = [(o, _compute(g)) for o, g in zip(outs, (grad_output, grad_hy, grad_cy),
                                                         strict=False)
                         if g is not None]
                result["grads"] = torch.autograd.grad(
                    [o for o, _ in pairs], leaves + ws, [g for _, g in pairs], allow_unused=True)
        except BaseException as e:  # noqa: BLE001 - raised again in the calling thread
            result["error"] = e

    worker = threading.Thread(target=recompute, name="ampscope-rnn-backward")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    grads = list(result["grads"])
    firsts = [input, hx] + ([cx] if cx is not None else [])
    out = [_grad_like(g, t) for g, t in zip(grads, firsts, strict=False)]
    d_weight = [_grad_like(g, w) for g, w in zip(grads[len(firsts):], weight, strict=True)]
    d_input, d_hx = out[0], out[1]
    d_cx = out[2] if cx is not None else None
    mask = list(output_mask)
    return (d_input if mask[0] else None, d_hx if mask[1] else None,
            d_cx if mask[2] else None, d_weight)


def _grad_like(g: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t) if g is None else g.reshape(t.shape).to(t.dtype).contiguous()


def _rnn_backward_meta(input, weight, weight_stride0, weight_buf, hx, cx, *rest):
    return (torch.empty_like(input), torch.empty_like(hx),
            None if cx is None else torch.empty_like(cx), [torch.empty_like(w) for w in weight])


def _flatten_weight(weight_arr, weight_stride0, input_size, mode, hidden_size, proj_size,
                    num_layers, batch_first, bidirectional):
    """_cudnn_rnn_flatten_weight: one zeroed buffer, the weights copied in and then set to
    views of it (copy_weights_to_flat_buf_views with set_orig_weights_to_flat_buf)."""
    first = weight_arr[0]
    buf = first.new_zeros(sum(w.numel() for w in weight_arr))
    offset = 0
    for w in weight_arr:
        buf.narrow(0, offset, w.numel()).view(w.shape).copy_(w)
        # set_(storage, ...) as set_(Tensor) does in C++: storage shared, no view made
        w.set_(buf.untyped_storage(), offset, w.shape, contiguous_strides(w.shape))
        offset += w.numel()
    return buf


def _is_acceptable(tensor: torch.Tensor) -> bool:
    """torch.backends.cudnn.is_acceptable on a GPU with cuDNN (the emulated one). The device
    is not asked: the virtual device answers ampscope's own code with the backing device, and
    during a CUDA emulation every tensor stands for a CUDA one (nn.RNNBase asks `is_cuda`
    before it asks this). Fake weights (a predicted run) are refused: nn.RNNBase would read
    their data pointers, which fake tensors do not have, so their calls get no weight_buf."""
    return (torch.backends.cudnn.enabled and not isinstance(tensor, FakeTensor)
            and tensor.dtype in torch.backends.cudnn.CUDNN_TENSOR_DTYPES)


def _cudnn_mode(mode: str) -> int:
    """torch.backends.cudnn.rnn.get_cudnn_mode: "LSTM" → cuDNN's number for it."""
    if mode.lower() not in private_rnn.CUDNN_MODES:
        raise ValueError(f"Unknown mode: {mode}")
    return private_rnn.CUDNN_MODES[mode.lower()]


def emulable() -> bool:
    """Whether this build has what the emulation needs (`torchcompat.rnn.features`)."""
    return (private_rnn.cudnn_rnn_ops() is not None and private_rnn.get_kernel_found()
            and private_rnn.flatten_switch() is not None
            and private_rnn.cudnn_mode_slot() is not None)


def _register(lib: torch.library.Library) -> None:
    ops = private_rnn.cudnn_rnn_ops()
    assert ops is not None  # (emulable() was asked)
    for mode in MODES:
        for overload, make in (("input", _composite), ("data", _packed)):
            name = f"{mode}.{overload}"
            if name not in _originals:  # read once: later reads would find ours
                _originals[name] = torch.library.get_kernel(
                    getattr(getattr(aten, mode), overload), "AutogradCPU")
            lib.impl(name, make(mode), "CompositeImplicitAutograd", with_keyset=True)
    lib.impl(private_rnn.CUDNN_RNN_NAME, _rnn_forward, "CPU")
    lib.impl(private_rnn.CUDNN_RNN_BACKWARD_NAME, _rnn_backward, "CPU")
    lib.impl(private_rnn.CUDNN_RNN_BACKWARD_NAME, _rnn_backward_meta, "Meta")
    lib.impl(private_rnn.CUDNN_FLATTEN_NAME, _flatten_weight, "CPU")
    lib.impl(private_rnn.CUDNN_FLATTEN_NAME, _flatten_weight, "Meta")


@contextlib.contextmanager
def cuda_rnn(target: CudaTarget = H100) -> Iterator[list[RnnChoice]]:
    """While active, RNNs on CPU (or fake) tensors run the ops `target` would run (as the
    module docstring says). Yields the list of choices made, one per RNN call; without the
    private details it needs (`emulable()`), changes nothing and yields an empty list. Run
    backward inside too. Process-wide: not for concurrent threads."""
    choices: list[RnnChoice] = []
    if not emulable():
        yield choices
        return
    outermost = not _contexts
    switch = private_rnn.flatten_switch()
    assert switch is not None  # (emulable() was asked)
    with contextlib.ExitStack() as stack:
        if outermost:
            stack.callback(destroy_library, overriding_library(_register))
            stack.enter_context(patched(torch.backends.cudnn, "is_acceptable", _is_acceptable))
            stack.enter_context(patched(*switch, lambda: torch.backends.cudnn.enabled))
            # flatten_parameters() flattens under `torch.cuda.device_of(weight)`: the one
            # emulated device is always current, and a CPU build cannot switch to it.
            stack.enter_context(patched(torch.cuda, "device_of",
                                        lambda obj: contextlib.nullcontext()))
            # ... and asks cuDNN's mode number of the bindings a CPU build lacks.
            mode_slot = private_rnn.cudnn_mode_slot()
            assert mode_slot is not None  # (emulable() was asked)
            stack.enter_context(patched(*mode_slot, _cudnn_mode))
        _contexts.append((target, choices))
        stack.callback(_contexts.pop)
        yield choices


def rnn_notes(choices: Sequence[RnnChoice], target: CudaTarget = H100) -> list[str]:
    """The trace's lines on the RNN calls of an emulated CUDA run (none without any)."""
    ran = Counter(c.mode for c in choices if c.cudnn)
    kept = Counter(f"{c.mode} ({c.reason})" for c in choices if not c.cudnn)
    notes = []
    if ran:
        calls = ", ".join(f"{mode} × {n}" for mode, n in ran.items())
        op = private_rnn.CUDNN_RNN_NAME
        notes.append(f"RNNs ran cuDNN's kernels ({op}) as PyTorch does on "
                     f"{article(target.name)} {target.name}: "
                     f"{calls}; under autocast in float16, as {op}'s autocast wrapper "
                     "casts whatever the autocast dtype.")
    if kept:
        calls = ", ".join(f"{what} × {n}" for what, n in kept.items())
        notes.append(f"RNN calls that kept the CPU's kernel: {calls}.")
    return notes
