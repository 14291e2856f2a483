"""Float32 matmul precision, through PyTorch's per-backend API, saved and restored exactly.

PyTorch has two APIs for TF32: the legacy `torch.set_float32_matmul_precision("high")` and the
per-backend `torch.backends.<backend>.<op>.fp32_precision = "tf32"`. Setting the legacy one
writes the per-backend matmul values, and once a user has used the new one, reading the legacy
one raises ("mix of the legacy and new APIs"). So a run reads and writes the per-backend values
only, and puts every one of them back as it found it.
"""

from __future__ import annotations

import torch

# Parents before children: a child's "none" defers to its parent.
_PATHS = ("", "cuda.matmul", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn", "cudnn",
          "cudnn.conv", "cudnn.rnn")
# The backends whose matmuls a setting's "+tf32" part switches.
_MATMULS = ("cuda.matmul", "mkldnn.matmul")
_LEGACY = {"ieee": "highest", "tf32": "high"}


def _backend(path: str):
    obj: object = torch.backends  # then a backend module, or its op's settings object
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if hasattr(obj, "fp32_precision") else None


def snapshot() -> dict[str, str]:
    """Every per-backend fp32_precision this build has, by path."""
    values = {}
    for path in _PATHS:
        backend = _backend(path)
        if backend is not None:
            values[path] = backend.fp32_precision
    return values


def restore(values: dict[str, str]) -> None:
    for path in _PATHS:  # parents first
        backend = _backend(path)
        if backend is not None and path in values and backend.fp32_precision != values[path]:
            backend.fp32_precision = values[path]


def set_matmul_precision(precision: str) -> None:
    """A setting's matmul precision: "highest" (IEEE float32) or "high" (TF32)."""
    value = "tf32" if precision in ("high", "medium") else "ieee"
    for path in _MATMULS:
        backend = _backend(path)
        if backend is not None:
            backend.fp32_precision = value


def matmul_precision() -> str:
    """The float32 matmul precision in force, as the legacy API names it ("highest", "high"),
    read from the per-backend values (a child's "none" defers to its parent)."""
    for path in ("cuda.matmul", "cuda", ""):
        backend = _backend(path)
        if backend is not None and backend.fp32_precision != "none":
            return _LEGACY.get(backend.fp32_precision, "highest")
    return "highest"
