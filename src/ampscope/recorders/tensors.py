"""Walking op and module arguments for their tensors, and describing them, cheaply.

Every op of a step passes through here, so these helpers avoid pytree (a generic flattener
that costs more than the records themselves) and build each TensorMeta once.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ampscope.records import TensorMeta, dtype_name


def tensors_in(values, out: list | None = None) -> list[torch.Tensor]:
    """The tensors in op arguments or results: nested lists, tuples and dicts, in order."""
    if out is None:
        out = []
    if isinstance(values, torch.Tensor):
        out.append(values)
    elif isinstance(values, (list, tuple)):
        for v in values:
            tensors_in(v, out)
    elif isinstance(values, dict):
        for v in values.values():
            tensors_in(v, out)
    return out


_meta_cache: dict[tuple, TensorMeta] = {}


def meta_of(t: torch.Tensor) -> TensorMeta:
    key = (t.dtype, t.shape)
    meta = _meta_cache.get(key)
    if meta is None:
        meta = TensorMeta(dtype_name(t.dtype), tuple(t.shape))
        if len(_meta_cache) < 100_000:
            _meta_cache[key] = meta
    return meta


def metas(values) -> tuple[TensorMeta, ...]:
    return tuple(meta_of(t) for t in tensors_in(values))


def data_dtypes(tensors: list[torch.Tensor]) -> tuple[str | None, ...]:
    """For each tensor, the dtype a wrapper subclass stores its data in where that differs
    from the dtype it shows (its first inner tensor, by PyTorch's `__tensor_flatten__`
    protocol: a float8 training tensor's `_data`); () when there is none among them."""
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
