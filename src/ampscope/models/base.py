"""What a workload needs to drive a model: `LoadedModel`, the `nn.Module` plus the few
conventions that differ between model families (each field: docs/api.md, "`LoadedModel`"), so
that the capture engine never needs to know which family it traces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


@dataclass
class LoadedModel:
    """A built model and how to drive it.

    `module` follows the nanoGPT convention unless the adapter functions say otherwise:
    `module(idx, targets)` returns the loss (or a `(logits, loss)` tuple) and `module(idx)`
    returns logits.
    """

    name: str
    module: nn.Module
    vocab_size: int
    max_seq_len: int
    family: str = "custom"  # "gpt2", "nanochat", "hf", "custom"
    # Dtype of the token ids the model trains on and samples with. nanochat's data loader
    # yields int32 ids for training; its sampler uses int64.
    train_ids_dtype: torch.dtype = torch.int64
    generate_ids_dtype: torch.dtype = torch.int64
    # Names of the batch entries, as the model's own code calls them.
    input_name: str = "idx"
    target_name: str = "targets"
    # Hugging Face causal LMs shift labels themselves: their target is the input itself.
    targets_are_shifted_inputs: bool = True
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    logits_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    generate_fn: Callable[[nn.Module, torch.Tensor, int, torch.Generator], torch.Tensor] | None = (
        None
    )
    notes: list[str] = field(default_factory=list)

    def make_batch(
        self, batch: int, seq: int, workload: str, generator: torch.Generator, device="cpu"
    ) -> Batch:
        """Random token ids (and targets for training), as the model's data loader makes them."""
        if seq > self.max_seq_len:
            raise ValueError(f"seq {seq} exceeds the model's context length {self.max_seq_len}")
        tokens = torch.randint(0, self.vocab_size, (batch, seq + 1), generator=generator)
        tokens = tokens.to(device)
        if workload == "generate":
            return {self.input_name: tokens[:, :seq].to(self.generate_ids_dtype)}
        ids = tokens[:, :seq].to(self.train_ids_dtype)
        if workload == "forward":
            return {self.input_name: ids}
        if self.targets_are_shifted_inputs:
            # contiguous: models flatten targets with .view(-1), as nanoGPT does
            targets = tokens[:, 1:].contiguous().to(torch.int64)
        else:
            targets = tokens[:, :seq].contiguous().to(torch.int64)
        return {self.input_name: ids, self.target_name: targets}

    def loss(self, batch: Batch) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(self.module, batch)
        out = self.module(batch[self.input_name], batch[self.target_name])
        return out[1] if isinstance(out, tuple) else out

    def logits(self, batch: Batch) -> torch.Tensor:
        if self.logits_fn is not None:
            return self.logits_fn(self.module, batch)
        out = self.module(batch[self.input_name])
        if isinstance(out, tuple):
            return out[0]
        return getattr(out, "logits", out)

    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator
    ) -> torch.Tensor:
        if self.generate_fn is not None:
            return self.generate_fn(self.module, idx, max_new_tokens, generator)
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise TypeError(f"{type(self.module).__name__} has no generate() method")
        return generate(idx, max_new_tokens, generator=generator)

    @property
    def num_parameters(self) -> int:
        """Parameters counted once per storage: tied weights (wte/lm_head) count once, as
        `parameters()` yields each Parameter once."""
        return sum(p.numel() for p in self.module.parameters())
