"""FakeTensor and FakeTensorMode, and the internals of theirs that ampscope's speed tricks use.

The classes themselves (`FakeTensor`, `FakeTensorMode`, their exceptions) are the supported way
to run a model without storage and have kept their names since torch 2.0. Three speed tricks
reach further, into details any release may change; each is detected here once, by signature
and by a probe that checks the detail behaves as the trick assumes, and is off (with the
reason in `features()`) where it does not:

- the dispatch cache (`cache_api()`): FakeTensorMode's cache of op results' metadata, its key
  builder and the function that makes results from an entry (runs/fake_cache.py);
- cloning a fake tensor's attributes (`clone_wrap`): a new fake tensor made as the C++
  subclass with the attributes `FakeTensor.__new__` set on an earlier one (runtime/predict.py);
- the converter's memos (`remember_constant`): entering a fake constant in the books the
  converter keeps of its own conversions (runs/shortcuts.py).

Not a trick but a repair: `fake_complex_view` converts a real complex view of a real base,
which the converter of torch 2.13 and earlier fails on (runtime/predict.py retries with it).

Two more tricks need details found here too: `foreach` the storage length a tensor needs
(`required_storage_length`, from torch's `_prims_common`; runs/foreach.py), `prim-device`
FakeTensorMode's kernel-invocation flag (`kernel_invocation_flag`). Each is looked up on the
first ask only, so importing this module reaches none of them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast, final

import torch
from torch._subclasses import fake_tensor as _fake_tensor
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    in_kernel_invocation_manager,
)

from ampscope.torchcompat.dispatch import modes_off
from ampscope.torchcompat.features import Feature

if TYPE_CHECKING:  # this build's key and entry classes: opaque objects to the callers
    from torch._subclasses.fake_tensor import _DispatchCacheKey, _DispatchCacheValidEntry

__all__ = [
    "FakeTensor", "FakeTensorConfig", "FakeTensorMode", "cache_api", "clone_wrap",
    "data_dependent_errors", "fake_complex_view", "fake_mode_suspended",
    "in_kernel_invocation_manager", "remember_constant",
    "required_storage_length",
]


def fake_mode_suspended():
    """A context in which the fake mode on the dispatch stack (if any) is set aside, so that
    real tensors compute for real while fake ones keep their own mode: `DeviceMesh` reads the
    ranks of a mesh it builds. Where the build lacks the helper, nothing is set aside."""
    import contextlib

    suspend = getattr(_fake_tensor, "unset_fake_temporarily", None)
    return suspend() if callable(suspend) else contextlib.nullcontext()


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a fake run raises when code asks for a value it does not have."""
    names = ("DataDependentOutputException", "DynamicOutputShapeException")
    return tuple(getattr(_fake_tensor, n) for n in names if hasattr(_fake_tensor, n))


def required_storage_length(shape, stride, offset: int = 0) -> int:
    """The number of elements a storage needs for a tensor of `shape` and `stride`, by torch's
    own rule. Only the `foreach` trick asks, and only where `status("foreach")` found it."""
    compute = _storage_length_found()[0]
    if compute is None:  # the trick is off then (tricks.enabled): not reached from a run
        raise RuntimeError(f"required_storage_length: {_storage_length_found()[1]}")
    return compute(shape, stride, offset)


@functools.cache
def _storage_length_found() -> tuple[Callable[..., int] | None, str]:
    """torch's `compute_required_storage_length`, checked on three layouts whose lengths are
    known by hand: contiguous 2×3 needs 6, a transposed 2×3 at offset 1 needs 1 + 1·1 + 2·2 + 1
    = 7, an empty tensor 0."""
    name = "torch._prims_common.compute_required_storage_length"
    try:
        from torch._prims_common import compute_required_storage_length as compute
    except ImportError as e:
        return None, f"{name} is not on this build ({e})"
    try:
        got = (compute((2, 3), (3, 1), 0), compute((2, 3), (1, 2), 1), compute((0, 3), (3, 1), 0))
    except (TypeError, ValueError, RuntimeError) as e:  # a changed signature or rule
        return None, f"{name} cannot be called as expected ({type(e).__name__}: {e})"
    if got != (6, 7, 0):
        return None, f"{name} counts differently on this build ({got}, not (6, 7, 0))"
    return compute, name


