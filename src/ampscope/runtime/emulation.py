"""Another device's autocast, on CPU tensors: what a CUDA or MPS run would do, without one.

Tensors stay on the CPU (real, or fake in predict mode) and CPU autocast is on, so every op
autocast cares about passes the `AutocastCPU` dispatch key. For the duration of the run the
kernels at that key are replaced, through a `torch.library.Library` that is destroyed
afterwards, by kernels that do what the target device's autocast kernels do: the target's op
list and each op's category come from the build itself (`precision.autocast_policy`), and the casting
rules follow PyTorch's autocast_mode.h (`cached_cast`, `promote_type`, `set_opt_dtype`):

- only floating tensors that are not float64 are cast;
- casts to the autocast dtype of fp32 leaf tensors that require grad (the weights) are cached
  until the outermost autocast region ends, so a weight used twice is cast once;
- ops the CPU lists and the target does not (`cat`, `cross_entropy_loss`, ...) pass through.

`TargetKernels` gives an op the target runs as one kernel and the CPU decomposes a CPU kernel
for the duration (docs/emulation.md: `_fused_rms_norm` on a CUDA-built wheel).

Backward runs without autocast, on the dtypes forward produced, exactly as on the target.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING
from typing import cast as cast_type

import torch

from ampscope.errors import AmpscopeError
from ampscope.hardware.device_types import device_type
from ampscope.nested import tensors_in
from ampscope.runtime.autocast_key import (
    cpu_key_dtype,
    eligible,
    key_state,
    set_key_state,
)
from ampscope.runtime.autocast_policy import OpPolicy, op_overload, read_policy, registered_ops
from ampscope.runtime.user_frames import NOT_USERS
from ampscope.torchcompat import ops as private_ops
from ampscope.torchcompat import optim
from ampscope.torchcompat import policy as dispatcher
from ampscope.torchcompat.dispatch import OpOverload, op_schema
from ampscope.torchcompat.ops import FUSED_RMS_NORM_NAMES
from ampscope.torchcompat.policy import destroy_library, no_autocast, overriding_library
from ampscope.wording import article

if TYPE_CHECKING:
    from ampscope.runtime.attention_choice import CudaTarget

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)

aten = torch.ops.aten

_active: TargetAutocast | None = None

def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    tensors = tensors_in((args, kwargs))
    return tensors[0] if tensors else None


def _widest(args: tuple, kwargs: dict, start: torch.dtype) -> torch.dtype:
    """autocast's promote_type: float64 > float32 > the lower-precision start dtype."""
    wide = any(eligible(t) and t.dtype == torch.float32 for t in tensors_in((args, kwargs)))
    return torch.float32 if wide else start


