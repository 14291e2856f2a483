"""The dispatcher details ampscope reads an autocast policy with, and emulates one with.

- which ops have a kernel registered for a dispatch key (`registrations`, `has_kernel`): the
  autocast op lists of a device are the registrations for its Autocast key;
- what kind of value a schema argument takes (`argument_kind`), to build a dummy call;
- a `torch.library.Library` of kernels that override PyTorch's own (`overriding_library`),
  dropping its registrations (`destroy_library`), and skipping a device's autocast key while a
  kernel runs (`no_autocast`);

Each is found once; where a build lacks one, the feature that needs it is off, with the reason
in `features()`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator

import torch

from ampscope.torchcompat.dispatch import OpOverload
from ampscope.torchcompat.features import Feature

__all__ = ["argument_kind", "destroy_library", "has_kernel",
           "is_view", "no_autocast", "overriding_library", "registrations"]

_C = torch._C


def backend_key(device: str) -> str:
    """"cuda" -> "CUDA": the key a device's own kernels are registered at, and the device part
    of its per-device keys."""
    return "PrivateUse1" if device == "privateuseone" else device.upper()


def autocast_key(device: str) -> str:
    """"cuda" -> "AutocastCUDA"."""
    return "Autocast" + backend_key(device)


def autograd_key(device: str) -> str:
    """"cuda" -> "AutogradCUDA"."""
    return "Autograd" + backend_key(device)


# --- what is registered where -------------------------------------------------------------

def registrations(key: str) -> tuple[str, ...]:
    """Every op with a kernel registered at dispatch key `key` ("AutocastCUDA"), unsorted;
    empty when this build has no such key."""
    try:
        return tuple(_C._dispatch_get_registrations_for_dispatch_key(key))
    except (RuntimeError, ValueError):  # no such dispatch key
        return ()


def has_kernel(op_name: str, key: str) -> bool:
    """Whether op `op_name` ("aten::_fused_rms_norm") has a kernel of its own at `key`
    ("CUDA"); False for an unknown op or key."""
    try:
        return bool(_C._dispatch_has_kernel_for_dispatch_key(op_name, key))
    except (RuntimeError, ValueError):
        return False


# --- schema arguments ---------------------------------------------------------------------

# The JIT type classes, by the kind `argument_kind` names them.
_KINDS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("optional", (_C.OptionalType,)),
    ("tensor", (_C.TensorType,)),
    ("list", (_C.ListType,)),
    ("int", (_C.IntType, _C.SymIntType)),
    ("float", (_C.FloatType, _C.NumberType)),
    ("bool", (_C.BoolType,)),
    ("str", (_C.StringType,)),
)


def argument_kind(op: OpOverload, index: int) -> str:
    """The kind of value `op`'s argument `index` takes: "optional", "tensor", "tensor_list",
    "str_list", "list" (of numbers), "int", "float", "bool", "str" or "other". A named
    dimension (`Dimname`) is a "str" here: the schema types it so."""
    arg_type = op._schema.arguments[index].type
    for kind, classes in _KINDS:
        if isinstance(arg_type, classes):
            return _list_kind(arg_type.getElementType()) if kind == "list" else kind
    return "other"


def _list_kind(element) -> str:
    if isinstance(element, (_C.TensorType, _C.OptionalType)):
        return "tensor_list"
    return "str_list" if isinstance(element, _C.StringType) else "list"


# --- registrations for the duration of a run ------------------------------------------------

def overriding_library(register: Callable[[torch.library.Library], object]
                       ) -> torch.library.Library:
    """A `torch.library.Library("aten", "IMPL")` that `register(library)` fills with kernels
    overriding PyTorch's own, without the warning that says so (overriding is the point); if
    `register` raises, the library is destroyed again and nothing stays registered. Hand it to
    `destroy_library` to bring PyTorch's kernels back."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            register(library)
    except BaseException:
        destroy_library(library)
        raise
    return library


def destroy_library(library: torch.library.Library) -> None:
    """Drop every registration `library` made (PyTorch's own kernels are back)."""
    library._destroy()


@functools.cache
def _autocast_keyset(device: str):
    return _C.DispatchKeySet(getattr(_C.DispatchKey, autocast_key(device)))


@contextlib.contextmanager
def no_autocast(device: str) -> Iterator[None]:
    """Ops called inside skip `device`'s autocast key (a kernel that re-enters the dispatcher
    must not be autocast twice)."""
    with _C._ExcludeDispatchKeyGuard(_autocast_keyset(device)):
        yield


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view of another tensor (autocast caches no cast of a view)."""
    return t._is_view()


@functools.cache
def _registrations_readable() -> tuple[bool, str]:
    """Whether the dispatcher lists its registrations as `registrations` and `has_kernel` read
    them: tried once on the CPU's, which every build has (the CPU autocast lists hold mm, and
    mm has a CPU kernel of its own)."""
    names = ("_dispatch_get_registrations_for_dispatch_key", "_dispatch_has_kernel_for_dispatch_key")
    missing = [n for n in names if not callable(getattr(_C, n, None))]
    if missing:
        return False, f"missing: torch._C.{' and '.join(missing)}"
    try:
        listed = "aten::mm" in registrations(autocast_key("cpu"))
        kernel = has_kernel("aten::mm", backend_key("cpu"))
    except TypeError as e:  # a changed signature (a missing key is answered, not raised)
        return False, f"the registrations cannot be read as expected ({e})"
    if not listed or not kernel:
        return False, ("the registrations read empty: aten::mm is not listed at AutocastCPU"
                       if not listed else "aten::mm has no CPU kernel as read here")
    return True, "the kernels registered per dispatch key (autocast op lists)"


def features() -> list[Feature]:
    return [Feature("dispatch registrations", *_registrations_readable(),
                    "autocast policies read from the build (`ampscope policy`, emulated devices)")]