def mark_parameter(t: torch.Tensor) -> bool:
    """Make `isinstance(t, nn.Parameter)` hold for `t`, an instance of a tensor subclass, as
    `Parameter` marks the tensor it makes of one; False where this build marks them otherwise
    (the caller then makes the Parameter)."""
    if not _parameter_mark():
        return False
    t._is_param = True
    return True


@functools.cache
def _parameter_mark() -> bool:
    class Probe(torch.Tensor):
        pass

    probe = torch.Tensor._make_subclass(Probe, torch.empty(0))
    probe._is_param = True
    return isinstance(probe, torch.nn.Parameter)


# -- the dispatch cache


@dataclass(frozen=True)
class CacheAPI:
    """FakeTensorMode's dispatch cache, as this build spells it."""

    key_state: type
    bypass: type[BaseException]
    valid_entry: type
    takes_func: bool  # `_output_from_cache_entry(state, entry, key, func, args)` (until 2.14)

    def key(self, mode: FakeTensorMode, func, args, kwargs) -> object | None:
        """FakeTensorMode's own cache key for the call, or None where it would bypass it."""
        try:
            return mode._cache_key(self.key_state(None), func, args, kwargs)
        except self.bypass:
            return None

    def entry(self, key: object) -> object | None:
        """The valid entry the class-wide cache holds for `key`, or None (read from the class
        each time: a test or a tool may give the class a new cache)."""
        found = FakeTensorMode.cache.get(cast("_DispatchCacheKey", key))
        return found if isinstance(found, self.valid_entry) else None

    def output(self, mode: FakeTensorMode, entry: object, key: object, func, args):
        """The op's results made from `entry`, as a cache hit makes them."""
        state = self.key_state(None)
        valid, cache_key = cast("_DispatchCacheValidEntry", entry), cast("_DispatchCacheKey", key)
        if self.takes_func:
            return mode._output_from_cache_entry(state, valid, cache_key, func, args)
        # Later releases' signature, without func (mypy reads the installed torch's, with it).
        return mode._output_from_cache_entry(state, valid, cache_key, args)  # type: ignore[call-arg]


@final  # (none derives from it: `type(x) is PlainOutput` tells it from the other answers)
@dataclass(frozen=True)
class PlainOutput:
    """An entry whose answer is one new tensor of plain metadata, on a storage of its own."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def plain_output(entry) -> PlainOutput | None:
    """The entry's one output where FakeTensorMode would make it as an empty strided meta tensor
    wrapped with its device: not the argument an in-place op returns nor a view of one, without
    autograd, conjugate or negative bits, of concrete sizes."""
    if entry.is_output_tuple or len(entry.output_infos) != 1:
        return None
    info = entry.output_infos[0]
    meta = info.metadata
    if (info.inplace_idx is not None or info.view_idx is not None or meta is None
            or meta.layout != torch.strided or meta.requires_grad or meta.is_conj
            or meta.is_neg or not all(type(v) is int for v in (*meta.shape, *meta.stride))):
        return None
    return PlainOutput(tuple(meta.shape), tuple(meta.stride), meta.dtype, meta.device)


@functools.cache
def _cache_api_found() -> tuple[CacheAPI | None, str]:
    try:
        if not isinstance(FakeTensorMode.cache, dict):
            raise TypeError("FakeTensorMode.cache is not a dict")
        api = CacheAPI(
            key_state=_fake_tensor._CacheKeyState,
            bypass=_fake_tensor._BypassDispatchCache,
            valid_entry=_fake_tensor._DispatchCacheValidEntry,
            takes_func=_takes_func(FakeTensorMode._output_from_cache_entry),
        )
    except (AttributeError, ValueError, TypeError) as e:
        return None, f"not on this build ({e})"
    try:
        _probe_cache(api)
    # The probe runs FakeTensorMode's private cache on an op: whatever a release changed may
    # fail in any way, and every failure means the same (the trick is off, with this reason).
    except Exception as e:  # noqa: BLE001 - a probe: any failure turns the trick off, said here
        return None, f"behaves differently on this build ({type(e).__name__}: {e})"
    return api, "FakeTensorMode's dispatch cache, key builder and entry reader"


def _takes_func(output_from_entry) -> bool:
    """Which of the two known signatures `_output_from_cache_entry` has (ValueError for any
    other)."""
    names = list(inspect.signature(output_from_entry).parameters)
    if names == ["self", "state", "entry", "key", "func", "args"]:
        return True
    if names == ["self", "state", "entry", "key", "args"]:
        return False
    raise ValueError(f"_output_from_cache_entry{tuple(names)}")


def _probe_cache(api: CacheAPI) -> None:
    """One op run under a fresh mode, its entry read back and answered from: the answer must
    match the dispatched result's metadata."""
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(3, 5)
        y = torch.empty(3, 5)
        func = torch.ops.aten.add.Tensor
        expected = func(x, y)
        key = api.key(mode, func, (x, y), {})
        entry = api.entry(key) if key is not None else None
        if entry is None:
            raise ValueError("an add's result was not found in the cache")
        got = api.output(mode, entry, key, func, (x, y))
        plain = plain_output(entry)
    if (type(got) is not FakeTensor or got.shape != expected.shape
            or got.dtype != expected.dtype or plain is None or plain.shape != (3, 5)):
        raise ValueError("the entry's answer differs from the dispatched result")


