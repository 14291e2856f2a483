"""Applying a setting and undoing it exactly.

Applying a setting never loses the user's state: `ModelState` and `GlobalState` snapshot
everything a run can change and put it back in a `finally`, also when the run raised. The run
itself works on its own copies of every parameter and buffer, converted as the setting asks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ampscope.hardware.device_types import DEVICE_TYPES
from ampscope.precision import fp8, matmul
from ampscope.precision.setting import Setting
from ampscope.runtime.compiled import compiled_forward
from ampscope.runtime.emulation import Emulation
from ampscope.runtime.predict import fake_like, fake_parameter
from ampscope.torchcompat import modules as module_state

if TYPE_CHECKING:
    from ampscope.runtime.attention_choice import CudaTarget
    from ampscope.torchcompat.fake import FakeTensor

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)


def _autocast_devices() -> tuple[str, ...]:
    """Device types whose autocast state this build can read (cpu and cuda always; mps, xpu
    where supported)."""
    devices = []
    for device in DEVICE_TYPES:
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
    fp32_precision: dict[str, str]  # per backend (precision/matmul.py)
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
            fp32_precision=matmul.snapshot(),
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
            cpu_rng=torch.get_rng_state(),
            cuda_rng=cuda_rng,
        )

    def restore(self) -> None:
        for device, (enabled, dtype) in self.autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        matmul.restore(self.fp32_precision)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


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
    # Which submodule each module holds: an fp8 setting swaps Linear layers for torchao's.
    children: list[tuple[nn.Module, str, nn.Module | None]]

    @classmethod
    def save(cls, model: nn.Module) -> ModelState:
        modules = list(model.modules())  # one walk of a model of thousands of modules
        slots = [
            (m, name, p)
            for m in modules
            for name, p in module_state.parameters(m).items()
            if p is not None
        ]
        unique: dict[int, nn.Parameter] = {}  # as model.parameters() lists them: tied
        for _, _, p in slots:                    # parameters once, where first held
            unique.setdefault(id(p), p)
        params = [(p, p.data, p.requires_grad, p.grad) for p in unique.values()]
        buffers = [
            (m, name, b)
            for m in modules
            for name, b in module_state.buffers(m).items()
            if b is not None
        ]
        training = [(m, m.training) for m in modules]
        children = [(m, name, c) for m in modules for name, c in module_state.children(m).items()]
        return cls(params, slots, buffers, training, children)

    def restore(self) -> None:
        for module, name, child in self.children:
            module_state.children(module)[name] = child
        for p, data, requires_grad, grad in self.params:
            p.data = data
            p.requires_grad_(requires_grad)
            p.grad = grad
        for module, name, param in self.slots:
            module_state.parameters(module)[name] = param
        for module, name, tensor in self.buffers:
            module_state.buffers(module)[name] = tensor
        for module, training in self.training:
            module.training = training


def main_dtype(model: nn.Module, params: Iterable[nn.Parameter] | None = None
               ) -> torch.dtype | None:
    """The dtype holding most parameter elements: what the model is "in". `params`: the
    model's parameters, when the caller has them."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters() if params is None else params:
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def _working_copies(model: nn.Module, setting: Setting, state: ModelState, fake=None) -> None:
    """Give the run its own copies of every parameter and buffer, converted as the setting asks.

    Conversion follows `model.to(dtype)` (parameters and floating buffers) and happens only when
    the model is not already in the setting's dtype, so a model's own choices (nanochat's bf16
    rotary buffers) survive an `fp32` setting as they do in the user's training script. Copies
    are made in every case so that an optimizer step or an in-place buffer update in the run
    cannot reach the user's tensors. With `fake` (a FakeTensorMode: predict mode) the copies
    are fake tensors, which hold no memory. `state`: the model's, as `applied` saved it (its
    parameters and where each module holds them and its buffers: no second walk of a model of
    thousands of modules).
    """
    params = [p for p, *_ in state.params]
    # The dtype that floating-point copies are converted to; None: no conversion.
    convert = setting.param_dtype if setting.param_dtype is not None and \
        main_dtype(model, params) not in (None, setting.param_dtype) else None
    device = torch.device(setting.run_device)

    def copy(t: torch.Tensor) -> torch.Tensor:
        dtype = convert if convert is not None and t.is_floating_point() else t.dtype
        if fake is not None:
            return fake_like(t, fake, dtype=dtype, device=device)
        return t.detach().to(device=device, dtype=dtype, copy=True)

    if fake is None:
        for p in params:
            p.data = copy(p.data)
            p.grad = None
    else:
        # A fake tensor cannot become a real Parameter's .data: the run gets fake Parameter
        # objects instead, one per tensor so that tied weights stay tied.
        replacements: dict[int, nn.Parameter] = {}
        for m, name, p in state.slots:
            if id(p) not in replacements:
                # (With a mode, copy makes fake tensors.)
                replacements[id(p)] = fake_parameter(cast("FakeTensor", copy(p)), p.requires_grad)
            module_state.parameters(m)[name] = replacements[id(p)]
    for m, name, b in state.buffers:
        module_state.buffers(m)[name] = copy(b)


