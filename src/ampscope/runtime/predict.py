"""Predict mode: the run on fake tensors, so models of any size trace in seconds and megabytes.

A `FakeTensorMode` gives every tensor its shape, dtype, device and strides but no storage:
every op still dispatches (autocast, autograd, the optimizer, and ampscope's recorders all see
the same calls they would see in a real run) and computes only the metadata of its results.
The model is built on the meta device, so its weights are never materialised either; the run's
working copies of them are fake tensors on the device the run stands for.

What a fake run cannot do is look at values: code that branches on them (`if loss.item() > x`,
early stopping in a sampler, GradScaler's check for infinities) has nothing to read.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import re
import weakref
from collections.abc import Iterator

import torch

from ampscope.errors import AmpscopeError, first_line
from ampscope.quiet import loggers_quiet
from ampscope.runtime.norm_stats import TargetNormStats, zeros_of
from ampscope.torchcompat import fake, optim
from ampscope.torchcompat.dispatch import (
    OpOverload,
    dispatch_mode_stack,
    is_traceable_wrapper_subclass,
    modes_off,
)
from ampscope.torchcompat.fake import FakeTensor, FakeTensorConfig, FakeTensorMode
from ampscope.torchcompat.ops import FAKE_TENSOR_LOGGER
from ampscope.torchcompat.policy import no_autocast
from ampscope.tricks import Trick, enabled


def fake_mode() -> FakeTensorMode:
    # Real tensors the model keeps outside its parameters and buffers (a cached mask, a
    # constant) are converted on use rather than refused.
    return PredictMode(allow_non_fake_inputs=True)


class PredictMode(FakeTensorMode):
    """A predicted run's FakeTensorMode: where a fake implementation refuses a call for its
    dtypes, the error is the real kernel's, in its words (`real_kernel_error`): the user reads
    what the real run would print, not what PyTorch's meta kernels say instead."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as e:
            if (converted := self._complex_views_converted(args)) is not None:
                return super().__torch_dispatch__(func, types, converted, kwargs)
            if not DTYPE_MISMATCH.search(str(e)):
                raise
            real = real_kernel_error(func, args, kwargs or {})
            if real is None:  # the kernel runs these dtypes, or the question has no answer
                raise
            raise real from e

    def _complex_views_converted(self, args: tuple) -> tuple | None:
        """`args` with each real complex view of a real base (a rotary cache the model keeps
        outside its buffers) made fake by `fake.fake_complex_view`, which the converter fails
        on; None where there is none (the error was another)."""
        converted = tuple(fake.fake_complex_view(self, a) for a in args)
        if all(c is None for c in converted):
            return None
        return tuple(a if c is None else c for a, c in zip(args, converted, strict=True))


def gc_paused() -> contextlib.AbstractContextManager[None]:
    """Pause the cyclic garbage collector for a fake run, and while ampscope builds a model or
    its records: tens of thousands of small records and fake tensors would otherwise trigger
    full collections that cost a fifth of the run, and none of it is memory worth reclaiming
    early. The collector's state comes back."""
    return gc_enabled(False)


@contextlib.contextmanager
def gc_enabled(enabled: bool) -> Iterator[None]:
    """The cyclic garbage collector on or off while entered, as it was afterwards (a real run
    inside a paused stretch collects as the user's process would)."""
    was_enabled = gc.isenabled()
    if enabled:
        gc.enable()
    else:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        else:
            gc.disable()


aten = torch.ops.aten
# Matmuls: the CPU and CUDA kernels refuse operands of two dtypes, their meta kernels (what a
# fake run has) do not check.
_MATMULS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.mv.default, aten.addmv.default, aten.dot.default, aten.addbmm.default,
})

# How PyTorch words a dtype mismatch (matmul, linear, addmm, index ops, conv, norms, ...), in
# the real kernels' words and in the fake ones'.
DTYPE_MISMATCH = re.compile(
    r"same dtype|expected scalar type|dtype mismatch|must have the same|same type as|"
    r"expected (both|all) .*dtype|Input type .* and (weight|bias) type|found dtype|dtypes match|"
    r"mixed dtype|expected .*(Float|Half|BFloat16|Double)", re.I)


