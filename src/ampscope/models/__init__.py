"""Models ampscope can build from a spec string; see `registry` for the spec grammar."""

from ampscope.models.base import LoadedModel
from ampscope.models.registry import ModelInfo, list_models, resolve

__all__ = ["LoadedModel", "ModelInfo", "list_models", "resolve"]
