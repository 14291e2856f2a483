"""The optimizers' private lists and hook dicts that ampscope reads or extends.

- `foreach_supported_types()`: the classes for which an optimizer, and `clip_grad_norm_`, pick
  their foreach implementation by default (a predicted run adds FakeTensor while it runs).
- `foreach_devices()`: the device types with foreach kernels.
- `global_step_pre_hooks()` / `step_post_hooks(opt)`: the dicts `register_*_hook` fill, for a
  hook that removes itself while torch iterates over them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.optim.optimizer as _optimizer

from ampscope.torchcompat.features import Feature


def foreach_supported_types() -> list[list[type]]:
    """Every list of tensor classes torch consults for its foreach default (one or two)."""
    import torch.utils._foreach_utils as foreach_utils

    found: list[list[type]] = []
    for module in (_optimizer, foreach_utils):
        types = getattr(module, "_foreach_supported_types", None)
        if isinstance(types, list) and all(t is not types for t in found):
            found.append(types)
    return found


def foreach_devices() -> tuple[str, ...]:
    """The devices PyTorch's optimizers run their `_foreach_` implementation on by default
    (("cuda",) where the build does not say: every release from 2.0 has at least that)."""
    supported = getattr(_optimizer, "_get_foreach_kernels_supported_devices", None)
    return tuple(supported()) if supported is not None else ("cuda",)


# A hook dict, by handle id (an OrderedDict at run time); hooks of any signature.
HookDict = dict[int, Callable[..., Any]]


def global_step_pre_hooks() -> HookDict:
    """The dict `register_optimizer_step_pre_hook` adds to."""
    return _optimizer._global_optimizer_pre_hooks


def step_post_hooks(optimizer: torch.optim.Optimizer) -> HookDict:
    """The dict `optimizer.register_step_post_hook` adds to."""
    return optimizer._optimizer_step_post_hooks


def features() -> list[Feature]:
    types = foreach_supported_types()
    listed = hasattr(_optimizer, "_get_foreach_kernels_supported_devices")
    return [Feature("foreach default types", bool(types),
                    f"{len(types)} list(s) of classes optimizers take foreach for" if types else
                    "missing: _foreach_supported_types in torch.optim.optimizer and "
                    "torch.utils._foreach_utils",
                    "a predicted optimizer's foreach default (it takes the for-loop)"),
            Feature("optimizer foreach devices", listed,
                    "torch.optim's foreach device list" if listed else
                    "not on this build: cuda is taken as the one foreach device")]
