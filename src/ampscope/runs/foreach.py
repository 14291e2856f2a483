"""Fake `_foreach_` ops dispatched over one list entry of each kind.

An optimizer's foreach ops (and `clip_grad_norm_`'s) take one list entry per parameter: 723 for
a 70B Llama, whose AdamW step is about ten such ops. On fake tensors the meta kernel works out
each entry's result from that entry alone, at tens of microseconds an entry: most of a
predicted step's optimizer time. Entries whose tensors have the same metadata get results with
the same metadata, so the op runs on the first entry of each kind and the other entries'
results are made like it, without a kernel; the recorders above see the op with every entry,
as it would run. Which entries are alike, which ops are left whole, and why DTensors are
thinned in place only: docs/how-it-works.md#foreach-ops-over-one-entry-of-each-kind.
"""

from __future__ import annotations

import torch

from ampscope.runs.tensor_meta import (
    described,
    dtensor_layout,
    fake_from,
    local_tensor,
    no_torch_function,
)
from ampscope.torchcompat.dispatch import OpOverload, op_schema
from ampscope.torchcompat.fake import FakeTensor, required_storage_length

NOT_THINNED = object()

# Below this many entries the bookkeeping costs about what it saves.
_MIN_ENTRIES = 8
_LISTS = ("List[Tensor]", "List[number]", "List[float]", "List[int]", "List[Optional[Tensor]]")


class _Shape:
    """Which arguments of one foreach overload are per entry, and whether it can be thinned."""

    __slots__ = ("op", "names", "per_entry", "tensor_args", "thinnable", "in_place")

    def __init__(self, func: OpOverload) -> None:
        self.op = func  # held: shapes are looked up by the op's id
        schema = op_schema(func)
        self.names = [a.name for a in schema.arguments]
        types = [str(a.type) for a in schema.arguments]
        returns = [str(r.type) for r in schema.returns]
        self.per_entry = {n for n, t in zip(self.names, types, strict=True) if t in _LISTS}
        self.tensor_args = {n for n, t in zip(self.names, types, strict=True)
                            if t in ("Tensor", "Optional[Tensor]")}
        self.thinnable = bool(self.per_entry) and returns in ([], ["List[Tensor]"])
        self.in_place = returns == []


_shapes: dict[int, _Shape] = {}


def thinned_call(func: OpOverload, args: tuple, kwargs: dict):
    """`func(*args, **kwargs)` for a foreach op on fake tensors, run over the first entry of each
    kind; `NOT_THINNED` (before anything ran) when it cannot be."""
    shape = _shapes.get(id(func))
    if shape is None:
        shape = _shapes[id(func)] = _Shape(func)
    if not shape.thinnable:
        return NOT_THINNED
    names = shape.names
    bound = dict(zip(names, args, strict=False)) | kwargs
    lists = {n: v for n, v in bound.items() if n in shape.per_entry and v is not None}
    if not lists:
        return NOT_THINNED
    n = len(next(iter(lists.values())))
    if n < _MIN_ENTRIES or any(len(v) != n for v in lists.values()):
        return NOT_THINNED
    for name in shape.tensor_args:
        t = bound.get(name)
        if isinstance(t, torch.Tensor) and t.dim() != 0:
            return NOT_THINNED  # per-entry values in one tensor (addcdiv's `scalars`)
    kept, twin = _kinds(list(lists.values()), n, shape.in_place)
    if kept is None or len(kept) * 2 > n:
        return NOT_THINNED
    reduced = {name: type(v)(v[i] for i in kept) for name, v in lists.items()}
    positional = tuple(reduced.get(name, a) for name, a in zip(names, args, strict=False))
    out = func(*positional, **{k: reduced.get(k, v) for k, v in kwargs.items()})
    if out is None or (isinstance(out, (list, tuple)) and not out):
        return out  # in place: the entries it skipped would have changed no metadata
    results = list(out)
    if len(results) != len(kept) or not all(_own_storage(t) for t in results):
        return func(*args, **kwargs)  # no side effect to repeat: it returned new tensors
    position = {i: j for j, i in enumerate(kept)}
    full = [results[position[i]] if i in position else _like(results[position[twin[i]]])
            for i in range(n)]
    return type(out)(full) if isinstance(out, tuple) else full


def _kinds(lists: list, n: int, in_place: bool) -> tuple[list[int] | None, dict[int, int]]:
    """The first entry of each kind, and for every other entry the kept entry it is like."""
    kept: list[int] = []
    first: dict[object, int] = {}  # by kind (`_kind`'s tuple)
    twin: dict[int, int] = {}
    with no_torch_function():
        for i, entry in enumerate(zip(*lists, strict=True)):
            key = _kind(entry, in_place)
            if key is _NOT_FAKE:
                return None, {}
            if key is None:
                kept.append(i)
                continue
            j = first.setdefault(key, i)
            if j == i:
                kept.append(i)
            else:
                twin[i] = j
    return kept, twin


_NOT_FAKE = object()  # an entry holding a tensor that is not fake: no entry is thinned


def _kind(entry: tuple, in_place: bool) -> tuple | object | None:
    """What makes one entry's results what they are: each tensor's metadata and which of the
    entry's arguments it is the same object as (x, grad, grad), and each other value. None for
    an entry holding a fake constant (fake mode follows its value: always run it), `_NOT_FAKE`
    for one holding a tensor that is not fake, or a DTensor where it cannot be thinned."""
    key: list[tuple] = []
    spec = None
    for at, v in enumerate(entry):
        if isinstance(v, torch.Tensor):
            local = local_tensor(v)
            if local is not v:
                # A DTensor (FSDP2's and tensor parallelism's optimizer step): in place only,
                # the entry's DTensors alike and none Partial (the module's docstring says why).
                layout = dtensor_layout(v)
                if not in_place or layout is None or spec not in (None, layout) or any(
                        p.is_partial() for p in layout[1]):
                    return _NOT_FAKE
                spec = layout
                key.append((type(v), v.shape, v.stride(), spec))
                v = local
            if not isinstance(v, FakeTensor):
                return _NOT_FAKE
            if v.constant is not None:
                return None
            same = at  # the first of the entry's arguments that is this very tensor
            for before in range(at):
                if entry[before] is v or local_tensor(entry[before]) is v:
                    same = before
                    break
            key.append((type(v), v.dtype, v.shape, v.stride(), v.storage_offset(),
                        v.fake_device, v.requires_grad, same))
        else:
            key.append((type(v), v))
    return tuple(key)


def _own_storage(t) -> bool:
    """A new fake tensor with a storage of its own, as `fake_from` makes them (and a kernel
    makes its results): no constant, no offset, a storage just large enough."""
    if not isinstance(t, FakeTensor) or t.constant is not None:
        return False
    with no_torch_function():
        needed = required_storage_length(t.shape, t.stride(), 0) * t.element_size()
        return t.storage_offset() == 0 and t.untyped_storage().nbytes() == needed


def _like(t: FakeTensor) -> FakeTensor:
    with no_torch_function():
        return fake_from(t, described(t))
