"""Where in user code a torch call came from ("model.py:61").

A call seen by the function mode is attributed to the innermost stack frame that is neither
PyTorch's nor ampscope's own machinery. ampscope's reference models are user code in this
sense: their `.float()` is exactly what a finding must point at.
"""

from __future__ import annotations

import os
import sys
from types import CodeType

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AMPSCOPE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
_MODELS_DIR = os.path.join(_AMPSCOPE_DIR, "models") + os.sep
_CONTEXTLIB = os.path.dirname(os.__file__) + os.sep + "contextlib.py"

_internal_cache: dict[CodeType, bool] = {}


def _is_internal(code: CodeType) -> bool:
    cached = _internal_cache.get(code)
    if cached is None:
        path = code.co_filename
        cached = (
            path.startswith(_TORCH_DIR)
            or (path.startswith(_AMPSCOPE_DIR) and not path.startswith(_MODELS_DIR))
            or path == _CONTEXTLIB
        )
        _internal_cache[code] = cached
    return cached


def user_source(skip: int = 2) -> str | None:
    """`file.py:line` of the innermost frame in user code, or None if there is none."""
    frame = sys._getframe(skip)
    while frame is not None:
        if not _is_internal(frame.f_code):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None
