"""Autocast policies read from the installed PyTorch build, for any device it has kernels for.

The op list is the dispatcher's registrations at the device's Autocast key (`AutocastCUDA`, ...);
what autocast does to each op is found by calling it on fake tensors of the target device under
its autocast (`probe`; docs/emulation.md, "The policy is read from the build", says how). Three
calls per op tell the categories of PyTorch's autocast_mode.h apart:

    all inputs fp32        → cast to the autocast dtype       lower (runs in lower precision)
    all inputs low         → cast to fp32                     fp32
                           → op called with dtype=float32     fp32_set_opt_dtype
                           → another overload with a dtype    fp32_append_dtype
    low + fp32 inputs      → the low input cast to fp32       promote (to the widest input)
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ampscope.errors import AmpscopeError, first_line
from ampscope.nested import tensors_in
from ampscope.runtime.autocast_key import key_state
from ampscope.torchcompat import ops as private_ops
from ampscope.torchcompat import policy as dispatcher
from ampscope.torchcompat.dispatch import OpOverload, TorchDispatchMode, op_schema
from ampscope.torchcompat.fake import FakeTensorMode

CATEGORIES = (
    "lower",  # floating inputs cast to the autocast dtype (matmuls, convolutions, linear)
    "fp32",  # floating inputs cast to float32 (softmax, layer_norm, exp, losses on CUDA)
    "fp32_set_opt_dtype",  # called with dtype=float32 unless the caller gave one (sum, cumsum)
    "fp32_append_dtype",  # redirected to an overload that takes dtype=float32 (norm)
    "promote",  # floating inputs cast to the widest among them (addcmul, cat on CPU)
    "banned",  # refuses to run under autocast (binary_cross_entropy on CUDA)
    "unclassified",  # the probe could not tell; the op passes through unchanged
)


@dataclass(frozen=True)
class OpPolicy:
    """What `device`'s autocast does to one op overload."""

    op: str  # dispatcher name, e.g. "aten::softmax.int"
    category: str  # one of CATEGORIES
    redirect: str | None = None  # fp32_append_dtype: the overload it calls, "aten::norm.ScalarOpt_dtype"
    message: str | None = None  # banned: the error autocast raises


def registered_ops(device: str) -> tuple[str, ...]:
    """Ops with an autocast kernel for `device` in this build, sorted; empty if none."""
    names = dispatcher.registrations(dispatcher.autocast_key(device))
    return tuple(sorted(n for n in names if n.startswith("aten::")))


def op_overload(name: str) -> OpOverload:
    """`aten::softmax.int` → torch.ops.aten.softmax.int (`aten::sum` → .default)."""
    namespace, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def default_autocast_dtype(device: str) -> torch.dtype:
    """The device's default autocast dtype in this build (cuda: float16, cpu: bfloat16).

    Autocast state is thread-local, so a fresh thread sees the build's default even when this
    thread changed it.
    """
    result: list[torch.dtype] = []
    thread = threading.Thread(target=lambda: result.append(key_state(device)[1]))
    thread.start()
    thread.join()
    return result[0]


# --- probing -----------------------------------------------------------------------------


class _Stop(Exception):
    """Raised once the op itself is reached below autocast: its arguments are all we need."""


@dataclass(frozen=True)
class ProbeResult:
    casts: tuple[torch.dtype, ...]  # target dtypes of the _to_copy calls autocast made
    op: str | None  # the overload autocast called, "aten::sum" (None if it never got there)
    in_dtypes: tuple[torch.dtype, ...]  # dtypes of the tensors the op received
    dtype_arg: torch.dtype | None  # the dtype argument it received
    error: str | None  # what the call raised before reaching the op


