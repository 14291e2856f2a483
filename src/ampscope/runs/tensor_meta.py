"""Describing op and module arguments' tensors, cheaply.

Every op of a step passes through here, so these helpers find tensors with the walk of
`ampscope.nested` (not pytree) and build each TensorMeta once.
"""

from __future__ import annotations

import operator

import torch

from ampscope.nested import tensors_in, walk
from ampscope.records import TensorMeta, dtype_name
from ampscope.runtime.predict import new_fake
from ampscope.torchcompat.dispatch import inner_tensors, no_torch_function
from ampscope.torchcompat.fake import FakeTensor

# Recorders read tensors' dtypes, shapes and storages inside the dispatch mode and module
# hooks, where a TorchFunctionMode (the function recorder, the virtual device) would see each
# read as a call of its own (about 1.5 µs a read): they read them with torch functions off
# (`no_torch_function`).

__all__ = ["data_dtypes", "described", "fake_from", "meta_of", "metas", "metas_of",
           "no_torch_function", "results_of", "tensors_in", "walk"]


def results_of(out) -> list[torch.Tensor]:
    """The tensors an op or a call returned: most return one plain tensor, taken without a
    walk."""
    if type(out) in PLAIN_TENSORS:
        return [out]
    found: list[torch.Tensor] = []
    walk((out,), found)
    return found


_meta_cache: dict[tuple, TensorMeta] = {}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process stores for `t`: a DTensor's local shard (FSDP2's and tensor
    parallelism's parameters, their gradients and optimizer state, whose own shape and storage
    are the full tensor's, a storage that holds no memory), else `t`. Read as the subclass's
    one inner tensor, not through `to_local()`: on a parameter, some builds' `to_local()` makes
    a view to mark it one, an op of its own through every dispatch mode on each read."""
    to_local = getattr(t, "to_local", None)
    if not hasattr(t, "placements") or not callable(to_local):
        return t
    inner = inner_tensors(t)
    if len(inner) == 1:
        return inner[0]
    with torch.no_grad():
        return to_local()


def dtensor_layout(t: torch.Tensor) -> tuple[int, tuple] | None:
    """A DTensor's layout: its device mesh (by id) and its placements; None for any other
    tensor."""
    mesh, placements = getattr(t, "device_mesh", None), getattr(t, "placements", None)
    if mesh is None or placements is None:
        return None
    return id(mesh), tuple(placements)


# Tensor classes that wrap no other tensor: plain ones, parameters, and a predicted run's fake
# tensors (a meta tensor of the same dtype inside). Checked first, in C, on every op.
PLAIN_TENSORS = frozenset({torch.Tensor, FakeTensor, torch.nn.Parameter})


def has_dtensor(tensors: list[torch.Tensor]) -> bool:
    """Whether any of `tensors` is a DTensor (checked only for tensors of a subclass)."""
    return any(type(t) not in PLAIN_TENSORS and local_tensor(t) is not t for t in tensors)


def local_values(value):
    """`value` (an op's arguments or result: tensors in lists, tuples and dicts) with each
    DTensor replaced by the shard this process holds: what the rank's kernel computes on."""
    if isinstance(value, torch.Tensor):
        return local_tensor(value) if type(value) not in PLAIN_TENSORS else value
    if isinstance(value, (list, tuple)):
        return type(value)(local_values(v) for v in value) if type(value) in (list, tuple) \
            else value
    if isinstance(value, dict):
        return {k: local_values(v) for k, v in value.items()}
    return value


def stored_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors whose storages hold `t`'s memory on this process: `t` itself, or the
    inner tensors of a tensor subclass that wraps others (a DTensor's local shard, a float8
    tensor's data and scale), whose own storage is a placeholder of the full size that holds
    no memory."""
    if type(t) in PLAIN_TENSORS:
        return [t]
    return [held for x in inner_tensors(t) for held in stored_tensors(x)] or [t]


def meta_of(t: torch.Tensor) -> TensorMeta:
    key = (t.dtype, t.shape)
    meta = _meta_cache.get(key)
    if meta is None:
        meta = TensorMeta(dtype_name(t.dtype), tuple(t.shape))
        if len(_meta_cache) < 100_000:
            _meta_cache[key] = meta
    return meta


_metas_cache: dict[tuple, tuple[TensorMeta, ...]] = {}
_dtype_and_shape = operator.attrgetter("dtype", "shape")  # (t.dtype, t.shape), read in C


def metas_of(tensors: list[torch.Tensor]) -> tuple[TensorMeta, ...]:
    """`tuple(map(meta_of, tensors))`, one tuple shared by every op or call whose tensors have
    the same dtypes and shapes: a step repeats a few such lists thousands of times, and each
    tuple kept would be one more object for the garbage collector to count and scan (the
    key hashes in C; a TensorMeta hashes in Python)."""
    key = tuple(map(_dtype_and_shape, tensors))
    found = _metas_cache.get(key)
    if found is None:
        found = tuple(map(meta_of, tensors))
        if len(_metas_cache) < 100_000:
            _metas_cache[key] = found
    return found


def metas(values) -> tuple[TensorMeta, ...]:
    return metas_of(tensors_in(values))


def data_dtypes(tensors: list[torch.Tensor]) -> tuple[str | None, ...]:
    """For each tensor, the dtype a wrapper subclass stores its data in where that differs
    from the dtype it shows (its first inner tensor, by PyTorch's `__tensor_flatten__`
    protocol: a float8 training tensor's `_data`); () when there is none among them."""
    if PLAIN_TENSORS.issuperset(map(type, tensors)):  # plain, parameters or fake (nearly always)
        return ()
    found: list[str | None] = []
    for t in tensors:
        inner = None if type(t) in PLAIN_TENSORS else next(iter(inner_tensors(t)), None)
        found.append(dtype_name(inner.dtype) if inner is not None and inner.dtype != t.dtype
                     else None)
    return tuple(found) if any(found) else ()


def tensor_key(t: torch.Tensor) -> tuple:
    """What makes two tensors interchangeable to the replay of repeated blocks (a block's
    arguments, parameters, buffers and tensor attributes): class, dtype, shape, stride, storage
    offset, device, whether it wants a gradient and whether autograd made it. The one key for
    that question; the foreach and fake-cache tricks key fake tensors as FakeTensorMode's own
    cache does instead (runs/foreach.py, runs/fake_cache.py), by its fields."""
    return (type(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device,
            t.requires_grad, t.grad_fn is None)


def described(t: torch.Tensor) -> tuple:
    """What a fake tensor standing for `t` needs: (shape, stride, dtype, device, requires_grad)."""
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad


def fake_from(like: FakeTensor, description: tuple) -> FakeTensor:
    """A new fake tensor as `described`, made in `like`'s fake mode with no recorder or other
    mode seeing it (a replayed block's output, a thinned foreach op's result)."""
    shape, stride, dtype, device, _ = description
    return new_fake(like.fake_mode, shape, stride, dtype, device)
