"""What makes a run behave as on another device, or on fake tensors: the machinery a setting
runs on (precision/ says what a setting is and applies it).

- `autocast_policy.py`: the autocast policy of any device, read from the installed build;
- `emulation.py`: another device's autocast on CPU tensors (`--device cuda` without a GPU);
- `attention_choice.py` / `attention_kernels.py`: which SDPA backend a GPU would pick, and its
  ops run on CPU tensors;
- `norm_stats.py`: normalization statistics in the dtypes the target device keeps them;
- `virtual_device.py`: the emulated device's API (`torch.cuda`, `torch.accelerator`,
  autocast), with `device_mode.py` (tensors that report the target device);
- `predict.py`: predict mode, the run on fake tensors.

This layer sits above `records` and below `precision`; nothing here imports a setting.
"""
