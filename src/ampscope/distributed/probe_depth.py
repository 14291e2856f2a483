"""A model cut to its first repeated blocks, as `fit --gpus` probes it, and made whole again.

The repeated blocks are the model's largest ModuleList (what `workloads.repeated_blocks`
finds); a probe's model is a copy keeping the first of them, and the search puts the others
back while it compares the blocks' forwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def full_depth(module: nn.Module, blocks: list[nn.Module]) -> Iterator[None]:
    """The model's largest ModuleList holding `blocks` again (the probes' model keeps only
    the first ones), and as it was afterwards."""
    largest = blocks_of(module)[1]
    kept = len(largest)
    largest.extend(blocks[kept:])
    try:
        yield
    finally:
        del largest[kept:]


def blocks_of(module: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's largest ModuleList (its repeated blocks) and its path, as ops name it."""
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda item: len(item[1]))


def truncate(module: nn.Module, depth: int) -> None:
    """Keep the model's first `depth` repeated blocks (the full model's own): a probe's model."""
    del blocks_of(module)[1][depth:]
