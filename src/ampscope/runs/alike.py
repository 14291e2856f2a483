"""Which of a model's blocks are alike: structurally identical, so that one recorded call can
stand for another's (runs/repeats.py replays them). What "alike" takes, and what it cannot see:
docs/how-it-works.md#repeated-blocks-traced-once, "Which blocks".
"""

from __future__ import annotations

import functools
import inspect
import re
import types
from typing import Any, cast

import torch
from torch import nn

from ampscope.runs.tensor_meta import tensor_key
from ampscope.torchcompat import modules as module_state

MIN_BLOCKS = 5  # two recorded at each end and at least one replayed

# Values compared by equality: as attributes, as arguments a call passes, as outputs.
PLAIN_VALUES = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _value_key(value: Any) -> Any:
    if isinstance(value, PLAIN_VALUES):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, PLAIN_VALUES) for v in value):
        return (type(value), tuple(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", tensor_key(value))
    if isinstance(value, functools.partial):  # an activation made per layer: gelu(tanh)
        return ("partial", _value_key(value.func), tuple(map(_value_key, value.args)),
                tuple(sorted((k, _value_key(v)) for k, v in value.keywords.items())))
    if isinstance(value, types.MethodType):  # bound to its own module: the same method
        return ("method", value.__func__, type(value.__self__))
    if type(value).__eq__ is not object.__eq__:  # a config made per layer (a frozen dataclass)
        try:
            hash(value)
            return ("equal", type(value), value)
        except TypeError:
            pass
    return ("object", id(value))  # a shared config object, a function: the same object


def _structure(block: nn.Module) -> list[tuple] | None:
    """(where, what) pairs describing a block; None when it carries hooks or its own forward."""
    out: list[tuple] = []
    fields = module_state.module_fields()
    for rel, m in block.named_modules():
        if module_state.has_call_hooks(m) or "forward" in m.__dict__:
            return None
        out.append((rel, "class", type(m)))
        for kind, named in (("parameter", module_state.parameters(m)), ("buffer", module_state.buffers(m))):
            for key, t in named.items():
                out.append((rel, kind, key, None if t is None else tensor_key(t)))
        for key, value in m.__dict__.items():
            if key not in fields:
                out.append((rel, "attribute", key, _value_key(value)))
    return out


def _reads_index(cls: type, attribute: str) -> bool:
    """Whether a class's methods (other than __init__, its own or inherited) use
    `self.<attribute>` other than as a call's argument or a subscript: code that branches on a
    block's index makes the blocks differ. A method whose source cannot be read counts as one
    that does."""
    methods = tuple(member for klass in cls.__mro__ if klass not in (nn.Module, object)
                    for name, member in vars(klass).items()
                    if name != "__init__" and inspect.isfunction(member))
    return _any_reads(methods, attribute)


@functools.lru_cache(maxsize=1024)
def _any_reads(methods: tuple[types.FunctionType, ...], attribute: str) -> bool:
    """`_reads_index` for these very functions, whose sources are read and searched once per
    process (a method replaced is another function, searched again)."""
    passed = re.compile(r"[(,\[]\s*(?:\w+\s*=\s*)?self\." + attribute + r"\s*[,)\]]")
    used = re.compile(r"self\." + attribute + r"\b")
    for member in methods:
        try:
            source = inspect.getsource(member)
        except (OSError, TypeError):
            return True
        if len(used.findall(source)) != len(passed.findall(source)):
            return True
    return False


def alike(blocks: list[nn.Module], first_index: int = 0,
          structures: list[list[tuple] | None] | None = None) -> bool:
    """Whether the blocks are structurally identical up to an index attribute (each block's
    position in its list: `first_index` for the first of them). `structures`: the blocks'
    `_structure`s, where the caller has them already."""
    if structures is None:
        structures = [_structure(b) for b in blocks]
    if any(s is None for s in structures):
        return False
    known = cast("list[list[tuple]]", structures)  # none of them None: checked just above
    first = known[0]
    if any(len(s) != len(first) for s in known):
        return False
    for entries in zip(*known, strict=True):
        if all(e == entries[0] for e in entries):
            continue
        where, kind, key = entries[0][0], entries[0][1], entries[0][2]
        # Only an integer attribute that is each block's index may differ (layer_idx).
        if kind != "attribute" or any(e[:3] != (where, kind, key) or type(e[3]) is not int
                                      or e[3] != first_index + i for i, e in enumerate(entries)):
            return False
        module = blocks[0].get_submodule(where) if where else blocks[0]
        if _reads_index(type(module), key):
            return False
    ids = [id(p) for b in blocks for p in b.parameters()]
    return len(ids) == len(set(ids))  # no parameter shared between blocks


def _stretches(structures: list[list[tuple] | None]) -> list[tuple[int, int]]:
    """The longest stretches [start, end) of at least MIN_BLOCKS consecutive blocks that look
    alike — the same structure, an integer attribute equal to each one's position aside — as
    candidates for `alike` (a model whose first layers are dense and the rest mixtures of
    experts has one stretch of each). `structures`: each block's `_structure`."""
    # Integer attributes whose value varies along the list may be an index; one that is the
    # same in every block (8 key-value groups) is no index where it equals a position (block 8).
    values: dict[tuple, set] = {}
    for structure in structures:
        for e in structure or ():
            if e[1] == "attribute" and type(e[3]) is int:
                values.setdefault(e[:3], set()).add(e[3])
    varying = {where for where, seen in values.items() if len(seen) > 1}
    keys = [None if structure is None else tuple(
        (*e[:3], "index") if e[:3] in varying and e[3] == i else e for e in structure)
        for i, structure in enumerate(structures)]
    stretches, start = [], 0
    for i in range(1, len(structures) + 1):
        if i == len(structures) or keys[i] != keys[start]:
            if keys[start] is not None and i - start >= MIN_BLOCKS:
                stretches.append((start, i))
            start = i
    return stretches


def repeated_runs(model: nn.Module) -> list[tuple[list[str], list[nn.Module]]]:
    """The outermost runs of identical blocks: (qualified names, blocks) of each. A run is a
    whole ModuleList or Sequential, or a stretch of consecutive children of one."""
    names = {m: n for n, m in model.named_modules()}
    runs: list[tuple[list[str], list[nn.Module]]] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m.children())
        if len(children) < MIN_BLOCKS:
            continue
        structures = [_structure(c) for c in children]
        for start, end in _stretches(structures):
            blocks = children[start:end]
            if alike(blocks, start, structures[start:end]):
                runs.append(([names[b] for b in blocks], blocks))
                inside.update(id(x) for b in blocks for x in b.modules())
    return runs


def attribute_ids(block: nn.Module) -> list:
    """What each of the block's modules holds outside its parameters, buffers and submodules,
    by identity: a block that sets an attribute as it runs (a cache made on first use) shows."""
    return [(id(m), tuple((k, id(v)) for k, v in m.__dict__.items() if k not in module_state.module_fields()))
            for m in block.modules()]
