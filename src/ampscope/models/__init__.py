"""Models ampscope can build from a spec string; see `registry` for the spec grammar.

- `registry.py`: the spec grammar (`gpt2`, `llama-3.2-1b`, `hf:./ckpt`, `pkg.mod:factory`) and
  the memory guard;
- `base.py`: `LoadedModel`, what a workload needs to drive a model;
- `loading.py`: `load`, a spec, a bare module or a LoadedModel as the LoadedModel a run needs;
- `catalog.py`: every named model, one entry each: what `ampscope models` lists, what builds it
  and its preset, as data (read without importing torch);
- `gpt2.py`, `nanochat.py`: the built-in reference GPTs, one readable file each;
- `hf.py`: Hugging Face causal LMs (the zoo from configs, local checkpoints), with
  `weight_files.py` (a local folder's shards and torch checkpoints, read safely);
- `smollm2.py`: SmolLM2-135M with its real weights.

The names below are imported on first use: `catalog` (what `ampscope models` lists) is read
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["LoadedModel", "ModelInfo", "list_models", "resolve"]
_EXPORTS = {"LoadedModel": "ampscope.models.base", "ModelInfo": "ampscope.models.catalog",
            "list_models": "ampscope.models.registry", "resolve": "ampscope.models.registry"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ampscope.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


if TYPE_CHECKING:
    from ampscope.models.base import LoadedModel
    from ampscope.models.catalog import ModelInfo
    from ampscope.models.registry import list_models, resolve