def check_matmul_dtypes(func: OpOverload, args: tuple) -> None:
    """Raise, as the real kernel would, when a matmul's operands differ in dtype: with the real
    kernel's own words (`real_kernel_error`). An `OpRecorder.check`: one more Python mode would
    cost a tenth of a large fake run."""
    if func not in _MATMULS:
        return
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # A wrapper subclass (a float8 training tensor) runs the op by its own rules, on the data
    # it holds: no kernel sees the dtypes it shows.
    if len({t.dtype for t in tensors}) > 1 and not any(map(is_traceable_wrapper_subclass,
                                                           tensors)):
        error = real_kernel_error(func, args, {})
        if error is not None:
            raise error


def real_kernel_error(func: OpOverload, args: tuple, kwargs: dict) -> RuntimeError | None:
    """What the real kernel raises for a call with these arguments' dtypes, or None when it
    runs (or the question has no answer here). The call runs on tiny real CPU tensors of the
    same dtypes; on a fake CUDA tensor, an error whose CUDA wording differs (known from
    PyTorch's CUDA source: `_CUDA_WORDS`) is given in those words."""
    device = _device_of_run(args)
    try:
        key = (func, _signature(args), _signature(tuple(kwargs.items())))
        message = _real_error(*key)
    except (TypeError, ValueError):  # an argument this cannot copy (a generator, a symbol)
        return None
    if message is None:
        return None
    words = _CUDA_WORDS.get(func) if device == "cuda" else None
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
    return RuntimeError(words(*dtypes) if words is not None else message)


def _device_of_run(args: tuple) -> str:
    """The device the run stands for: an emulation's (its norm-statistics mode names it; its
    fake tensors live on the CPU below the virtual device), else the arguments' own."""
    for mode in dispatch_mode_stack():
        if isinstance(mode, TargetNormStats) and mode.device is not None:
            return mode.device
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")


# The CUDA kernel's words where they differ from the CPU kernel's for the same dtypes. `mm` on
# the CPU checks in `addmm_impl_cpu_` ("expected m1 and m2 ..."); on CUDA in
# `addmm_out_cuda_impl` (ATen's cuda/Blas.cpp), which prints two `TypeMeta`s.
_TYPE_META = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16"}
_CUDA_WORDS = {
    aten.mm.default: lambda a, b, *_: (
        "expected mat1 and mat2 to have the same dtype, but got: "
        f"{_TYPE_META.get(a, str(a))} != {_TYPE_META.get(b, str(b))}"),
}