class TargetAutocast:
    """While entered, CPU autocast follows `device`'s autocast policy for `dtype`."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device = device
        self.policy: dict[str, OpPolicy] = read_policy(device, dtype)
        self._library: torch.library.Library | None = None
        # id(weight) -> (weakref to it, its cast copy): autocast's cast cache
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def _cast(self, value, dtype: torch.dtype):
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        if not eligible(value) or value.dtype == dtype:
            return value
        cacheable = (
            dtype == cpu_key_dtype()
            and value.dtype == torch.float32
            and value.requires_grad
            and value.is_leaf
            and not dispatcher.is_view(value)
            and torch.is_autocast_cache_enabled()
        )
        if cacheable:
            hit = self._cache.get(id(value))
            if hit is not None and hit[0]() is value:
                return hit[1]
        cast = value.to(dtype)
        if cacheable:
            self._cache[id(value)] = (weakref.ref(value), cast)
        return cast

    def clear_cache(self) -> None:
        self._cache.clear()

    def _kernel(self, rule: OpPolicy, op: OpOverload) -> Callable:
        schema_names = [a.name for a in op_schema(op).arguments]
        # Where `dtype` stands among the positional arguments (-1: it is keyword-only or none).
        dtype_index = schema_names.index("dtype") if "dtype" in schema_names else -1
        dtype_positional = dtype_index >= 0 and not op_schema(op).arguments[dtype_index].kwarg_only
        # The op an `append_dtype` rule calls instead (its rules always name one).
        redirect = cast_type(OpOverload, op_overload(rule.redirect) if rule.redirect else None)
        cast = self._cast

        def casting(dtype_of: Callable[[tuple, dict], torch.dtype]) -> Callable:
            """lower, fp32, promote: every argument cast to the dtype `dtype_of` picks."""

            def kernel(*args, **kwargs):
                with no_autocast("cpu"):
                    dtype = dtype_of(args, kwargs)
                    return op(*cast(args, dtype), **{k: cast(v, dtype) for k, v in kwargs.items()})

            return kernel

        def set_opt_dtype(*args, **kwargs):
            # Only when the first tensor is eligible, and never over a dtype the caller gave.
            with no_autocast("cpu"):
                if eligible(_first_tensor(args, kwargs)):
                    if dtype_positional and dtype_index < len(args):
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)

        def append_dtype(*args, **kwargs):
            with no_autocast("cpu"):
                if eligible(_first_tensor(args, kwargs)):
                    return redirect(*args, **kwargs, dtype=torch.float32)
                return op(*args, **kwargs)

        def banned(*args, **kwargs):
            raise RuntimeError(rule.message)

        return {
            "lower": casting(lambda args, kwargs: cpu_key_dtype()),
            "fp32": casting(lambda args, kwargs: torch.float32),
            "promote": casting(lambda args, kwargs: _widest(args, kwargs, cpu_key_dtype())),
            "fp32_set_opt_dtype": set_opt_dtype,
            "fp32_append_dtype": append_dtype,
            "banned": banned,
        }.get(rule.category, torch.library.fallthrough_kernel)

    def _register(self, library: torch.library.Library) -> None:
        for name in sorted(set(registered_ops("cpu")) | set(self.policy)):
            op = op_overload(name)
            rule = self.policy.get(name)
            kernel = self._kernel(rule, op) if rule is not None else torch.library.fallthrough_kernel
            library.impl(op, kernel, "AutocastCPU")

    def __enter__(self) -> TargetAutocast:
        global _active
        self._library = overriding_library(self._register)
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        self.clear_cache()
        if self._library is not None:
            destroy_library(self._library)  # PyTorch's own AutocastCPU kernels are back
            self._library = None


# --- fused kernels the target has and the CPU decomposes -------------------------------------


def _fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    """The fused kernel's results: (output in the input's dtype, 1/rms in fp32), from the op's
    own composite (the math the CPU runs, without the dispatcher seeing its pieces)."""
    with no_autocast("cpu"):
        return private_ops.FUSED_RMS_NORM.decompose(input, normalized_shape, weight, eps)


def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """d/dx of y = x·r·w with r = 1/sqrt(mean(x²) + eps) over the normalized dims:
    r·(g·w − x·r²·mean(g·w·x)); d/dw: the sum of g·x·r over the other dims. In fp32, each
    result in its input's dtype, as the device kernel returns them."""
    with no_autocast("cpu"):
        lead = input.dim() - len(normalized_shape)
        x, g, r = input.float(), grad_out.float(), rstd.float()
        gw = g * weight.float() if weight is not None else g
        grad_input = grad_weight = None
        if output_mask[0]:
            mean = (gw * x).mean(tuple(range(lead, input.dim())), keepdim=True)
            grad_input = (r * (gw - x * r * r * mean)).to(input.dtype)
        if output_mask[1] and weight is not None:
            grad_weight = (g * x * r).sum(tuple(range(lead))).to(weight.dtype)
        return grad_input, grad_weight


# op -> its CPU kernel, for ops a device may run as one kernel where the CPU decomposes them;
# the backward op that op's autograd formula calls is listed with it.
FUSED_KERNELS: dict[str, Callable] = {
    FUSED_RMS_NORM_NAMES[0]: _fused_rms_norm,
    FUSED_RMS_NORM_NAMES[1]: _fused_rms_norm_backward,
}


def fused_on(device: str) -> tuple[str, ...]:
    """The ops of FUSED_KERNELS this build runs as a kernel of their own on `device` while the
    CPU runs them as a composite (none on a CPU-only build)."""
    return tuple(name for name in FUSED_KERNELS
                 if dispatcher.has_kernel(name, dispatcher.backend_key(device))
                 and not dispatcher.has_kernel(name, "CPU"))


