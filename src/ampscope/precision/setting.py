"""Precision settings: parse "cuda:fp32+amp-bf16" into a `Setting`; apply it and undo it exactly.

The grammar is docs/settings.md's, and `GRAMMAR`'s, which the parse errors quote. Applying a
setting (and undoing it exactly) is `precision/apply.py`.

Namesakes, the same concern at another layer: `records/setting.py`."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace

import torch

from ampscope.errors import AmpscopeError
from ampscope.hardware.device_types import DEVICE_TYPES
from ampscope.precision import fp8
from ampscope.records import SettingRecord, dtype_name
from ampscope.runtime.autocast_policy import default_autocast_dtype, registered_ops
from ampscope.runtime.emulation import autocast_region

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
AUTOCAST_DTYPES = ("bf16", "fp16")
DEVICES = tuple(DEVICE_TYPES)  # hardware/device_types.py: one entry a device
GRAMMAR = (
    "[DEVICE:]PARAMS[+amp[-AMP]][+tf32][+fp8[-RECIPE]][+compile] with DEVICE " + "|".join(DEVICE_TYPES)
    + ", PARAMS "
    "fp32|bf16|fp16|fp64|native (native: every parameter as the model made it), AMP bf16|fp16, "
    "RECIPE a torchao float8 recipe; e.g. fp32, bf16, fp32+amp-bf16, native+amp-bf16, "
    "fp32+tf32, cuda:fp32+amp-fp16, fp32+amp-bf16+fp8, fp32+amp-bf16+compile"
)
# The PARAMS part that converts nothing: each parameter keeps the dtype the model gave it.
NATIVE = "native"
_PATTERN = re.compile(
    r"^(?:(?P<device>[a-z]+):)?(?P<params>[a-z0-9]+)(?P<rest>(?:\+[a-z0-9-]+)*)$"
)


@dataclass(frozen=True)
class Setting:
    """One precision setting: parameter dtype × autocast dtype × matmul precision × device."""

    name: str  # canonical spelling, e.g. "fp32+amp-bf16" (device prefix only when not cpu)
    device: str
    param_dtype: torch.dtype | None  # None: native, the model's own dtypes
    autocast_dtype: torch.dtype | None
    matmul_precision: str  # "highest" or "high" (TF32)
    emulated: bool = False  # the device is absent: tensors live on the CPU, autocast is the device's
    fp8: str | None = None  # torchao float8 recipe ("tensorwise", "rowwise", ...); None: no fp8
    compiled: bool = False  # the model runs as torch.compile (Inductor) would run it

    @property
    def run_device(self) -> str:
        """Where the run's tensors really live: the device, or the CPU when emulated."""
        return "cpu" if self.emulated else self.device

    def record(self) -> SettingRecord:
        """The setting as plain data, as a trace keeps it."""
        return SettingRecord(
            name=self.name,
            device=self.device,
            emulated=self.emulated,
            param_dtype=dtype_name(self.param_dtype) if self.param_dtype else None,
            autocast_dtype=dtype_name(self.autocast_dtype) if self.autocast_dtype else None,
            matmul_precision=self.matmul_precision,
            torch=torch.__version__,
            fp8=self.fp8,
        )

    def to_dict(self) -> dict:
        return self.record().to_dict()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast region a workload wraps its forward pass and loss in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        if self.emulated:
            return autocast_region(self.autocast_dtype)
        return torch.autocast(self.device, dtype=self.autocast_dtype)


