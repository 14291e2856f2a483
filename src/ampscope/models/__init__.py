"""Models ampscope can build from a spec string; see `registry` for the spec grammar.

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