def _signature(value) -> object:
    """A call's arguments as a hashable key: each tensor by its dtype and shape."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(int(n) for n in value.shape))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device,
                                           torch.layout, torch.memory_format)):
        return value
    raise TypeError(type(value).__name__)


# A call's arguments larger than this (elements, all tensors together) are not made at their
# own shapes when the tiny ones do not settle the question.
_REAL_SIZE_LIMIT = 1 << 16


@functools.lru_cache(maxsize=256)
def _real_error(func: OpOverload, args: tuple, kwargs: tuple) -> str | None:
    """The real CPU kernel's error for a signature (`_signature`), in its own words. First on
    tensors of one element each (a kernel checks dtypes before shapes, and every shape is then
    compatible with every other); when that does not fail on a dtype, on zeros of the call's
    own shapes, if they are small."""
    tiny = _run_real(func, args, kwargs, tiny=True)
    if tiny is None or DTYPE_MISMATCH.search(tiny):
        return tiny
    if _elements(args) + _elements(kwargs) > _REAL_SIZE_LIMIT:
        return None
    return _run_real(func, args, kwargs, tiny=False)


def _run_real(func: OpOverload, args: tuple, kwargs: tuple, *, tiny: bool) -> str | None:
    with modes_off(), no_autocast("cpu"), torch.no_grad():
        real_args = zeros_of(args, "cpu", tiny=tiny)
        real_kwargs = dict(zeros_of(kwargs, "cpu", tiny=tiny))
        try:
            func(*real_args, **real_kwargs)
        except Exception as e:  # noqa: BLE001 - the kernel's refusal is the answer
            return first_line(e)
    return None


def _elements(signature) -> int:
    if isinstance(signature, tuple) and signature[:1] == ("tensor",):
        return math.prod(signature[2])
    if isinstance(signature, tuple):
        return sum(_elements(s) for s in signature)
    return 0


def quiet_fake_tensor_log() -> contextlib.AbstractContextManager[None]:
    """FakeTensor logs a traceback at ERROR before re-raising a failing meta kernel; ampscope
    reports the error itself, in one line."""
    return loggers_quiet(FAKE_TENSOR_LOGGER, level=logging.CRITICAL)


@contextlib.contextmanager
def predicting(mode: FakeTensorMode) -> Iterator[None]:
    """Everything a fake run needs around it: the fake mode, a quiet log, a paused garbage
    collector (the dtype checks its meta kernels lack go to the Capture: check_matmul_dtypes),
    PyTorch's foreach defaults as for real tensors and norm statistics as the kernels keep them."""
    with mode, quiet_fake_tensor_log(), gc_paused(), foreach_defaults_as_real(), \
            norm_stats_as_real():
        yield


@contextlib.contextmanager
def norm_stats_as_real() -> Iterator[None]:
    """Norm statistics in the dtypes the real kernel of each fake tensor's device keeps them
    in (runtime/norm_stats.py: PyTorch's fake CPU norms give bf16 statistics where the CPU
    kernel gives float32 ones). An emulation's own norm-statistics mode, already active, says
    the same for its device: then nothing is added."""
    if any(isinstance(m, TargetNormStats) for m in dispatch_mode_stack()):
        yield
        return
    with TargetNormStats(None):
        yield


@contextlib.contextmanager
def foreach_defaults_as_real() -> Iterator[None]:
    """PyTorch picks an optimizer's implementation (`foreach=None`), and `clip_grad_norm_`'s,
    by the parameters' class and device: on CUDA, foreach for `torch.Tensor` and `Parameter`
    and the for-loop for any other class, a fake tensor included. A fake run would then take
    the for-loop where the real run takes foreach: other ops, and a peak without foreach's
    temporaries. While entered, a fake tensor counts as the tensor it stands for; the two
    lists PyTorch reads are put back as they were."""
    added = [types for types in optim.foreach_supported_types() if FakeTensor not in types]
    for types in added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in added:
            types.remove(FakeTensor)


def new_fake(mode: FakeTensorMode, shape: tuple[int, ...], stride: tuple[int, ...],
             dtype: torch.dtype, device: torch.device | str,
             constant: torch.Tensor | None = None) -> FakeTensor:
    """A new fake tensor of `mode` with a storage of its own, as `torch.empty_strided` makes
    one under the mode, seen by no mode.

    It is made the way FakeTensorMode answers `empty_strided` from its cache (an empty meta
    tensor wrapped with its device), without the dispatch through every mode on the stack: a
    fifth of the cost, and a large model's predicted step makes thousands (working copies of
    its weights, a replayed block's outputs and gradients). The wrapping itself is learned: the
    first fake tensor of a mode and device is made by `FakeTensor(...)`, and later ones are the
    same C++ tensor subclass given the same attributes (its fake mode, device and empty memos),
    at a third of the cost.

    With `constant` (a small real tensor of that metadata, which the fake tensor then owns),
    it is a fake constant, as FakeTensorMode's converter makes one: the mode follows its
    value through ops on constants only and reads it back for `.item()`."""
    with modes_off():
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return _wrapped(mode, meta, device, constant)


