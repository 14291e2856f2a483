"""fp8 training with torchao: its recipes, and its conversion of a model applied and undone.

torchao (the optional extra `ampscope[fp8]`) swaps `nn.Linear` layers for `Float8Linear`, whose
matmuls cast their inputs and weights to float8_e4m3fn and the output gradients to float8_e5m2,
each with a scale computed from the tensor's amax (dynamic scaling). ampscope names its recipes
as torchao does (`Float8LinearRecipeName`) and converts with torchao's own
`convert_to_float8_training`; on a device without fp8 matmuls (the CPU, an emulated device) the
config's `emulate=True` runs them in higher precision on the same fp8 values.

Namesakes, the same concern at another layer: `analysis/fp8.py`, `records/fp8.py`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from ampscope.errors import AmpscopeError
from ampscope.quiet import loggers_quiet
from ampscope.records.fp8 import DIM_MULTIPLE
from ampscope.torchcompat.inductor import triton_overrides
from ampscope.torchcompat.ops import PYTREE_LOGGER

INSTALL = "pip install 'ampscope[fp8]' (torchao==0.18.0, installed with --no-deps)"


def _quiet_import(name: str) -> ModuleType:
    """Import a torchao module without its import-time log lines (the CPU build cannot load its
    CUDA kernels and says so on every import; torch warns about one of its enums): they would
    reach the user's terminal as noise."""
    import importlib

    with loggers_quiet("torchao", PYTREE_LOGGER):
        return importlib.import_module(name)


# torchao is built against one torch release at a time: the pinned 0.18.0 imports on torch 2.10
# and newer (on 2.9 it asks torch for names 2.10 added). Measured: docs/compatibility.md.
TORCHAO_OLDEST_TORCH = "2.10"


def float8() -> ModuleType:
    """`torchao.float8`, or one line saying how to install it, or why the installed torchao
    cannot run on this torch."""
    import importlib.util

    try:
        return _quiet_import("torchao.float8")
    except ImportError as e:
        if importlib.util.find_spec("torchao") is None:
            raise AmpscopeError(f"fp8 settings need torchao: {INSTALL}") from e
        raise AmpscopeError(
            f"fp8 settings need torchao, which is installed but does not import on torch "
            f"{torch.__version__} ({type(e).__name__}: {e}); torchao 0.18.0 needs torch "
            f"{TORCHAO_OLDEST_TORCH} or newer") from e


def available() -> bool:
    try:
        float8()
    except AmpscopeError:
        return False
    return True


def recipes() -> tuple[str, ...]:
    """The recipe names torchao offers ("tensorwise", "rowwise", ...), read from torchao."""
    return tuple(r.value for r in float8().Float8LinearRecipeName)


def default_recipe() -> str:
    """The recipe `Float8LinearConfig()` (torchao's defaults) amounts to."""
    f8 = float8()
    default = f8.Float8LinearConfig()
    for name in recipes():
        if f8.Float8LinearConfig.from_recipe_name(name) == default:
            return name
    return recipes()[0]


def spelled(recipe: str) -> str:
    """A recipe name as a setting part spells it: "rowwise_with_gw_hp" → "rowwise-with-gw-hp"."""
    return recipe.replace("_", "-")


def config(recipe: str, *, emulate: bool):
    """torchao's config for `recipe`, emulated or not."""
    cfg = float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, emulate=emulate)


def passes_filter(module: nn.Module, fqn: str = "") -> bool:
    """The module filter ampscope gives torchao: every `nn.Linear` whose weight's dims are both
    multiples of 16, which real fp8 matmuls require (torchao's own default, no filter, converts
    every Linear and fails on such a layer on a GPU)."""
    if not isinstance(module, nn.Linear):
        return False
    out_features, in_features = module.weight.shape
    return out_features % DIM_MULTIPLE == 0 and in_features % DIM_MULTIPLE == 0


