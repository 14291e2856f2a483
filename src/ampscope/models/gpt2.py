"""GPT-2 in the style of nanoGPT's `model.py`: one file, readable top to bottom.

Module names match nanoGPT (and so the Hugging Face GPT-2 checkpoint layout), so a trace of this
model reads like a trace of the code people actually train: `transformer.h.0.attn.c_attn`, ...

Precision: nothing here chooses a dtype. Parameters are created in the default dtype and every
op follows its inputs, so the dtypes a trace shows come from the setting (parameter dtype,
autocast) alone. That makes GPT-2 the baseline against which nanochat's explicit choices stand
out.

References: Radford et al. 2019 (GPT-2); Karpathy, nanoGPT `model.py` (MIT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ampscope.models.base import LoadedModel


@dataclass
class GPTConfig:
    block_size: int  # context length T_max
    vocab_size: int  # V
    n_layer: int  # L
    n_head: int  # nh
    n_embd: int  # C
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads: (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = cast("_Transformer", nn.ModuleDict(  # (typed at the end of the file)
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): the token embedding and the output projection are
        # one Parameter, counted once and updated once.
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # GPT-2 paper: scale the init of the projections that write into the residual stream
        # by 1/sqrt(number of residual additions), 2 per layer (attention and MLP).
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, (B, T, V), and the mean cross-entropy if targets are given."""
        B, T = idx.size()
        assert self.config.block_size >= T, f"sequence of {T} > block size {self.config.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C), broadcast over the batch
        x = tok_emb + pos_emb
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens; returns (B, T + new), int64.

        No KV cache: every step reruns the whole (cropped) context, as nanoGPT does.
        """
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]  # crop the context to the block size
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature  # (B, V)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1) int64
            idx = torch.cat((idx, idx_next), dim=1)  # an int32 prompt is promoted to int64
        return idx

    def estimate_flops(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at sequence length `seq_len`.

        nanoGPT's convention (from PaLM, Chowdhery et al. 2022, appendix B):

            6 * N + 12 * L * H * Q * T

        Matmuls with the weights. Each parameter of a weight matrix takes part in one
        multiply-add per token in the forward pass: 2 FLOPs. The backward pass does two matmuls
        of the same size, one for the gradient of the input and one for the gradient of the
        weight: 4 FLOPs. Hence 6 FLOPs per parameter per token. N is the parameter count
        without the position embedding, which is a lookup, not a matmul. The token embedding
        counts once: its lookup is free, but the same matrix is the tied lm_head, a full
        C x V matmul. N also includes biases and LayerNorm weights, which do no matmul; they
        are a small overcount (0.1% for gpt2) that the convention accepts.

        Attention. Per layer and head, the scores q @ k^T and the weighted sum att @ v are each
        one multiply-add per (query, key) pair per head dimension: 2 * T * Q FLOPs per token
        each, so 4 * T * Q forward, and twice that backward, 12 * T * Q in all; times H heads
        and L layers. Causal masking is not credited: the formula (like the math kernel and
        torch's FLOP counter) counts the full T x T score matrix, not the half that is used.
        """
        n_params = sum(p.numel() for p in self.parameters())  # tied weights count once
        n_params -= self.transformer.wpe.weight.numel()
        L, H = self.config.n_layer, self.config.n_head
        Q = self.config.n_embd // self.config.n_head
        return 6 * n_params + 12 * L * H * Q * seq_len


# The presets are entries of catalog.py (imported here, not at the top, so that the lines above
# keep the numbers traces cite).
from ampscope.models.catalog import Presets  # noqa: E402

PRESETS: Presets[GPTConfig] = Presets("gpt2", GPTConfig)


def load(preset: str, *, device: str | torch.device = "cpu",
         target_device: str | None = None) -> LoadedModel:
    """Build the preset with random GPT-2 init on `device` ("meta" allocates nothing).

    GPT-2 makes no device-dependent choice, so `target_device` (the device an emulated run
    stands for) changes nothing here.
    """
    config = PRESETS[preset]
    with torch.device(device):
        model = GPT(config)
    return LoadedModel(
        name=preset,
        module=model,
        vocab_size=config.vocab_size,
        max_seq_len=config.block_size,
        family="gpt2",
    )


# For the type checker, and at the end so that the lines above keep the numbers that traces
# cite ("gpt2.py:125"): torch types a ModuleDict's entries, read as attributes, as
# Tensor | Module; `_Transformer` says what `GPT.transformer` holds.
from typing import TYPE_CHECKING, cast  # noqa: E402

if TYPE_CHECKING:
    class _Transformer(nn.ModuleDict):
        wte: nn.Embedding
        wpe: nn.Embedding
        h: nn.ModuleList
        ln_f: nn.LayerNorm
