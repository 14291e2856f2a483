"""Inductor's Triton code generator class, which torchao patches once per process."""

from __future__ import annotations


def triton_overrides() -> type | None:
    """`TritonOverrides`, or None where this build's inductor lacks it (or fails to import).
    Not a feature of `--version -v`: importing inductor takes seconds, and only an fp8 setting
    needs it (to leave torchao's patch of it as it found it)."""
    try:
        from torch._inductor.codegen.triton import TritonOverrides
    # Importing inductor imports triton where it is installed, and a triton built for another
    # torch fails in its own ways (AttributeError, RuntimeError, ...): nothing to save then.
    except Exception:  # noqa: BLE001 - any import failure: no class, so nothing to save
        return None
    return TritonOverrides