def cache_api() -> CacheAPI | None:
    """FakeTensorMode's dispatch cache where this build has it as the trick expects, else None."""
    return _cache_api_found()[0]


# -- new fake tensors without FakeTensor.__new__


class _Cloner:
    """Makes fake tensors as the C++ subclass given the attributes `FakeTensor.__new__` set on
    a first one of the same mode and device (a third of the cost of the constructor)."""

    def __init__(self) -> None:
        self.unsafe_ptr_flag = "_allow_unsafe_data_ptr_access"
        self.warn = torch._C._set_warn_deprecated_on_mutable_data_ptr
        self.throw = torch._C._set_throw_on_mutable_data_ptr

    def learn(self, made: FakeTensor) -> tuple[torch.device, dict]:
        # Without the mode itself: whoever keeps the attributes must not keep the mode alive.
        return made.fake_device, {k: v for k, v in vars(made).items() if k != "fake_mode"}

    def make(self, mode: FakeTensorMode, meta: torch.Tensor, learned: tuple[torch.device, dict],
             constant: torch.Tensor | None) -> FakeTensor:
        fake_device, attributes = learned
        made = torch.Tensor._make_subclass(FakeTensor, meta, False, dispatch_device=True,
                                           device_for_backend_keys=fake_device)
        if getattr(mode, self.unsafe_ptr_flag):  # as FakeTensor.__new__ does
            self.warn(made)
        else:
            self.throw(made)
        made.__dict__.update(attributes)
        made.fake_mode = mode
        made.constant = constant
        return made


@functools.cache
def _cloner_found() -> tuple[_Cloner | None, str]:
    try:
        cloner = _Cloner()
        mode = FakeTensorMode()
        with modes_off():
            meta = torch.empty(2, 3, device="meta")
            first = FakeTensor(mode, meta, torch.device("cpu"))
            learned = cloner.learn(first)
            clone = cloner.make(mode, torch.empty(2, 3, device="meta"), learned, None)
            again = FakeTensor(mode, torch.empty(2, 3, device="meta"), torch.device("cpu"))
        if (type(clone) is not FakeTensor or clone.fake_device != again.fake_device
                or set(vars(clone)) != set(vars(again)) or clone.device != again.device):
            raise ValueError("a cloned fake tensor differs from a constructed one")
    # As above: a probe of FakeTensor's construction, which may fail in any way a release
    # makes it; the constructor is used then.
    except Exception as e:  # noqa: BLE001 - a probe: any failure turns the trick off, said here
        return None, f"not usable on this build ({type(e).__name__}: {e})"
    return cloner, "FakeTensor made as the C++ subclass with learned attributes"


def clone_wrap() -> _Cloner | None:
    """The attribute cloner where this build's FakeTensor is made as it assumes, else None."""
    return _cloner_found()[0]


# -- real complex views the converter cannot replay


