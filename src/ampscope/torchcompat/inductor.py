"""Inductor's Triton code generator class, which torchao patches once per process."""

from __future__ import annotations


def triton_overrides() -> type | None:
    """`TritonOverrides`, or None where this build's inductor lacks it (or fails to import)."""
    try:
        from torch._inductor.codegen.triton import TritonOverrides
    except Exception:  # inductor moved or cannot import here: nothing to save
        return None
    return TritonOverrides