def check_device(device: str, *, emulated: bool) -> None:
    """Refuse a real device without fp8 matmuls: an A100 (compute capability 8.0) has none."""
    if emulated or device == "cpu":
        return
    if device != "cuda":
        raise AmpscopeError(f"fp8 training (torchao) runs on cuda, not {device}; emulate it on "
                            "the CPU with a cpu: or cuda: setting on a machine without a GPU")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise AmpscopeError(
            f"this GPU ({torch.cuda.get_device_name()}, compute capability {major}.{minor}) has "
            "no fp8 matmuls (they need 8.9: Ada, Hopper or newer); drop the +fp8 part")


def check_cpu_autocast(name: str, recipe: str, *, cpu_autocast: bool) -> None:
    """Refuse a recipe that cannot run under CPU autocast. A recipe that keeps the weight
    gradient's matmul in high precision (`rowwise_with_gw_hp`) multiplies the saved input by
    the gradient there; `Float8Linear` casts its input to the autocast dtype only under CUDA's
    autocast (`torch.is_autocast_enabled()`), so under the CPU's that matmul gets a float32
    input and a bfloat16 gradient and fails, as it would in any CPU run."""
    if not cpu_autocast:
        return
    disabled = float8().ScalingType.DISABLED
    if config(recipe, emulate=True).cast_config_input_for_grad_weight.scaling_type is disabled:
        gpu = f"cuda:{name}"
        no_amp = name.split("+amp")[0] + "+fp8-" + spelled(recipe)
        raise AmpscopeError(
            f"fp8 recipe {spelled(recipe)} fails under CPU autocast (torchao casts inputs only "
            f"under CUDA's); use {gpu} (emulated) or {no_amp}")


def _inductor_patch_state() -> tuple | None:
    """What `convert_to_float8_training` patches once per process: inductor's Triton min/max
    codegen (a workaround of torchao's for GPU kernels). Saved so that a run leaves torch as
    the user had it."""
    TritonOverrides = triton_overrides()
    if TritonOverrides is None:
        return None
    try:
        patch = _quiet_import("torchao.float8._inductor_patch")
    except Exception:  # noqa: BLE001 - torchao's internals moved or fail to import on this torch: nothing of ours to restore
        return None
    return TritonOverrides, TritonOverrides.__dict__.get("minimum"), \
        TritonOverrides.__dict__.get("maximum"), patch, patch._PATCHED  # noqa: SLF001 - torchao's flag


def _restore_inductor_patch(state: tuple | None) -> None:
    if state is None:
        return
    overrides, minimum, maximum, patch, patched = state
    for name, value in (("minimum", minimum), ("maximum", maximum)):
        if value is not None:
            setattr(overrides, name, value)
    patch._PATCHED = patched  # noqa: SLF001 - torchao's own flag, put back as it was


@contextlib.contextmanager
def converted(model: nn.Module, recipe: str, *, emulate: bool) -> Iterator[list[str]]:
    """Convert `model`'s Linear layers with torchao for the body; yield the converted modules'
    names. The modules themselves are put back by the caller's `ModelState` (which saves every
    module slot); torchao's process-wide codegen patch is undone here."""
    f8 = float8()
    if isinstance(model, nn.Linear):  # torchao would return a new module, not convert this one
        raise AmpscopeError("a bare nn.Linear cannot be converted to fp8 in place; wrap it in a "
                            "module (nn.Sequential(linear))")
    names = [n for n, m in model.named_modules() if passes_filter(m, n)]
    if not names:
        raise AmpscopeError("no nn.Linear layer of this model has dims that are multiples of 16: "
                            "nothing would run in fp8; drop the +fp8 part")
    patch_state = _inductor_patch_state()
    try:
        f8.convert_to_float8_training(model, module_filter_fn=passes_filter,
                                      config=config(recipe, emulate=emulate))
        yield names
    finally:
        _restore_inductor_patch(patch_state)