def parse_setting(text: str) -> Setting:
    """Parse a setting string; raise AmpscopeError showing the grammar when it is malformed."""
    spec = text.strip().lower()
    match = _PATTERN.match(spec)
    if not match:
        raise AmpscopeError(f"malformed setting {text!r}; the grammar is {GRAMMAR}")
    device = match["device"] or "cpu"
    if device not in DEVICES:
        raise AmpscopeError(_unknown_device(device, text))
    params = match["params"]
    if params not in DTYPES and params != NATIVE:
        raise AmpscopeError(
            f"unknown parameter dtype {params!r} in setting {text!r}; the grammar is {GRAMMAR}"
        )
    autocast_dtype = None
    matmul_precision = "highest"
    fp8_recipe = None
    compiled = False
    parts = [p for p in match["rest"].split("+") if p]
    if len(parts) != len(set(parts)):
        raise AmpscopeError(f"repeated part in setting {text!r}; the grammar is {GRAMMAR}")
    for part in parts:
        if part == "tf32":
            matmul_precision = "high"
        elif part == "compile":
            compiled = True
        elif part.startswith("amp") and autocast_dtype is not None:
            raise AmpscopeError(f"repeated part {part!r} in setting {text!r}; the grammar is {GRAMMAR}")
        elif part.startswith("amp-") and part[4:] in AUTOCAST_DTYPES:
            autocast_dtype = DTYPES[part[4:]]
        elif part == "amp":
            autocast_dtype = default_autocast_dtype(device)
        elif part == "fp8" or part.startswith("fp8-"):
            if fp8_recipe is not None:
                raise AmpscopeError(f"repeated part {part!r} in setting {text!r}; the grammar is {GRAMMAR}")
            fp8_recipe = _fp8_recipe(part, text)
        else:
            raise AmpscopeError(f"unknown part {part!r} in setting {text!r}; the grammar is {GRAMMAR}")
    canonical = params
    if autocast_dtype is not None:
        canonical += "+amp-" + ("bf16" if autocast_dtype == torch.bfloat16 else "fp16")
    if matmul_precision == "high":
        canonical += "+tf32"
    if fp8_recipe is not None:
        canonical += "+fp8-" + fp8.spelled(fp8_recipe)
    if compiled:
        canonical += "+compile"
    if device != "cpu":
        canonical = f"{device}:{canonical}"
    return Setting(canonical, device, DTYPES.get(params), autocast_dtype, matmul_precision,
                   fp8=fp8_recipe, compiled=compiled)


def _fp8_recipe(part: str, text: str) -> str:
    """The torchao recipe a `fp8[-RECIPE]` part names ("fp8" alone: torchao's default config)."""
    if part == "fp8":
        return fp8.default_recipe()
    known = {fp8.spelled(r): r for r in fp8.recipes()}
    recipe = known.get(part[4:])
    if recipe is None:
        raise AmpscopeError(f"unknown fp8 recipe {part[4:]!r} in setting {text!r}; torchao offers "
                            f"{', '.join(known)}")
    return recipe


def on_device(text: str, device: str) -> str:
    """`text` with `device` as its DEVICE: prefix (`--device cuda` on the command line)."""
    prefix, colon, rest = text.strip().partition(":")
    if not colon:
        return f"{device}:{text.strip()}"
    if prefix.lower() != device:
        raise AmpscopeError(f"setting {text!r} names device {prefix!r} but --device is {device!r}")
    return text


def _unknown_device(device: str, text: str) -> str:
    try:
        torch.device(device)
    except RuntimeError:
        return f"unknown device {device!r} in setting {text!r}; the grammar is {GRAMMAR}"
    return (
        f"device {device!r} in setting {text!r} is not one ampscope can run or emulate; "
        f"choose {', '.join(DEVICES)}"
    )


def device_available(device: str) -> bool:
    if device == "cpu":
        return True
    backend = getattr(torch, device, None)  # torch.cuda, torch.mps, torch.xpu
    try:
        return bool(backend is not None and backend.is_available())
    except (AttributeError, RuntimeError):
        return False


def resolve_device(setting: Setting) -> Setting:
    """The setting as this machine will run it: for real where the device exists, else emulated
    on the CPU with the device's autocast policy read from this PyTorch build."""
    if device_available(setting.device):
        return setting
    if not registered_ops(setting.device):
        raise AmpscopeError(
            f"this machine has no {setting.device} device and this PyTorch build "
            f"({torch.__version__}) has no {setting.device} autocast policy to emulate it with; "
            f"use one of {', '.join(DEVICES)}"
        )
    return replace(setting, emulated=True)


