"""A GPT in the style of Karpathy's nanochat `gpt.py`: one file, readable top to bottom.

What sets it apart from GPT-2: rotary position embeddings instead of learned ones, RMSNorm
without learnable parameters (also on queries and keys: QK-norm), ReLU² in the MLP, no biases,
untied embedding and lm_head, grouped-query attention, logit softcapping, and a KV cache for
sampling.

nanochat is explicit about precision, and so is this file: every place that picks a dtype says
why. The choices a trace will show:
  - rotary `cos`/`sin` buffers are bfloat16, always;
  - on CUDA the token embedding is stored in bfloat16;
  - logits are cast to float32 before the softcap and the loss;
  - training ids are int32 (see `load`), sampling ids int64.

One deliberate difference: nanochat initialises `lm_head` and every `c_proj` to zero, so a fresh
model predicts the uniform distribution. Here they get the same random init as the other
Linears, so that a freshly built model has non-trivial logits and residual updates to trace and
to compare across precisions.

References: Karpathy, nanochat `nanochat/gpt.py` (MIT); Su et al. 2021 (RoPE); Henry et al. 2020
(QK-norm); So et al. 2021 (ReLU², Primer); Ainslie et al. 2023 (GQA); Gemma 2 (softcapping).
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
    sequence_len: int  # training context length T
    vocab_size: int  # V
    n_layer: int  # L
    n_head: int  # number of query heads, nh
    n_kv_head: int  # number of key/value heads, nkv (GQA when < n_head)
    n_embd: int  # C


def config_for_depth(depth: int) -> GPTConfig:
    """nanochat's sizing rule: width 64 x depth, heads of dimension 128, 2**16 vocabulary."""
    model_dim = 64 * depth
    n_head = max(1, math.ceil(model_dim / 128))
    return GPTConfig(
        sequence_len=2048,
        vocab_size=2**16,
        n_layer=depth,
        n_head=n_head,
        n_kv_head=n_head,
        n_embd=model_dim,
    )


def norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm with no learnable parameters; it runs in (and returns) the dtype of x."""
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1[i], x2[i]) of x (B, T, nh, hs) by position-dependent angles."""
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]  # (B, T, nh, hs/2) each
    # cos/sin are bf16: with fp32 x, type promotion makes these products fp32; with bf16 x
    # (under autocast) they stay bf16.
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    # Cast back explicitly so the result has x's dtype whatever the buffers' dtype.
    return torch.cat([y1, y2], dim=3).to(x.dtype)


