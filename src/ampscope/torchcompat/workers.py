"""The private PyTorch details a DataLoader worker forked during a run uses to leave the run
(runtime/workers.py): the function every worker process starts in, this thread's two mode
stacks, and the global hook dicts of nn.Module and torch.optim.

A forked process inherits its parent's thread-local mode stacks and every global hook, and none
of them has a public way to be listed and thinned: each detail is looked up here, once, and a
build without one leaves the workers as they are (they still run, only traced for nothing).

Namesakes, the same concern at another layer: `runtime/workers.py`."""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch

from ampscope.torchcompat.features import Feature

_WORKER_MODULE, _WORKER_LOOP = "torch.utils.data._utils.worker", "_worker_loop"


@functools.cache
def worker_loop_slot() -> tuple[types.ModuleType, str] | None:
    """(module, name) of the function a DataLoader starts each worker process with, which
    DataLoader reads from that module as it starts its workers; None where this build has
    none."""
    try:
        module = importlib.import_module(_WORKER_MODULE)
    except ImportError:
        return None
    return (module, _WORKER_LOOP) if callable(getattr(module, _WORKER_LOOP, None)) else None


# (list, pop, push) of one mode stack.
_Stack = tuple[Callable[[], list], Callable[..., Any], Callable[..., None]]


def _function_stack() -> _Stack:
    """(list, pop, push) of this thread's torch function modes."""
    from torch import overrides

    return overrides._get_current_function_mode_stack, overrides._pop_mode, overrides._push_mode


def _dispatch_stack() -> _Stack:
    """(list, pop, push) of this thread's dispatch modes above the infrastructure ones (a fake
    or proxy mode sits in a slot of its own, below every other mode, and is left there)."""
    from torch.utils import _python_dispatch as python_dispatch

    infra = {id(m) for key in torch._C._TorchDispatchModeKey.__members__.values()
             if (m := torch._C._get_dispatch_mode(key)) is not None}

    def listed() -> list:
        return [m for m in python_dispatch._get_current_dispatch_mode_stack()
                if id(m) not in infra]

    return listed, python_dispatch._pop_mode, python_dispatch._push_mode


def drop_modes(owned: Callable[[object], bool]) -> int:
    """Take every mode `owned` says is to go off this thread's function and dispatch mode
    stacks, the others kept in their order; how many went. Only for a process that never
    returns to the code that entered them (a forked worker): their `__exit__` never runs."""
    dropped = 0
    for listed, pop, push in (_function_stack(), _dispatch_stack()):
        stack = listed()
        for _ in stack:
            pop()
        for mode in stack:
            if owned(mode):
                dropped += 1
            else:
                push(mode)
    return dropped


# The global hook dicts, by handle id: nn.Module's (forward, backward, registration) and
# torch.optim's (step).
_HOOK_DICTS = (
    ("torch.nn.modules.module", ("_global_forward_pre_hooks", "_global_forward_hooks",
                                 "_global_forward_hooks_with_kwargs",
                                 "_global_forward_hooks_always_called",
                                 "_global_backward_pre_hooks", "_global_backward_hooks",
                                 "_global_module_registration_hooks",
                                 "_global_parameter_registration_hooks",
                                 "_global_buffer_registration_hooks")),
    ("torch.optim.optimizer", ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")),
)


def drop_global_hooks(owned: Callable[[object], bool]) -> int:
    """Remove every global module and optimizer hook `owned` says is to go, with what torch
    keeps beside it under the same handle id; how many went."""
    ids: set[int] = set()
    dicts: list[dict] = []
    for module_name, names in _HOOK_DICTS:
        module = importlib.import_module(module_name)
        for name in names:
            found = getattr(module, name, None)
            if isinstance(found, dict):
                dicts.append(found)
                ids.update(k for k, hook in found.items() if callable(hook) and owned(hook))
    for found in dicts:
        for k in ids & found.keys():
            del found[k]
    return len(ids)


def features() -> list[Feature]:
    slot = worker_loop_slot()
    return [Feature(f"{_WORKER_MODULE}.{_WORKER_LOOP}", slot is not None,
                    "where DataLoader workers start: a worker forked during a run leaves it"
                    if slot is not None else "missing: DataLoader workers inherit the run's "
                    "modes and hooks (they still work, traced for nothing)",
                    "DataLoader(num_workers>0) under `ampscope run`")]
