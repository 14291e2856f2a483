"""Walking op and module arguments for their tensors, and describing them, cheaply.

Every op of a step passes through here, so these helpers avoid pytree (a generic flattener
that costs more than the records themselves: `tree_leaves` of an op's arguments takes 4-7× this
walk, measured), look at each argument's type once per type and build each TensorMeta once.
"""

from __future__ import annotations

import operator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ampscope.records import TensorMeta, dtype_name

# Recorders read tensors' dtypes, shapes and storages inside the dispatch mode and module
# hooks, where a TorchFunctionMode (the function recorder, the virtual device) would see each
# read as a call of its own (about 1.5 µs a read): they read them with torch functions off.
no_torch_function = torch._C.DisableTorchFunction

# What each argument type is to the walk (a tensor, a sequence, a dict, or nothing to look
# into), decided once per type: an `isinstance` chain per argument, most of them ints of a
# shape, cost more than the rest of the recording.
_TENSOR, _SEQUENCE, _MAPPING, _OTHER = 1, 2, 3, 0
_kinds: dict[type, int] = {}


def _kind(cls: type) -> int:
    kind = (_TENSOR if issubclass(cls, torch.Tensor) else
            _SEQUENCE if issubclass(cls, (list, tuple)) else
            _MAPPING if issubclass(cls, dict) else _OTHER)
    _kinds[cls] = kind
    return kind


def walk(values, out: list) -> None:
    """Append the tensors among `values` (an iterable), and in the lists, tuples and dicts among
    them, to `out`."""
    kinds = _kinds
    for v in values:
        kind = kinds.get(type(v))
        if kind is None:
            kind = _kind(type(v))
        if kind == _TENSOR:
            out.append(v)
        elif kind == _SEQUENCE:
            walk(v, out)
        elif kind == _MAPPING:
            walk(v.values(), out)


def tensors_in(values, out: list | None = None) -> list[torch.Tensor]:
    """The tensors in op arguments or results: nested lists, tuples and dicts, in order."""
    if out is None:
        out = []
    walk((values,), out)
    return out


def results_of(out) -> list[torch.Tensor]:
    """The tensors an op or a call returned: most return one plain tensor, taken without a
    walk."""
    if type(out) in _PLAIN:
        return [out]
    found: list[torch.Tensor] = []
    walk((out,), found)
    return found


_meta_cache: dict[tuple, TensorMeta] = {}


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
    if _PLAIN.issuperset(map(type, tensors)):  # plain tensors and parameters (nearly always)
        return ()
    found: list[str | None] | None = None
    for i, t in enumerate(tensors):
        if type(t) in _PLAIN or not is_traceable_wrapper_subclass(t):
            continue
        names, _ = t.__tensor_flatten__()
        inner = getattr(t, names[0], None) if names else None
        if isinstance(inner, torch.Tensor) and inner.dtype != t.dtype:
            if found is None:
                found = [None] * len(tensors)
            found[i] = dtype_name(inner.dtype)
    return tuple(found) if found is not None else ()


_PLAIN = {torch.Tensor, torch.nn.Parameter}
