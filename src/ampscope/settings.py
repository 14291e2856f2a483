"""Precision settings: parse "cuda:fp32+amp-bf16" into a `Setting`; apply it and undo it exactly.

Grammar (see docs/settings.md)::

    [DEVICE:]PARAMS[+amp-AMP][+tf32]
    DEVICE  cpu | cuda | mps           (default cpu)
    PARAMS  fp32 | bf16 | fp16 | fp64   parameter dtype
    AMP     bf16 | fp16                 torch.autocast dtype
    tf32    torch.set_float32_matmul_precision("high")

Applying a setting never loses the user's state: `ModelState` and `GlobalState` snapshot
everything a run can change and put it back in a `finally`, also when the run raised.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ampscope.errors import AmpscopeError
from ampscope.records import dtype_name

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
AUTOCAST_DTYPES = ("bf16", "fp16")
DEVICES = ("cpu", "cuda", "mps")
GRAMMAR = (
    "[DEVICE:]PARAMS[+amp-AMP][+tf32] with DEVICE cpu|cuda|mps, PARAMS fp32|bf16|fp16|fp64, "
    "AMP bf16|fp16; e.g. fp32, bf16, fp32+amp-bf16, fp32+tf32, cpu:fp32+amp-fp16"
)
_PATTERN = re.compile(
    r"^(?:(?P<device>[a-z]+):)?(?P<params>[a-z0-9]+)(?P<rest>(?:\+[a-z0-9-]+)*)$"
)


@dataclass(frozen=True)
class Setting:
    """One precision setting: parameter dtype × autocast dtype × matmul precision × device."""

    name: str  # canonical spelling, e.g. "fp32+amp-bf16" (device prefix only when not cpu)
    device: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    matmul_precision: str  # "highest" or "high" (TF32)
    emulated: bool = False

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "device": self.device,
            "emulated": self.emulated,
            "param_dtype": dtype_name(self.param_dtype),
            "autocast_dtype": dtype_name(self.autocast_dtype) if self.autocast_dtype else None,
            "matmul_precision": self.matmul_precision,
        }

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast region a workload wraps its forward pass and loss in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.autocast_dtype)


def parse_setting(text: str) -> Setting:
    """Parse a setting string; raise AmpscopeError showing the grammar when it is malformed."""
    spec = text.strip().lower()
    match = _PATTERN.match(spec)
    if not match:
        raise AmpscopeError(f"malformed setting {text!r}; the grammar is {GRAMMAR}")
    device = match["device"] or "cpu"
    if device not in DEVICES:
        raise AmpscopeError(f"unknown device {device!r} in setting {text!r}; the grammar is {GRAMMAR}")
    params = match["params"]
    if params not in DTYPES:
        raise AmpscopeError(
            f"unknown parameter dtype {params!r} in setting {text!r}; the grammar is {GRAMMAR}"
        )
    autocast_dtype = None
    matmul_precision = "highest"
    parts = [p for p in match["rest"].split("+") if p]
    if len(parts) != len(set(parts)):
        raise AmpscopeError(f"repeated part in setting {text!r}; the grammar is {GRAMMAR}")
    for part in parts:
        if part == "tf32":
            matmul_precision = "high"
        elif part.startswith("amp-") and part[4:] in AUTOCAST_DTYPES and autocast_dtype is None:
            autocast_dtype = DTYPES[part[4:]]
        else:
            raise AmpscopeError(f"unknown part {part!r} in setting {text!r}; the grammar is {GRAMMAR}")
    canonical = params
    if autocast_dtype is not None:
        canonical += "+amp-" + ("bf16" if autocast_dtype == torch.bfloat16 else "fp16")
    if matmul_precision == "high":
        canonical += "+tf32"
    if device != "cpu":
        canonical = f"{device}:{canonical}"
    return Setting(canonical, device, DTYPES[params], autocast_dtype, matmul_precision)


def check_available(setting: Setting) -> None:
    """Refuse, in one line, a setting this machine cannot run for real."""
    available = {
        "cpu": True,
        "cuda": torch.cuda.is_available(),
        "mps": hasattr(torch.backends, "mps") and torch.backends.mps.is_available(),
    }
    if not available[setting.device]:
        raise AmpscopeError(
            f"setting {setting.name!r} needs a {setting.device} device and this machine has none; "
            "use a cpu setting (emulating other devices is not supported yet)"
        )


# --- global state -------------------------------------------------------------------------

def _autocast_devices() -> tuple[str, ...]:
    """Device types whose autocast state this build can read (cpu and cuda always; mps, xpu
    where supported)."""
    devices = []
    for device in ("cpu", "cuda", "mps", "xpu"):
        try:
            torch.is_autocast_enabled(device)
            torch.get_autocast_dtype(device)
        except (RuntimeError, ValueError):
            continue
        devices.append(device)
    return tuple(devices)


AUTOCAST_DEVICES = _autocast_devices()


@dataclass
class GlobalState:
    """Everything global a run may change: autocast, matmul precision, default dtype, RNG,
    grad mode."""

    autocast: dict[str, tuple[bool, torch.dtype]]
    matmul_precision: str
    default_dtype: torch.dtype
    grad_enabled: bool
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None

    @classmethod
    def save(cls) -> GlobalState:
        # Saved whenever CUDA exists, not only once initialised: a cuda run seeds and draws
        # from it.
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return cls(
            autocast={
                d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                for d in AUTOCAST_DEVICES
            },
            matmul_precision=torch.get_float32_matmul_precision(),
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
            cpu_rng=torch.get_rng_state(),
            cuda_rng=cuda_rng,
        )

    def restore(self) -> None:
        for device, (enabled, dtype) in self.autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


# --- model state --------------------------------------------------------------------------


@dataclass
class ModelState:
    """The model's tensors and flags as the user had them.

    Parameters and buffers are restored by putting the user's own tensor objects back into
    `.data` and the module's buffer slots, so values, dtypes and devices come back bit for bit
    whatever the run did to the copies it worked on.
    """

    params: list[tuple[nn.Parameter, torch.Tensor, bool, torch.Tensor | None]]
    buffers: list[tuple[nn.Module, str, torch.Tensor]]
    training: list[tuple[nn.Module, bool]]

    @classmethod
    def save(cls, model: nn.Module) -> ModelState:
        params = [
            (p, p.data, p.requires_grad, p.grad)
            for p in model.parameters(recurse=True)  # tied parameters appear once
        ]
        buffers = [
            (m, name, b)
            for m in model.modules()
            for name, b in m._buffers.items()
            if b is not None
        ]
        training = [(m, m.training) for m in model.modules()]
        return cls(params, buffers, training)

    def restore(self) -> None:
        for p, data, requires_grad, grad in self.params:
            p.data = data
            p.requires_grad_(requires_grad)
            p.grad = grad
        for module, name, tensor in self.buffers:
            module._buffers[name] = tensor
        for module, training in self.training:
            module.training = training


def _main_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype holding most parameter elements: what the model is "in"."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def _working_copies(model: nn.Module, setting: Setting) -> None:
    """Give the run its own copies of every parameter and buffer, converted as the setting asks.

    Conversion follows `model.to(dtype)` (parameters and floating buffers) and happens only when
    the model is not already in the setting's dtype, so a model's own choices (nanochat's bf16
    rotary buffers) survive an `fp32` setting as they do in the user's training script. Copies
    are made in every case so that an optimizer step or an in-place buffer update in the run
    cannot reach the user's tensors.
    """
    convert = _main_dtype(model) not in (None, setting.param_dtype)
    device = torch.device(setting.device)

    def copy(t: torch.Tensor) -> torch.Tensor:
        dtype = setting.param_dtype if convert and t.is_floating_point() else t.dtype
        return t.detach().to(device=device, dtype=dtype, copy=True)

    for p in model.parameters():
        p.data = copy(p.data)
        p.grad = None
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = copy(b)


@contextlib.contextmanager
def applied(setting: Setting, model: nn.Module | None = None) -> Iterator[None]:
    """Run the body under `setting`; afterwards the model and torch's global state are exactly
    as they were, also when the body raised. Autocast itself is entered by the workload
    (around forward and loss, as training scripts do), not here."""
    global_state = GlobalState.save()
    model_state = ModelState.save(model) if model is not None else None
    try:
        if model is not None:
            _working_copies(model, setting)
        torch.set_float32_matmul_precision(setting.matmul_precision)
        yield
    finally:
        if model_state is not None:
            model_state.restore()
        global_state.restore()
