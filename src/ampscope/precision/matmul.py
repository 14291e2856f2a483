"""Float32 matmul precision, through PyTorch's per-backend API, saved and restored exactly.

PyTorch has two APIs for TF32: the legacy `torch.set_float32_matmul_precision("high")` and the
per-backend `torch.backends.<backend>.<op>.fp32_precision = "tf32"`. Setting the legacy one
writes the per-backend matmul values, and once a user has used the new one, reading the legacy
one raises ("mix of the legacy and new APIs"). So a run reads and writes the per-backend values
only, and puts every one of them back as it found it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampscope.records import OpCall

# Parents before children: a child's "none" defers to its parent.
_PATHS = ("", "cuda.matmul", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn", "cudnn",
          "cudnn.conv", "cudnn.rnn")
# The backends whose matmuls a setting's "+tf32" part switches.
_MATMULS = ("cuda.matmul", "mkldnn.matmul")


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
            return legacy_name(backend.fp32_precision)
    return "highest"


# The ops whose float32 arithmetic a precision setting governs, by the kind of setting: the
# GEMM family (cuBLAS, oneDNN), convolutions (cuDNN, oneDNN) and RNN kernels.
_MATMUL_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addbmm"})
_CONV_OPS = frozenset({"aten.convolution", "aten.convolution_backward"})
# The backend each kind of op runs on, by device: whose `fp32_precision` it follows.
_BACKENDS = {"cuda": {"matmul": "cuda.matmul", "conv": "cudnn.conv", "rnn": "cudnn.rnn"},
             "cpu": {"matmul": "mkldnn.matmul", "conv": "mkldnn.conv", "rnn": "mkldnn.rnn"}}
_LEGACY_NAMES = {"highest": "ieee", "high": "tf32", "medium": "bf16"}


def precision_kind(op: str) -> str | None:
    """"matmul", "conv" or "rnn" for an op (named as records name it, "aten.mm.default") whose
    float32 arithmetic follows a precision setting; None for every other op."""
    packet = op.rsplit(".", 1)[0]
    if packet in _MATMUL_OPS:
        return "matmul"
    if packet in _CONV_OPS:
        return "conv"
    if packet.startswith("aten.") and "rnn" in packet:
        return "rnn"
    return None


def fp32_precision(kind: str, device: str) -> str:
    """The float32 precision ("ieee", "tf32", "bf16") in force now for ops of `kind` on
    `device`: its backend's `fp32_precision`, a "none" deferring to the parents."""
    chain = _chains.get((kind, device))
    if chain is None:
        chain = _chains[(kind, device)] = _chain(_BACKENDS.get(device, {}).get(kind, ""))
    for backend in chain:  # read each time: a script may set it at any point
        value = backend.fp32_precision
        if value != "none":
            return value
    if not chain:  # a build without the per-backend API: the legacy settings
        if kind == "conv" and device == "cuda":
            return "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"
        return _LEGACY_NAMES.get(torch.get_float32_matmul_precision(), "ieee")
    return "ieee"


# (kind, device) -> the backend settings objects its precision is read from, own first.
_chains: dict[tuple[str, str], list] = {}


def _chain(path: str) -> list:
    """The settings objects of `path` and of its parents up to the root, those this build has
    (the objects live as long as torch: found once, read on every op)."""
    parts = path.split(".") if path else []
    chain = []
    while True:
        backend = _backend(".".join(parts))
        if backend is not None:
            chain.append(backend)
        if not parts:
            return chain
        parts.pop()


def legacy_name(precision: str) -> str:
    """A per-backend value as `torch.set_float32_matmul_precision` names it ("tf32" -> "high")."""
    return {value: name for name, value in _LEGACY_NAMES.items()}.get(precision, "highest")


def ran_with(ops: Sequence[OpCall], fallback: str) -> str:
    """The float32 matmul precision, as the legacy API names it, that a run's float32 matmuls
    ran with (recorded per op: a script may change it as it runs): the one under which most
    of their FLOPs ran. `fallback` (the precision as the run left it) where none ran."""
    flops: dict[str, int] = {}
    for op in ops:
        if op.fp32_precision is not None and precision_kind(op.op) == "matmul":
            flops[op.fp32_precision] = flops.get(op.fp32_precision, 0) + op.flops + 1
    return legacy_name(max(flops, key=flops.__getitem__)) if flops else fallback