class KVCache:
    """Keys and values of every layer for the tokens seen so far, preallocated to max_len."""

    def __init__(self, n_layer: int, max_len: int):
        self.max_len = max_len
        self.pos = 0  # number of tokens already in the cache
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    def insert(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, nkv, T, hs) for one layer; return all keys and values so far."""
        if self.k[layer_idx] is None:
            # Allocated on first use with the dtype of the keys: bf16 under bf16 autocast,
            # which halves the cache compared with the fp32 parameters.
            B, nkv, _, hs = k.shape
            self.k[layer_idx] = k.new_empty(B, nkv, self.max_len, hs)
            self.v[layer_idx] = v.new_empty(B, nkv, self.max_len, hs)
        end = self.pos + k.size(2)
        assert end <= self.max_len, f"KV cache full: {end} > {self.max_len}"
        cache_k, cache_v = cast("_KV", (self.k[layer_idx], self.v[layer_idx]))  # allocated above
        cache_k[:, :, self.pos : end] = k
        cache_v[:, :, self.pos : end] = v
        if layer_idx == len(self.k) - 1:  # the last layer has seen the new tokens: advance
            self.pos = end
        return cache_k[:, :, :end], cache_v[:, :, :end]  # (B, nkv, pos + T, hs)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        assert config.n_head % config.n_kv_head == 0
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)  # (B, T, nh, hs)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, nkv, hs)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, nkv, hs)
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)  # QK-norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)
        if kv_cache is not None:
            k, v = kv_cache.insert(self.layer_idx, k, v)  # (B, nkv, Tk, hs), Tk = cached + T
        Tq, Tk = q.size(2), k.size(2)
        enable_gqa = self.n_head != self.n_kv_head  # sdpa repeats the kv heads to nh
        if Tq == Tk:
            # Training, or the prefill of an empty cache: plain causal attention.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        elif Tq == 1:
            # One new token: it attends to everything cached, itself included, so no mask.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=enable_gqa)
        else:
            raise NotImplementedError("several new tokens on a non-empty KV cache")
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)  # (B, T, 4C)
        x = F.relu(x).square()  # ReLU²
        return self.c_proj(x)  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        x = x + self.attn(norm(x), cos_sin, kv_cache)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = cast("_Transformer", nn.ModuleDict(  # (typed at the end of the file)
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            )
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied
        # Rotary tables for 10x the training length, so sampling can run past it (as nanochat).
        self.rotary_seq_len = config.sequence_len * 10
        cos, sin = self._precompute_rotary_embeddings()
        # Not persistent: derived from the config, so not part of a checkpoint.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, target_device: str | None = None) -> None:
        """Random init, rotary tables, and (on CUDA) the bf16 embedding, as nanochat does.

        Separate from __init__ so that a model built on "meta" and moved with `to_empty()` can
        be initialised in place on its real device. `target_device` is the device the model is
        meant for when that differs from where it is built (an emulated CUDA run on the CPU).
        """
        self.apply(self._init_weights)
        self.cos, self.sin = self._precompute_rotary_embeddings()
        # Store the token embedding in bf16 on CUDA: it is the largest single matrix (V x C),
        # bf16 halves its memory (and its optimizer state's), and under bf16 autocast the
        # activations it feeds are bf16 anyway. Elsewhere (CPU, MPS) it stays fp32.
        if (target_device or self.transformer.wte.weight.device.type) == "cuda":
            self.transformer.wte.to(dtype=torch.bfloat16)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            # nanochat: std 1/sqrt(fan_in), shrunk for matrices that narrow (fan_out < fan_in).
            fan_out, fan_in = module.weight.shape
            std = 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=1.0)  # it is RMS-normed right after

    def _precompute_rotary_embeddings(
        self, base: float = 10000.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables, (1, rotary_seq_len, 1, hs/2), bf16, on the embedding's device."""
        head_dim = self.config.n_embd // self.config.n_head
        device = self.transformer.wte.weight.device
        # The angles are computed in fp32: positions up to 20k times frequencies need the
        # mantissa; only the final cos/sin values are rounded to bf16.
        channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (base ** (channel_range / head_dim))  # (hs/2,)
        t = torch.arange(self.rotary_seq_len, dtype=torch.float32, device=device)  # (T,)
        freqs = torch.outer(t, inv_freq)  # (T, hs/2)
        # bf16, as nanochat: half the memory of fp32, and they multiply bf16 q and k under
        # autocast, so fp32 tables would only add casts.
        cos, sin = freqs.cos().bfloat16(), freqs.sin().bfloat16()
        return cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, hs/2)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The mean loss if targets are given (ignore_index -1), else logits (B, T, V) in fp32.

        idx may be int32 (nanochat trains on int32 ids) or int64; nn.Embedding takes both.
        """
        B, T = idx.size()
        T0 = 0 if kv_cache is None else kv_cache.pos  # position of the first new token
        assert self.cos.size(1) >= T0 + T, f"sequence of {T0 + T} > rotary cache {self.cos.size(1)}"
        cos_sin = self.cos[:, T0 : T0 + T], self.sin[:, T0 : T0 + T]  # (1, T, 1, hs/2) each
        x = self.transformer.wte(idx)  # (B, T, C)
        x = norm(x)
        for block in self.transformer.h:
            x = block(x, cos_sin, kv_cache)
        x = norm(x)
        logits = self.lm_head(x)  # (B, T, V), bf16 under bf16 autocast
        # Softcap and loss in fp32: tanh and log-softmax over a 65k vocabulary lose too much
        # in bf16 (8 mantissa bits), and the fp32 logits cost only one (B, T, V) buffer.
        logits = logits.float()
        softcap = 15.0
        logits = softcap * torch.tanh(logits / softcap)  # smoothly bound logits to (-15, 15)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

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

        The prompt goes through the model once (prefill); after that each step feeds only the
        newest token and attends to the keys and values cached for the earlier ones.
        temperature 0 means greedy (argmax).
        """
        kv_cache = KVCache(self.config.n_layer, max_len=idx.size(1) + max_new_tokens)
        new_ids = idx  # the tokens the cache has not seen yet: first the prompt, then one
        for _ in range(max_new_tokens):
            logits = self(new_ids, kv_cache=kv_cache)[:, -1, :]  # (B, V)
            new_ids = sample_next_token(logits, generator, temperature, top_k)  # (B, 1) int64
            idx = torch.cat((idx, new_ids), dim=1)  # an int32 prompt is promoted to int64
        return idx

    def estimate_flops(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at sequence length `seq_len`.

        nanochat's convention (from PaLM, Chowdhery et al. 2022, appendix B):

            6 * (N - N_embedding) + 12 * L * H * Q * T

        Matmuls with the weights. Each weight takes part in one multiply-add per token in the
        forward pass: 2 FLOPs. The backward pass does two matmuls of the same size, one for the
        gradient of the input and one for the gradient of the weight: 4 FLOPs. Hence 6 FLOPs per
        parameter per token. The token embedding is excluded: it is a lookup, and it is not
        tied to lm_head here (lm_head, a real C x V matmul, is counted). With no biases and no
        norm weights, every remaining parameter is in a matmul, so this term is exact.

        Attention. Per layer and query head, the scores q @ k^T and the weighted sum att @ v
        are each one multiply-add per (query, key) pair per head dimension: 2 * T * Q FLOPs per
        token each, 4 * T * Q forward and twice that backward, 12 * T * Q in all; times H query
        heads (GQA shares keys and values, not the work) and L layers. Causal masking is not
        credited: the formula counts the full T x T score matrix, as the math kernel computes
        it and torch's FLOP counter counts it.
        """
        n_params = sum(p.numel() for p in self.parameters())
        n_params -= self.transformer.wte.weight.numel()
        L, H = self.config.n_layer, self.config.n_head
        Q = self.config.n_embd // self.config.n_head
        return 6 * n_params + 12 * L * H * Q * seq_len


def sample_next_token(
    logits: torch.Tensor,
    generator: torch.Generator | None,
    temperature: float,
    top_k: int | None,
) -> torch.Tensor:
    """One token id per row of logits (B, V): greedy at temperature 0, else sampled; (B, 1)."""
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


# The presets are entries of catalog.py (imported here, not at the top, so that the lines above
# keep the numbers traces cite): a depth, sized by nanochat's rule, or every field.
from ampscope.models.catalog import Presets  # noqa: E402


def _preset(depth: int = 0, **fields: int) -> GPTConfig:
    return config_for_depth(depth) if depth else GPTConfig(**fields)


PRESETS: Presets[GPTConfig] = Presets("nanochat", _preset)


def load(preset: str, *, device: str | torch.device = "cpu",
         target_device: str | None = None) -> LoadedModel:
    """Build the preset with nanochat's init on `device` ("meta" allocates nothing), making the
    device-dependent choices (the bf16 embedding) for `target_device` when given."""
    config = PRESETS[preset]
    with torch.device(device):
        model = GPT(config)
    model.init_weights(target_device)
    return LoadedModel(
        name=preset,
        module=model,
        vocab_size=config.vocab_size,
        max_seq_len=config.sequence_len,
        family="nanochat",
        # nanochat's data loader yields int32 inputs (half the host-to-device traffic of
        # int64); its sampler works in int64.
        train_ids_dtype=torch.int32,
        generate_ids_dtype=torch.int64,
        notes=["lm_head and c_proj are initialised randomly (nanochat zero-initialises them)"],
    )


# For the type checker, and at the end so that the lines above keep the numbers that traces
# cite ("nanochat.py:252"): torch types a ModuleDict's entries, read as attributes, as
# Tensor | Module; `_Transformer` says what `GPT.transformer` holds. `_KV`: one layer's cached
# keys and values, once allocated.
from typing import TYPE_CHECKING, cast  # noqa: E402

if TYPE_CHECKING:
    class _Transformer(nn.ModuleDict):
        wte: nn.Embedding
        h: nn.ModuleList

    _KV = tuple[torch.Tensor, torch.Tensor]
