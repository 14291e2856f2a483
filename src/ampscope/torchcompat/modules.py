"""nn.Module's own containers and hook dicts, as ampscope reads and fills them.

`nn.Module` keeps its parameters, buffers and children in dicts of its own (`_parameters`,
`_buffers`, `_modules`) and its hooks in more; ampscope walks them without the per-call cost of
`named_parameters()` and puts working copies into them for a run. Unchanged since torch 1.x,
but private: reached only through here.

Namesakes, the same concern at another layer: `runs/modules.py`."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ampscope.torchcompat.features import Feature

# Hooks that make a module's calls differ from its twin's (a hooked block is never replayed).
_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# Global forward-hook dicts a handle's remove() leaves entries in (torch's, for with_kwargs and
# always_call hooks).
_GLOBAL_FORWARD_EXTRAS = ("_global_forward_hooks_with_kwargs",
                          "_global_forward_hooks_always_called")


def parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameters by name, the dict itself (assigning replaces one)."""
    return module._parameters


def buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers by name, the dict itself."""
    return module._buffers


def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's direct submodules by name, the dict itself."""
    return module._modules


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of the buffers the module leaves out of its state_dict."""
    return module._non_persistent_buffers_set


@functools.cache
def module_fields() -> frozenset[str]:
    """What every nn.Module keeps in its `__dict__` (read from a new one, so a release that adds
    a field is followed), and what `Module.compile()` adds."""
    return frozenset(vars(nn.Module())) | {"_compiled_call_impl"}


def has_call_hooks(module: nn.Module) -> bool:
    """Does the module have forward or backward hooks of its own?"""
    return any(getattr(module, name, None) for name in _CALL_HOOKS)


def drop_global_forward_hook(handle_id: int) -> None:
    """Remove what a removed global forward hook left in torch's extra dicts."""
    from torch.nn.modules import module as nn_module

    for name in _GLOBAL_FORWARD_EXTRAS:
        getattr(nn_module, name, {}).pop(handle_id, None)


def features() -> list[Feature]:
    m = nn.Module()
    found = all(isinstance(getattr(m, n, None), dict)
                for n in ("_parameters", "_buffers", "_modules"))
    return [Feature("nn.Module containers", found,
                    "_parameters, _buffers, _modules, the hook dicts" if found else
                    "missing: an nn.Module keeps no _parameters, _buffers and _modules dicts",
                    "every recording")]
