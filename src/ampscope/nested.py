"""The tensors in nested op or call arguments, found without pytree.

Every op and torch-level call of a traced step passes through here (the recorders, the virtual
device), so the walk avoids `torch.utils._pytree` (a generic flattener that costs 4-7× this
walk, measured) and looks at each argument's type once per type.
"""

from __future__ import annotations

import torch

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
