"""Precision settings: parse "cuda:fp32+amp-bf16" into a `Setting`; apply it and undo it exactly.

Grammar (see docs/settings.md)::

    [DEVICE:]PARAMS[+amp[-AMP]][+tf32]
    DEVICE  cpu | cuda | mps | xpu      (default cpu); emulated when this machine has none
    PARAMS  fp32 | bf16 | fp16 | fp64   parameter dtype
    AMP     bf16 | fp16                 torch.autocast dtype ("+amp": the device's default)
    tf32    torch.set_float32_matmul_precision("high")

Applying a setting never loses the user's state: `ModelState` and `GlobalState` snapshot
everything a run can change and put it back in a `finally`, also when the run raised.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ampscope.errors import AmpscopeError
from ampscope.records import dtype_name

if TYPE_CHECKING:
    from ampscope.capture.emulation import Emulation

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
AUTOCAST_DTYPES = ("bf16", "fp16")
DEVICES = ("cpu", "cuda", "mps", "xpu")
GRAMMAR = (
    "[DEVICE:]PARAMS[+amp[-AMP]][+tf32] with DEVICE cpu|cuda|mps|xpu, PARAMS fp32|bf16|fp16|fp64, "
    "AMP bf16|fp16; e.g. fp32, bf16, fp32+amp-bf16, fp32+tf32, cuda:fp32+amp-fp16"
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
    emulated: bool = False  # the device is absent: tensors live on the CPU, autocast is the device's

    @property
    def run_device(self) -> str:
        """Where the run's tensors really live: the device, or the CPU when emulated."""
        return "cpu" if self.emulated else self.device

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
        if self.emulated:
            from ampscope.capture.emulation import autocast_region

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
        elif part.startswith("amp") and autocast_dtype is not None:
            raise AmpscopeError(f"repeated part {part!r} in setting {text!r}; the grammar is {GRAMMAR}")
        elif part.startswith("amp-") and part[4:] in AUTOCAST_DTYPES:
            autocast_dtype = DTYPES[part[4:]]
        elif part == "amp":
            autocast_dtype = default_autocast_dtype(device)
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
    from ampscope.capture.policy import registered_ops

    if not registered_ops(setting.device):
        raise AmpscopeError(
            f"this machine has no {setting.device} device and this PyTorch build "
            f"({torch.__version__}) has no {setting.device} autocast policy to emulate it with; "
            f"use one of {', '.join(DEVICES)}"
        )
    return replace(setting, emulated=True)


def default_autocast_dtype(device: str) -> torch.dtype:
    from ampscope.capture.policy import default_autocast_dtype as read_default

    try:
        return read_default(device)
    except (RuntimeError, ValueError):
        return torch.bfloat16


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
    slots: list[tuple[nn.Module, str, nn.Parameter]]  # which Parameter object each module holds
    buffers: list[tuple[nn.Module, str, torch.Tensor]]
    training: list[tuple[nn.Module, bool]]

    @classmethod
    def save(cls, model: nn.Module) -> ModelState:
        params = [
            (p, p.data, p.requires_grad, p.grad)
            for p in model.parameters(recurse=True)  # tied parameters appear once
        ]
        slots = [
            (m, name, p)
            for m in model.modules()
            for name, p in m._parameters.items()
            if p is not None
        ]
        buffers = [
            (m, name, b)
            for m in model.modules()
            for name, b in m._buffers.items()
            if b is not None
        ]
        training = [(m, m.training) for m in model.modules()]
        return cls(params, slots, buffers, training)

    def restore(self) -> None:
        for p, data, requires_grad, grad in self.params:
            p.data = data
            p.requires_grad_(requires_grad)
            p.grad = grad
        for module, name, param in self.slots:
            module._parameters[name] = param
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


def _working_copies(model: nn.Module, setting: Setting, fake=None) -> None:
    """Give the run its own copies of every parameter and buffer, converted as the setting asks.

    Conversion follows `model.to(dtype)` (parameters and floating buffers) and happens only when
    the model is not already in the setting's dtype, so a model's own choices (nanochat's bf16
    rotary buffers) survive an `fp32` setting as they do in the user's training script. Copies
    are made in every case so that an optimizer step or an in-place buffer update in the run
    cannot reach the user's tensors. With `fake` (a FakeTensorMode: predict mode) the copies
    are fake tensors, which hold no memory.
    """
    convert = _main_dtype(model) not in (None, setting.param_dtype)
    device = torch.device(setting.run_device)

    def copy(t: torch.Tensor) -> torch.Tensor:
        dtype = setting.param_dtype if convert and t.is_floating_point() else t.dtype
        if fake is not None:
            from ampscope.capture.predict import fake_like

            return fake_like(t, fake, dtype=dtype, device=device)
        return t.detach().to(device=device, dtype=dtype, copy=True)

    if fake is None:
        for p in model.parameters():
            p.data = copy(p.data)
            p.grad = None
    else:
        # A fake tensor cannot become a real Parameter's .data: the run gets fake Parameter
        # objects instead, one per tensor so that tied weights stay tied.
        replacements: dict[int, nn.Parameter] = {}
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    if id(p) not in replacements:
                        with fake:
                            replacements[id(p)] = nn.Parameter(copy(p), requires_grad=p.requires_grad)
                    m._parameters[name] = replacements[id(p)]
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = copy(b)


@contextlib.contextmanager
def applied(setting: Setting, model: nn.Module | None = None, *, fake=None) -> Iterator[Emulation | None]:
    """Run the body under `setting`; afterwards the model and torch's global state are exactly
    as they were, also when the body raised. Autocast itself is entered by the workload
    (around forward and loss, as training scripts do), not here; an emulated setting puts the
    target device's autocast policy and kernels in place for the body and yields the
    `Emulation`, else None is yielded."""
    global_state = GlobalState.save()
    model_state = ModelState.save(model) if model is not None else None
    try:
        with contextlib.ExitStack() as stack:
            emulation = None
            if setting.emulated:
                from ampscope.capture.emulation import Emulation

                emulation = stack.enter_context(Emulation(setting.device, setting.autocast_dtype))
            if model is not None:
                _working_copies(model, setting, fake)
            torch.set_float32_matmul_precision(setting.matmul_precision)
            yield emulation
    finally:
        if model_state is not None:
            model_state.restore()
        global_state.restore()