def _convert_to_fp8(stack: contextlib.ExitStack, model: nn.Module, setting: Setting) -> None:
    """torchao's fp8 training conversion of the run's model: emulated (fp8 values, matmuls in
    higher precision) on the CPU and on an emulated device, real on a GPU that has fp8 matmuls."""
    recipe = setting.fp8
    assert recipe is not None  # (called for an fp8 setting only)
    emulate = setting.run_device == "cpu"
    fp8.check_device(setting.device, emulated=setting.emulated)
    fp8.check_cpu_autocast(setting.name, recipe,
                           cpu_autocast=setting.device == "cpu" and setting.autocast_dtype is not None)
    names = stack.enter_context(fp8.converted(model, recipe, emulate=emulate))
    log.info("Converted %d Linear layers to torchao Float8Linear (recipe %s%s)", len(names),
             recipe, ", emulated" if emulate else "")


@contextlib.contextmanager
def applied(setting: Setting, model: nn.Module | None = None, *, fake=None,
            gpu: CudaTarget | None = None) -> Iterator[Emulation | None]:
    """Run the body under `setting`; afterwards the model and torch's global state are exactly
    as they were, also when the body raised. Autocast itself is entered by the workload
    (around forward and loss, as training scripts do), not here; an emulated setting puts the
    target device's autocast policy and kernels in place for the body and yields the
    `Emulation` (`gpu`: the GPU whose kernel choices it makes, runs/environment.py), else None
    is yielded."""
    global_state = GlobalState.save()
    model_state = ModelState.save(model) if model is not None else None
    try:
        with contextlib.ExitStack() as stack:
            # The run sets the modes it needs: the caller's no_grad, inference_mode or autocast
            # (ampscope.trace called inside them) must not reach the workload, which enters its
            # own autocast. They come back with the rest of the global state.
            stack.enter_context(torch.inference_mode(False))
            torch.set_grad_enabled(True)
            for device in AUTOCAST_DEVICES:
                torch.set_autocast_enabled(device, False)
            emulation = None
            autocast = setting.autocast_dtype
            log.info("Running under %s: parameters in %s, autocast %s, float32 matmul precision "
                     "%r%s", setting.name,
                     str(setting.param_dtype).removeprefix("torch.") if setting.param_dtype
                     else "the model's own dtypes",
                     str(autocast).removeprefix("torch.") if autocast else "off",
                     setting.matmul_precision,
                     f"; {setting.device} emulated on the CPU" if setting.emulated else "")
            if model is not None:
                assert model_state is not None  # (saved above, as there is a model)
                # Before the emulation's modes: a copy is no norm and no autocast region, and
                # each mode would see every copy made (1,446 for a 70B model's parameters).
                _working_copies(model, setting, model_state, fake)
            if setting.emulated:
                emulation = stack.enter_context(
                    Emulation(setting.device, setting.autocast_dtype, gpu))
            if model is not None and setting.fp8 is not None:
                _convert_to_fp8(stack, model, setting)
            if model is not None and setting.compiled:
                stack.enter_context(compiled_forward(model))
            matmul.set_matmul_precision(setting.matmul_precision)
            yield emulation
    finally:
        if model_state is not None:
            model_state.restore()
        global_state.restore()
