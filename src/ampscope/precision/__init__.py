"""Precision settings: what a setting is, and applying it to a model and torch's global state.

- `setting.py`: the setting grammar (`cuda:fp32+amp-bf16`) and `Setting`;
- `apply.py`: applying a setting to a model and torch's global state, and undoing it exactly;
- `matmul.py`: float32 matmul precision (TF32), saved and restored exactly;
- `policy_history.py`: how autocast policies changed between PyTorch releases;
- `fp8.py`: torchao's fp8 training recipes, applied and undone;
- `quiz.py`: what common expressions return under each device's autocast.

What makes a run behave as on the setting's device (the emulation, the virtual device, predict
mode, the autocast policy read from the build) is in `ampscope.runtime`, the layer below. This
layer sits beside `models`; the recorders and the workloads use it.
"""

from ampscope.precision.apply import AUTOCAST_DEVICES, GlobalState, ModelState, applied, main_dtype
from ampscope.precision.setting import (
    DEVICES,
    DTYPES,
    GRAMMAR,
    Setting,
    default_autocast_dtype,
    device_available,
    on_device,
    parse_setting,
    resolve_device,
)

__all__ = [
    "AUTOCAST_DEVICES", "DEVICES", "DTYPES", "GRAMMAR", "GlobalState", "ModelState", "Setting",
    "applied", "default_autocast_dtype", "device_available", "main_dtype", "on_device",
    "parse_setting", "resolve_device",
]
