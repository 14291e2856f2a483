"""What a block call takes and leaves, as the replay of repeated blocks (runs/repeats.py)
compares them: its arguments' metadata and structure, what it shares with block 0, the grad and
autocast state it ran under, and the storages its autograd graph saved."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ampscope.runs.memory import saved_tensors, storage_of
from ampscope.torchcompat.autograd import reads_saved_raw, saving_through_hooks
from ampscope.torchcompat.dispatch import pytree, pytree_children

if TYPE_CHECKING:
    from torch.autograd.graph import Node


def grad_and_autocast_state() -> tuple:
    """Grad mode and autocast (on, dtype) on the CPU and CUDA: a replayed call ran under the
    state its recorded twin ran under."""
    return (torch.is_grad_enabled(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                  for d in ("cpu", "cuda")))


def plain_spec(spec) -> bool:
    """Whether a pytree structure is made of tuples, lists and dicts only (an object that
    pytree knows how to flatten, a cache, may be changed by the block)."""
    return spec.type in (None, tuple, list, dict) and all(
        plain_spec(c) for c in pytree_children(spec))


def shared_with_first(tensors: list, first: list[weakref.ref]) -> list[bool]:
    """Per tensor: whether block 0 was given the very same tensor (a rotary table, a mask)."""
    given = [r() for r in first]
    return [any(t is g for g in given) for t in tensors]


def saved_storages(out, inputs: list) -> set[int] | None:
    """Ids of the storages the autograd graph behind `out` saved, down to the block's inputs;
    None where they cannot be read without running saved-tensor hooks (checkpointing's, on a
    torch that can only unpack saved tensors).

    The nodes are held while walked: a node's Python object may be made anew on each access
    (torch before 2.13 keeps none), so an id is only a node's while the node is held."""
    if not reads_saved_raw() and saving_through_hooks():
        return None
    stop = {id(n): n for n in (t.grad_fn for t in inputs) if n is not None}
    found: set[int] = set()
    seen: dict[int, object] = {}
    stack: list[Node | None] = [t.grad_fn for t in pytree.tree_flatten(out)[0]
                                if isinstance(t, torch.Tensor) and t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        for t in saved_tensors(node):
            s = storage_of(t)
            if s is not None:
                found.add(id(s))
        stack.extend(n for n, _ in node.next_functions)
    return found
