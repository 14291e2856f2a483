"""The device types a run can target, and what each does differently: one entry a device.

The setting grammar, the command line's `--device` choices, the virtual device
(runtime/virtual_device.py) and the emulation (runtime/emulation.py) read every per-device
difference from this table, so adding a device type is one `DeviceType` in `DEVICE_TYPES`
plus its tests (tests/test_device_types.py shows a test-only one).

What needs no entry because the running build says it: a device's autocast policy (which ops
autocast casts, to which dtype; read from the build's `Autocast<Device>` kernels by
runtime/autocast_policy.py), the dtypes its norm kernels keep their statistics in
(runtime/norm_stats.py), and whether PyTorch's optimizers pick their foreach implementation
on it. What holds on every device, as in PyTorch itself: `torch.autocast(device_type)` casts
only the tensors on that device type, so `torch.autocast("cpu")` around a model on `cuda`
casts nothing (an emulated run follows that too, though its tensors live on the CPU).

Nothing here imports torch: the command line reads the names before any command runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICE_TYPES", "DeviceType", "device_type"]


@dataclass(frozen=True)
class DeviceType:
    """What a run on one device type does that a CPU run does not, as far as ampscope models it.

    `autocast_dtype`: the dtype `torch.autocast(name)` takes when none is given, which
    `torch.get_autocast_dtype(name)` answers outside any autocast region; None: the running
    build's own default, read from it. `accelerator` and `capability`: the accelerator (a name of
    the hardware table) and compute capability the virtual device reports when the run asks
    for none (`--gpu` names the one it is, runtime/virtual_device.py); None: it names none,
    and an asked accelerator is only cuda's. `attention`: whose `scaled_dot_product_attention`
    kernel choice an emulated run makes ("cuda": the backend PyTorch picks on that accelerator, runtime/attention_choice.py;
    "cpu": the CPU's kernels, said in a note). `rnn`: "cudnn" where the device's RNN layers run
    cuDNN's fused kernel (runtime/rnn_choice.py), "cpu" otherwise. What an emulated run
    cannot do (a custom kernel, a real collective) fails where it is called, in one line
    naming the call (runtime/emulation.py's `device_api_error`).
    """

    name: str
    autocast_dtype: str | None = None
    accelerator: str | None = None
    capability: tuple[int, int] | None = None
    attention: str = "cpu"
    rnn: str = "cpu"


DEVICE_TYPES: dict[str, DeviceType] = {
    d.name: d for d in (
        DeviceType("cpu"),
        DeviceType("cuda", accelerator="h100", capability=(9, 0), attention="cuda", rnn="cudnn"),
        DeviceType("mps"),
        DeviceType("xpu"),
    )
}


def device_type(name: str) -> DeviceType:
    """The entry for `name` ("cuda", or "cuda:1": its type); KeyError for an unknown type."""
    return DEVICE_TYPES[name.partition(":")[0]]
