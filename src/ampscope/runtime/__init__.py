"""What makes a run behave as on another device, or on fake tensors: the machinery a setting
runs on (precision/ says what a setting is and applies it).

- `autocast_policy.py`: the autocast policy of any device, read from the installed build;
- `emulation.py`: another device's autocast on CPU tensors (`--device cuda` without a GPU);
- `autocast_key.py`: autocast's state at a device's dispatch key, as torch keeps it;
- `virtual_autocast.py`: each device type's autocast state kept apart on the virtual device;
- `attention_choice.py` / `attention_kernels.py`: which SDPA backend a GPU would pick, and its
  ops run on CPU tensors;
- `half_matmul.py`: float16 matmuls as a GPU computes them (float32 accumulation, one
  rounding), at float32's speed on a CPU without float16 arithmetic; `integer_histc.py`:
  `histc` of integer tensors as CUDA counts them, which the CPU's kernel refuses;
- `rnn_choice.py` / `rnn_kernels.py`: whether a GPU runs an RNN call through cuDNN, and
  cuDNN's RNN ops run on CPU tensors;
- `norm_stats.py`: normalization statistics in the dtypes the target device keeps them;
- `virtual_device.py`: the emulated device's API (`torch.cuda`, `torch.accelerator`,
  autocast), with `device_mode.py` (tensors that report the target device), `device_rng.py`
  (its generators and seeds), `device_load.py` (`torch.load` onto it) and
  `device_internals.py` (the accelerator torch's own code asks for, tensor subclasses on it);
- `user_frames.py`: the user's line an error names;
- `compiled.py`: `torch.compile` during a run: what it compiles runs eagerly; `cuda_graphs.py`:
  CUDA graphs on the virtual device, captured blocks run once, eagerly;
- `predict.py`: predict mode, the run on fake tensors; `fake_buffers.py`: the buffers
  torch.distributed makes of fake weights (FSDP2's unsharded parameters) fake too.
- `process_group.py`: a script's process groups on gloo (`run --nproc`), NCCL's PREMUL_SUM
  run as a SUM there.
- `collective_watch.py`: the collective each rank of `run --nproc` is in, for the line that
  names where a job stopped by its deadline hung.
- `workers.py`: DataLoader workers forked during a run leave it; batches pinned on the
  virtual device stay on the CPU.

This layer sits above `records` and below `precision`; nothing here imports a setting.
"""
