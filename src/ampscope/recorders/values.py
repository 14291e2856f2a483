"""Values, not just dtypes: what each module returned, each gradient, each weight, for numerics.

Dtype traces hold no tensors; numerics needs the numbers. `ValueRecorder` keeps, for one run,
a float64 CPU copy of the first floating output of every module call (in call order, per module
name), the loss, and — read by the caller after backward — gradients and weights. Copies in
float64 so that comparing against a float64 reference loses nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _first_floating(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_floating(v)
            if found is not None:
                return found
    if isinstance(value, dict) or hasattr(value, "values"):  # HF ModelOutput is a dict
        try:
            return _first_floating(list(value.values()))
        except TypeError:
            return None
    return None


def as_float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64, copy=True)


@dataclass
class Values:
    """One run's numbers, float64 on the CPU."""

    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # module → per call
    types: dict[str, str] = field(default_factory=dict)  # module → class name
    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter → its gradient
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter → value used


@contextmanager
def recording_values(model: nn.Module) -> Iterator[Values]:
    """Record every module's output during the body. The hook is removed afterwards, also when
    the body raises."""
    names = {m: n for n, m in model.named_modules()}
    values = Values()

    def hook(module, args, output):
        name = names.get(module)
        if name is None:
            return
        t = _first_floating(output)
        if t is not None:
            values.outputs.setdefault(name, []).append(as_float64(t))
            values.types.setdefault(name, type(module).__name__)

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        yield values
    finally:
        handle.remove()


def read_weights(model: nn.Module, values: Values) -> None:
    """The weights the run starts from (its working copies, in the setting's dtype)."""
    for name, p in model.named_parameters():
        values.weights[name] = as_float64(p)


def read_grads(model: nn.Module, values: Values) -> None:
    """Gradients after backward, before the working copies are restored."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            values.grads[name] = as_float64(p.grad)
