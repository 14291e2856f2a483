"""Running under a setting: what a precision setting is, and everything that makes a run behave
as it would on the setting's device.

- `setting.py`: the setting grammar (`cuda:fp32+amp-bf16`) and `Setting`;
- `apply.py`: applying a setting to a model and torch's global state, and undoing it exactly;
- `matmul.py`: float32 matmul precision (TF32), saved and restored exactly;
- `autocast_policy.py`: the autocast policy of any device, read from the installed build;
- `policy_history.py`: how autocast policies changed between PyTorch releases;
- `emulation.py`: another device's autocast on CPU tensors (`--device cuda` without a GPU);
- `attention_choice.py` / `attention_kernels.py`: which SDPA backend a GPU would pick, and its
  ops run on CPU tensors;
- `norm_stats.py`: normalization statistics in the dtypes the target device keeps them;
- `virtual_device.py`: the emulated device's API (`torch.cuda`, `torch.accelerator`,
  autocast), with `device_mode.py` (tensors that report the target device);
- `predict.py`: predict mode, the run on fake tensors;
- `fp8.py`: torchao's fp8 training recipes, applied and undone;
- `quiz.py`: what common expressions return under each device's autocast.

This layer sits above `records` and beside `models`; the recorders and the workloads use it.
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
