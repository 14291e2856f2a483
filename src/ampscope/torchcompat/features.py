"""What this torch build offers of the details the other modules here wrap.

Each module of the package that detects something registers a function returning its
`Feature`s; `features()` asks them all (each detection runs once per process, cached by the
module that does it). Nothing here is imported by `ampscope --version`: asking costs an import
of torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# The modules of this package that report features, in the order `--version -v` lists them.
_REPORTING = ("fake", "dispatch", "dynamo", "optim", "autograd", "distributed", "devices",
              "attention", "rnn", "policy", "flops", "modules", "workers", "autocast_regions")


@dataclass(frozen=True)
class Feature:
    """One private detail, or one speed trick that needs some: whether this build has it."""

    name: str
    available: bool
    detail: str  # what it is, or why it is missing
    needed_by: str = ""  # what is off without it: a speed trick (tricks.Trick value), a feature


def features() -> list[Feature]:
    """Every detail and trick, as found on the running torch."""
    found: list[Feature] = []
    for name in _REPORTING:
        module = importlib.import_module(f"ampscope.torchcompat.{name}")
        found.extend(module.features())
    return found


def torch_build() -> str:
    """The torch version and build: '2.13.0+cpu (CPU build)', '2.15.0+cu132 (CUDA 13.2 build)'."""
    import torch

    cuda = torch.version.cuda
    kind = f"CUDA {cuda} build" if cuda else "CPU build"
    return f"{torch.__version__} ({kind})"