def wrap_fake(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device | str) -> FakeTensor:
    """`FakeTensor(mode, meta, device)`: `meta` (a meta tensor no other fake tensor wraps) as a
    fake tensor of `mode` on `device`, wrapped as `new_fake` wraps its own."""
    with modes_off():
        return _wrapped(mode, meta, device, None)


def _wrapped(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device | str,
             constant: torch.Tensor | None) -> FakeTensor:
    """`wrap_fake`'s work, with the modes already off (the subclass is made from `meta` by a
    detach, an op no mode may see)."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if FakeTensorConfig.debug or meta.requires_grad:
        return FakeTensor(mode, meta, device, constant=constant)
    learned = _fresh.setdefault(mode, {})
    known = learned.get(device)
    if known is None:
        made = FakeTensor(mode, meta, device)
        # Whether to clone is decided once per mode and device (a run's): the clone trick is
        # off on the exact path and where this build makes fake tensors otherwise.
        cloner = fake.clone_wrap() if enabled(Trick.CLONE) else None
        # Kept without the mode itself: a value of `_fresh` that held its key would keep the
        # mode, and everything its converter holds, alive for the rest of the process.
        learned[device] = (cloner, cloner.learn(made)) if cloner is not None else _CONSTRUCT
        made.constant = constant
        return made
    if known is _CONSTRUCT:
        return FakeTensor(mode, meta, device, constant=constant)
    cloner, first = known
    return cloner.make(mode, meta, first, constant)


_CONSTRUCT = (None, None)  # a mode and device whose fake tensors FakeTensor(...) makes


# What FakeTensor.__new__ gave a new fake tensor, by mode and device: the device it normalized
# (cuda -> cuda:0) and the instance attributes it set but the mode (with no constant; new_fake
# sets its own).
_fresh: weakref.WeakKeyDictionary[FakeTensorMode, dict[torch.device, tuple]] \
    = weakref.WeakKeyDictionary()


def fake_like(t: torch.Tensor, mode: FakeTensorMode, *, dtype: torch.dtype,
              device: torch.device) -> FakeTensor:
    """A fake tensor with `t`'s shape and strides, in `dtype` on `device` (no storage)."""
    return new_fake(mode, tuple(t.shape), tuple(t.stride()), dtype, device)


def fake_parameter(t: FakeTensor, requires_grad: bool) -> torch.nn.Parameter:
    """`nn.Parameter(t)` for a new fake tensor that nothing else holds.

    For a tensor subclass, `Parameter` detaches its argument, so that the parameter is not the
    caller's tensor, and marks the detached tensor as a parameter. A working copy is nobody's
    tensor: it is marked itself, which skips a detach through FakeTensorMode per parameter
    (723 on a 70B Llama)."""
    t.requires_grad_(requires_grad)
    if fake.mark_parameter(t):
        return t  # type: ignore[return-value]
    return torch.nn.Parameter(t, requires_grad)


def fake_batch(batch: dict[str, torch.Tensor], mode: FakeTensorMode) -> dict[str, torch.Tensor]:
    return {
        name: mode.from_tensor(t) if isinstance(t, torch.Tensor) and not t.is_meta
        else fake_like(t, mode, dtype=t.dtype, device=torch.device("cpu"))
        for name, t in batch.items()
    }


def data_dependent(e: BaseException) -> bool:
    """Did a fake run stop because code asked for a value (`.item()`, `bool(tensor)`)?"""
    names = {"DataDependentOutputException", "DynamicOutputShapeException",
             "GuardOnDataDependentSymNode"}
    return isinstance(e, fake.data_dependent_errors()) or type(e).__name__ in names


def value_needed_error(model_name: str, workload: str, e: BaseException) -> AmpscopeError:
    op = getattr(e, "func", None)
    what = f" ({op})" if op is not None else ""
    return AmpscopeError(
        f"predict mode cannot run the {workload} workload of {model_name}: the code reads a "
        f"tensor's value{what}, and fake tensors have none; trace a smaller configuration for "
        "real, or use the train/forward workload"
    )