class _CastWatcher(TorchDispatchMode):
    """Sees the `_to_copy` casts autocast makes (they run below it, as ordinary ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is private_ops.TO_COPY:
            self.casts.append(kwargs.get("dtype"))
        return func(*args, **kwargs)


# A named dimension, as the dispatcher parses one from a string. The op never resolves it: it
# is caught below autocast before any kernel looks the name up among the tensor's.
_DIMNAME = "dimname::d"


def _dummy(kind: str, make_tensor: Callable[[], torch.Tensor], named: bool = False):
    """A value of the argument kind (`argument_kind`): shapes and values do not matter, the op
    never runs. `named`: strings are named dimensions."""
    if kind == "tensor":
        return make_tensor()
    if kind == "tensor_list":
        return [make_tensor(), make_tensor()]
    # The one plain string argument among autocast ops is a norm's `ord`.
    text = _DIMNAME if named else "fro"
    return {
        "list": [1],
        "int": 1,
        "float": 2.0,
        "bool": False,
        "str": text,
        "str_list": [text],
    }.get(kind)


def probe(name: str, device: str, dtype: torch.dtype, input_dtypes: list[torch.dtype]) -> ProbeResult:
    """Call op `name` under `device`'s autocast on fake tensors whose dtypes are taken in turn
    from `input_dtypes` (the last repeats) and report what autocast handed to the op.

    The op is caught right below autocast by a kernel registered, for the duration, at the
    device's Autograd key for every overload of the op (autocast may redirect to another
    overload), so composite ops are seen before they decompose.
    """
    op = op_overload(name)
    packet = getattr(torch.ops.aten, name.partition("::")[2].partition(".")[0])
    reached: dict = {}

    def catch(overload):
        def kernel(*args, **kwargs):
            names = [a.name for a in op_schema(overload).arguments]
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            reached.update(op=overload.name(), tensors=tensors_in(bound),
                           dtype=bound.get("dtype"))
            raise _Stop
        return kernel

    def register(library: torch.library.Library) -> None:
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            library.impl(overload, catch(overload), dispatcher.autograd_key(device))

    library = dispatcher.overriding_library(register)
    try:
        casts, error = _call(op, device, dtype, input_dtypes, named=False)
        if error is not None and _NOT_A_DIMNAME in error:
            # The schema types a named dimension (`softmax.Dimname`) as `str`; only the
            # dispatcher's refusal of a plain string tells it apart from one (a norm's `ord`).
            casts, error = _call(op, device, dtype, input_dtypes, named=True)
    finally:
        dispatcher.destroy_library(library)
    return ProbeResult(
        casts=casts,
        op=reached.get("op"),
        in_dtypes=tuple(t.dtype for t in reached.get("tensors", [])),
        dtype_arg=reached.get("dtype"),
        error=error,
    )


# What the dispatcher says when a string argument that stands for a named dimension has none.
_NOT_A_DIMNAME = "must have a namespace"


def _call(op: OpOverload, device: str, dtype: torch.dtype, input_dtypes: list[torch.dtype],
          named: bool) -> tuple[tuple[torch.dtype, ...], str | None]:
    """One call of `op` on dummy arguments under `device`'s autocast: the casts autocast made,
    and the first line of what the call raised before the catching kernel stopped it."""
    dtypes = iter(input_dtypes + [input_dtypes[-1]] * 16)
    enabled, previous = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    watcher = _CastWatcher()
    error = None
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices of the probed ops
        kwargs = {
            a.name: _dummy(dispatcher.argument_kind(op, i),
                           lambda: torch.empty(2, 2, dtype=next(dtypes), device=device), named)
            for i, a in enumerate(op_schema(op).arguments)
            if not a.has_default_value()
        }
        first = kwargs.pop("self", None)  # OpOverload takes `self` positionally
        torch.set_autocast_enabled(device, True)
        torch.set_autocast_dtype(device, dtype)
        try:
            with watcher:
                op(first, **kwargs) if first is not None else op(**kwargs)
        except _Stop:
            pass
        except Exception as e:  # noqa: BLE001 - any refusal is an answer (banned)
            error = first_line(e)
        finally:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, previous)
    return tuple(watcher.casts), error


def classify(name: str, low: torch.dtype, all_fp32: ProbeResult, all_low: ProbeResult,
             mixed: ProbeResult) -> OpPolicy:
    """The category from the three probes (see the module docstring)."""
    if low in all_fp32.in_dtypes:
        return OpPolicy(name, "lower")
    if all_low.op is not None and all_low.dtype_arg == torch.float32:
        if all_low.op != name:
            return OpPolicy(name, "fp32_append_dtype", redirect=all_low.op)
        return OpPolicy(name, "fp32_set_opt_dtype")
    if all_low.in_dtypes and low not in all_low.in_dtypes and torch.float32 in all_low.in_dtypes:
        return OpPolicy(name, "fp32")
    if mixed.in_dtypes and low not in mixed.in_dtypes and torch.float32 in mixed.casts:
        return OpPolicy(name, "promote")
    if all_fp32.error and "autocast" in all_fp32.error.lower():
        return OpPolicy(name, "banned", message=all_fp32.error)
    return OpPolicy(name, "unclassified")


@functools.cache
def read_policy(device: str, dtype: torch.dtype) -> dict[str, OpPolicy]:
    """Every op `device`'s autocast handles in this build, with its category, for autocast
    dtype `dtype`. Raises AmpscopeError when the build has no autocast kernels for `device`."""
    names = registered_ops(device)
    if not names:
        raise AmpscopeError(
            f"this PyTorch build ({torch.__version__}) has no autocast policy for {device!r}; "
            "emulate cuda, mps or xpu instead"
        )
    policy = {}
    for name in names:
        results = [
            probe(name, device, dtype, inputs)
            for inputs in ([torch.float32], [dtype], [dtype, torch.float32])
        ]
        policy[name] = classify(name, dtype, *results)
    return policy