def fake_complex_view(mode: FakeTensorMode, t: object) -> torch.Tensor | None:
    """The fake of `t` where `t` is a real complex tensor viewing a real base through another
    view (`view_as_complex(x.view(..., 2))`, as rotary caches are made): this build's converter
    replays such a view as `view_as_complex(base)`, which fails unless the base's own last
    dimension is 2. It is made here from the fake of the base (the mode's own conversion, so
    it shares that storage) with `t`'s sizes, strides and offset. None for any other tensor."""
    if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or not t.is_complex():
        return None
    base = getattr(t, "_base", None)
    if not isinstance(base, torch.Tensor) or isinstance(base, FakeTensor) \
            or base.dtype != t.dtype.to_real():
        return None
    fake_base = mode.from_tensor(base)
    # The base's storage in real elements: two per complex element of `t`.
    pairs = fake_base.as_strided((*t.shape, 2), (*(2 * s for s in t.stride()), 1),
                                 2 * t.storage_offset())
    fake = torch.view_as_complex(pairs)
    if converter_memos() and isinstance(fake, FakeTensor):  # the next op on `t` finds it
        # converted, as the converter's own conversions are
        mode.fake_tensor_converter.set_tensor_memo(t, fake)
    return fake


# -- the converter's memos


def remember_constant(mode: FakeTensorMode, real: torch.Tensor, fake: FakeTensor) -> bool:
    """Enter `fake` (a fake constant holding `real`) in the books of `mode`'s converter, as its
    own conversion of `real` enters it; False where this build keeps other books (the caller
    then lets the mode convert)."""
    if not converter_memos():
        return False
    converter = mode.fake_tensor_converter
    converter.set_tensor_memo(real, fake)
    meta = converter.meta_converter
    meta.storage_memo[meta.describer.get_storage_id(real.untyped_storage())] = \
        fake.untyped_storage()
    converter.add_constant_storage_mapping(fake)
    return True


@functools.cache
def converter_memos() -> bool:
    """Does this build's converter keep the memos `remember_constant` fills?"""
    mode = FakeTensorMode()
    converter = getattr(mode, "fake_tensor_converter", None)
    meta = getattr(converter, "meta_converter", None)
    return (hasattr(mode, "may_turn_const") and hasattr(converter, "set_tensor_memo")
            and hasattr(converter, "add_constant_storage_mapping")
            and isinstance(getattr(meta, "storage_memo", None), MutableMapping)
            and hasattr(getattr(meta, "describer", None), "get_storage_id"))


@functools.cache
def kernel_invocation_flag() -> bool:
    """Does a FakeTensorMode say whether it is inside a meta kernel (`in_kernel_invocation`),
    and a FakeTensor which device it stands for (`fake_device`)?"""
    mode = FakeTensorMode()
    with modes_off():
        fake = FakeTensor(mode, torch.empty(1, device="meta"), torch.device("cpu"))
    return (isinstance(getattr(mode, "in_kernel_invocation", None), bool)
            and getattr(fake, "fake_device", None) == torch.device("cpu"))


def status(trick: str) -> tuple[bool, str]:
    """Whether this build has what the speed trick named `trick` (tricks.Trick's value) needs,
    and what that is or why it is missing; detected on the first ask only."""
    if trick == "fake-cache":
        api, why = _cache_api_found()
        return api is not None, why
    if trick == "clone":
        cloner, why = _cloner_found()
        return cloner is not None, why
    if trick == "shortcuts":
        ok = converter_memos()
        return ok, "the converter's tensor and storage memos" if ok else \
            "the converter's memos are not on this build"
    if trick == "prim-device":
        ok = kernel_invocation_flag()
        return ok, "FakeTensorMode.in_kernel_invocation, FakeTensor.fake_device" if ok else \
            "FakeTensorMode.in_kernel_invocation is not on this build"
    if trick == "fsdp-shard":
        from ampscope.torchcompat.distributed import rank_chunks_status

        return rank_chunks_status()
    if trick == "foreach":
        compute, why = _storage_length_found()
        return compute is not None, why
    if trick == "replay":
        return True, "needs no private detail (module hooks, autograd's public state)"
    raise ValueError(f"no speed trick named {trick!r}")


# Each detail's name, and the speed trick (tricks.Trick's value) that needs it.
_DETAILS = (("fake dispatch cache", "fake-cache"), ("fake tensor cloning", "clone"),
            ("fake converter memos", "shortcuts"), ("fake kernel-invocation flag", "prim-device"),
            ("required storage length", "foreach"))


def features() -> list[Feature]:
    """Each detail, with the speed trick that needs it."""
    return [Feature(name, *status(trick), trick) for name, trick in _DETAILS]