class TargetKernels:
    """While entered, the ops `fused_on(device)` names have CPU kernels doing what the
    device's do, so that CPU tensors call them where the device calls them."""

    def __init__(self, device: str) -> None:
        self.ops = fused_on(device)
        self._library: torch.library.Library | None = None

    def __enter__(self) -> TargetKernels:
        if self.ops:
            self._library = overriding_library(self._register)
        return self

    def _register(self, library: torch.library.Library) -> None:
        for name in self.ops:
            library.impl(op_overload(name), FUSED_KERNELS[name], "CPU")

    def __exit__(self, *exc) -> None:
        if self._library is not None:
            destroy_library(self._library)  # the CPU's composites are back
            self._library = None


@contextlib.contextmanager
def autocast_region(dtype: torch.dtype) -> Iterator[None]:
    """The emulated run's `torch.autocast`: autocast at the CPU's key (whose kernels the active
    TargetAutocast replaced), entered and left as `torch.autocast` does, with the emulated
    cast cache emptied when the region ends. The key is set directly, never through torch's
    state functions, which the virtual device answers per device type."""
    before, cache = key_state("cpu"), torch.is_autocast_cache_enabled()
    set_key_state("cpu", True, dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        set_key_state("cpu", *before)
        torch.set_autocast_cache_enabled(cache)
        if _active is not None and not before[0]:  # the key's state, as just set back
            _active.clear_cache()


def clear_active_cache() -> None:
    """Empty the emulated cast cache of the emulation in force, if one is."""
    if _active is not None:
        _active.clear_cache()


def foreach_by_default(device: str) -> bool:
    """Whether PyTorch's optimizers pick their `_foreach_*` implementation on `device` (they do
    on CUDA, and fall back to a per-parameter loop on the CPU)."""
    return device in optim.foreach_devices()


def _cudnn(version: int | None) -> str:
    """cudnnGetVersion's 92000 as "9.20.0"."""
    if version is None:
        return "none"
    return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"


class Emulation:
    """Everything an emulated run changes, for its duration: the target's autocast policy, the
    dtypes its norm kernels keep their statistics in (`runtime/norm_stats.py`) and, where the
    device's entry in hardware/device_types.py says so, the attention kernels its GPU would
    pick (`runtime/attention_choice.py`), CUDA's float16 GEMM and integer `histc`
    (`runtime/half_matmul.py`, `runtime/integer_histc.py`) and cuDNN's RNN kernels
    (`runtime/rnn_kernels.py`).
    `gpu`: the GPU whose attention kernel choice is made (its compute capability: the one the
    virtual device reports); None: the H100 of attention_choice.py."""

    def __init__(self, device: str, autocast_dtype: torch.dtype | None,
                 gpu: CudaTarget | None = None) -> None:
        from ampscope.runtime.attention_choice import H100

        self.device = device
        self.autocast_dtype = autocast_dtype
        self.gpu = gpu or H100
        self.attention: list = []  # AttentionChoice per SDPA call (CUDA only)
        self.rnn: list = []  # RnnChoice per nn.LSTM/GRU/RNN call (CUDA only)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Emulation:
        from ampscope.runtime.attention_kernels import cuda_attention
        from ampscope.runtime.half_matmul import half_matmuls
        from ampscope.runtime.integer_histc import integer_histc
        from ampscope.runtime.norm_stats import TargetNormStats

        with self._stack as stack:
            stack.enter_context(TargetKernels(self.device))
            stack.enter_context(TargetNormStats(self.device))
            if self.autocast_dtype is not None:
                stack.enter_context(TargetAutocast(self.device, self.autocast_dtype))
            entry = device_type(self.device)
            if entry.attention == "cuda":
                self.attention = stack.enter_context(cuda_attention(self.gpu))
                # The GPU's float16 GEMM: float32 accumulation, one rounding (half_matmul.py).
                stack.enter_context(half_matmuls())
                # Integer histc, which the CPU refuses (a MoE layer's tokens per expert).
                stack.enter_context(integer_histc())
            if entry.rnn == "cudnn":
                from ampscope.runtime.rnn_kernels import cuda_rnn

                self.rnn = stack.enter_context(cuda_rnn(self.gpu))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def notes(self, workload: str, forward_ops: Sequence[str],
              attention_calls: int | None = None) -> list[str]:
        """What the run assumed, in plain words, for the trace's notes. `forward_ops`, the names
        of the forward ops the trace recorded, count the attention calls: a replayed block's
        among them, which chose no kernel of its own (runs/repeats.py)."""
        notes = [
            f"Emulated {self.device} on the CPU: autocast followed the {self.device} policy "
            f"read from this PyTorch build ({torch.__version__})."
        ]
        if workload == "train" and foreach_by_default(self.device):
            notes.append(
                f"The optimizer ran its _foreach_ implementation, as PyTorch picks on {self.device}."
            )
        notes += self.kernel_notes(forward_ops, attention_calls)
        for note in notes:
            log.info("%s", note)
        return notes

    def kernel_notes(self, forward_ops: Sequence[str],
                     attention_calls: int | None = None) -> list[str]:
        """The kernels the emulation chose as the device would (attention, RNNs), or says it
        could not; `forward_ops` as for `notes`, `attention_calls` the trace's calls of
        `scaled_dot_product_attention` in those phases."""
        gpu = self.gpu
        notes: list[str] = []
        ran_ops = Counter(forward_ops)
        # The math path is a composite: its op is never recorded, only what it decomposes to.
        # Its calls are those of the trace the fused kernels do not account for (a replayed
        # block's included), or else the choices made here (a replayed block's not among them).
        fused = sum(ran_ops[op] for op in {c.forward_op for c in self.attention})
        chosen = Counter(c.forward_op for c in self.attention)
        kernels = {f"{c.backend} ({c.forward_op.removesuffix('.default')})":
                   ran_ops[c.forward_op] or (chosen[c.forward_op] if attention_calls is None
                                             else attention_calls - fused)
                   for c in self.attention}
        if kernels:
            ran = ", ".join(f"{k} × {n}" for k, n in kernels.items())
            notes.append(
                "scaled_dot_product_attention ran the kernels PyTorch "
                f"{torch.__version__.split('+')[0]} picks on {article(gpu.name)} {gpu.name} "
                f"(sm{gpu.capability[0]}{gpu.capability[1]}, CUDA {gpu.cuda_version[0]}."
                f"{gpu.cuda_version[1]}, cuDNN {_cudnn(gpu.cudnn_version)}) for these dtypes and "
                f"shapes: {ran}."
            )
        elif device_type(self.device).attention != "cuda":
            notes.append(
                f"Attention kernels are the CPU's: ampscope does not model {self.device}'s "
                "choice of scaled_dot_product_attention kernel."
            )
        if self.rnn:
            from ampscope.runtime.rnn_kernels import rnn_notes

            notes += rnn_notes(self.rnn, self.gpu)
        return notes


def device_api_error(e: BaseException, device: str) -> AmpscopeError | None:
    """The one-line error for model code that needs the real device during an emulated run
    (`torch.cuda.synchronize()`, `x.cuda()`, `torch.zeros(..., device="cuda")`), naming the call
    and the line that made it; None when `e` is something else."""
    import os
    import traceback

    backend_dir = os.path.join(os.path.dirname(torch.__file__), device) + os.sep
    frames = traceback.extract_tb(e.__traceback__)
    inside = [i for i, f in enumerate(frames) if f.filename.startswith(backend_dir)]
    if not inside:
        return None
    first = inside[0]
    api = frames[first].name
    # The line that made the call: the innermost frame before it outside torch and ampscope
    # (ampscope's function recorder sits between user code and `x.cuda()`).
    caller = next((f for f in reversed(frames[:first])
                   if not f.filename.startswith(NOT_USERS)), None)
    public = api if not api.startswith("_") else None
    what = f"torch.{device}.{public}()" if public else f"a {device} tensor or torch.{device} call"
    where = f" at {os.path.basename(caller.filename)}:{caller.lineno}" if caller else ""
    return AmpscopeError(
        f"the model code{where} needs {what}, which cannot be emulated: this machine has no "
        f"{device}; keep device calls out of the traced step (or guard them with "
        f"torch.{device}.is_available()), or trace on a machine with the device"
    )
