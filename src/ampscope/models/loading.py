"""A model as the run needs it: a spec (a name, `hf:PATH`, `package.module:factory`), a bare
`nn.Module` or a `LoadedModel`, as a `LoadedModel`."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from ampscope.errors import AmpscopeError
from ampscope.models.base import Batch, LoadedModel
from ampscope.runtime.virtual_device import VirtualDevice

__all__ = ["load"]


def load(model: str | nn.Module | LoadedModel, device: str = "cpu", *,
         have_inputs: bool = False, target_device: str | None = None,
         virtual: VirtualDevice | None = None) -> LoadedModel:
    """A model spec, a module or a LoadedModel, as a LoadedModel.

    `target_device` is the device an emulated run stands for (see registry.resolve); with
    `virtual`, a spec's own code (a factory, the module it imports) runs on that virtual device,
    backed by `device`."""
    from ampscope.models import registry

    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, nn.Module):
        try:
            return registry.wrap_module(model, type(model).__name__)
        except AmpscopeError:
            if not have_inputs:
                raise AmpscopeError(
                    f"pass inputs= (a tensor or a dict of tensors) to trace this "
                    f"{type(model).__name__}: it has no config.vocab_size and block_size to "
                    "make token ids from"
                ) from None
            # With inputs given, nothing needs the vocabulary or context length; the batch is
            # the forward's arguments by name (train: the forward returns the loss).
            return LoadedModel(type(model).__name__, model, vocab_size=0, max_seq_len=2**62,
                               logits_fn=_call_with_batch, loss_fn=_loss_of_call)
    if isinstance(model, str):
        if virtual is None:
            return registry.resolve(model, device=device, target_device=target_device)
        with virtual.active(backing=device):
            return registry.resolve(model, device=device, target_device=target_device,
                                    build_device=virtual.target)
    raise AmpscopeError(f"cannot trace a {type(model).__name__}; pass a model name or an nn.Module")


def _call(module: nn.Module, batch: Batch):
    """The forward called with the batch: by name where the forward has those parameters,
    else in order (a lone tensor named `idx` for a forward that takes `x`)."""
    names: Mapping[str, inspect.Parameter]
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        names = {}
    if set(batch) <= set(names):
        return module(**batch)
    return module(*batch.values())


def _call_with_batch(module: nn.Module, batch: Batch):
    out = _call(module, batch)
    return out[0] if isinstance(out, tuple) else out


def _loss_of_call(module: nn.Module, batch: Batch) -> torch.Tensor:
    out = _call(module, batch)
    candidates = out if isinstance(out, tuple) else (out,)
    loss = next((t for t in candidates if isinstance(t, torch.Tensor) and t.dim() == 0), None)
    if loss is None:
        raise AmpscopeError(f"a train step needs a loss: {type(module).__name__}.forward returned "
                            "no scalar tensor; pass workload=a callable that computes it")
    return loss
