"""Accelerators: peak FLOP/s, memory and bandwidth, every figure sourced.

- `known.py`: the built-in table `KNOWN` (and its conventions), `peak_flops`, `mfu`,
  `describe`;
- `user.py`: the user's own figures (a TOML table merged over `KNOWN`: `table()`;
  `--peak-flops`/`--memory`: `with_figures`), and `lookup`/`by_name` in the merged table, `stood_for` (a run's GPU);
- `kernels.py`: the step-time model's figures (achievable fractions of peak, GEMM tiles, launch
  and host overhead, attention kernels, interconnect), each with its source, `params(acc)`;
- `device_types.py`: the device types a run can target (cpu, cuda, mps, xpu) and what each
  does differently, one `DeviceType` entry a device;
- `cuda_allocator.py`: PyTorch's CUDA caching allocator, its rules replayed over allocation
  events (`Event`, `AllocatorConfig` from PYTORCH_CUDA_ALLOC_CONF, `replay`, `AllocatorReplay`).

Nothing here imports torch: the command line reads it before any command runs.
"""

from ampscope.hardware.known import *  # noqa: F403 - the table's entries, by name
from ampscope.hardware.known import __all__ as _known
from ampscope.hardware.user import (
    DTYPE_ALIASES,
    by_name,
    lookup,
    parse_peak_flops,
    parse_size,
    stood_for,
    table,
    user_table_path,
    with_figures,
)

__all__ = [*_known, "DTYPE_ALIASES", "by_name", "lookup", "parse_peak_flops", "parse_size",
           "stood_for", "table", "user_table_path", "with_figures"]
